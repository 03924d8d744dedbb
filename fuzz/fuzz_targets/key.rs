//! Key parts: accepted exactly when they follow the rule, and never altered.
#![no_main]

use idem_core::{ClientKey, Key};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let valid = !text.is_empty()
        && text.len() <= 255
        && text.bytes().all(|b| b.is_ascii_graphic());
    match ClientKey::new(text) {
        Ok(k) => {
            assert!(valid);
            assert_eq!(k.as_str(), text);
        }
        Err(e) => {
            assert!(!valid);
            let _ = e.to_string();
        }
    }
    let mut parts = text.splitn(3, '\n');
    if let (Some(s), Some(n), Some(c)) = (parts.next(), parts.next(), parts.next()) {
        if let Ok(key) = Key::parse(s, n, c) {
            assert_eq!(key.client_key().as_str(), c);
            assert_eq!(key, Key::parse(s, n, c).expect("accepted once, accepted again"));
        }
    }
});
