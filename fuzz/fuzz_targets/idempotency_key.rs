//! The `Idempotency-Key` header parser: never panics, and whatever it accepts is a valid key
//! that parses again to itself when sent back as a structured-field string.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(key) = idem_http::parse_key(data) {
        assert!((1..=idem_http::header::MAX_KEY_LEN).contains(&key.len()));
        assert!(key.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        assert_eq!(idem_http::parse_key(quoted.as_bytes()).as_deref(), Ok(key.as_str()));
    }
});
