//! Request paths: any text is brought to one normal form or refused, never a panic; a normal
//! form is its own normal form, holds nothing a server could read two ways, and matches a
//! route pattern without panicking.
#![no_main]

use idem_gateway::gateway::PathPattern;
use idem_gateway::gateway::path::normalize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(normal) = normalize(text) else { return };
    assert_eq!(normalize(&normal).as_deref(), Ok(normal.as_str()));
    assert!(normal.starts_with('/'));
    assert!(!normal.contains("//"), "{normal}");
    assert!(!normal.contains([';', '\\']), "{normal}");
    assert!(normal.bytes().all(|b| b.is_ascii_graphic()), "{normal}");
    assert!(normal.split('/').all(|s| s != "." && s != ".."), "{normal}");
    for pattern in ["/**", "/v1/payments/**", "/v1/*/capture"] {
        let _ = PathPattern::parse(pattern).map(|p| p.matches(&normal));
    }
    if let Ok(p) = PathPattern::parse(text) {
        let _ = p.matches(&normal);
    }
});
