//! Configuration parsers (store URLs, API key files): any input gives a value or a message,
//! never a panic, and a message never repeats an API key.
#![no_main]

use idem_server::auth::Auth;
use idem_store::StoreUrl;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = text.parse::<StoreUrl>() {
        assert!(!e.to_string().is_empty());
    }
    if let Err(e) = Auth::parse_keys(text, "fuzz") {
        let message = e.to_string();
        for line in text.lines() {
            if let Some(key) = line.split_whitespace().nth(1) {
                if key.len() >= 16 {
                    assert!(!message.contains(key), "an API key leaked into an error");
                }
            }
        }
    }
});
