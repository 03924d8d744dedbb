//! The `Idempotency-Key` header parser: never panics, and whatever it accepts is a valid key
//! that parses again to itself when sent back as `encode_key` writes it; and any input
//! `encode_key` accepts reads back as itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(key) = idem_http::parse_key(data) {
        assert!((1..=idem_http::header::MAX_KEY_LEN).contains(&key.len()));
        assert!(key.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        let sent = idem_http::encode_key(&key).expect("a parsed key can be sent");
        assert_eq!(idem_http::parse_key(sent.as_bytes()).as_deref(), Ok(key.as_str()));
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(sent) = idem_http::encode_key(text)
    {
        assert_eq!(idem_http::parse_key(sent.as_bytes()).as_deref(), Ok(text));
    }
});
