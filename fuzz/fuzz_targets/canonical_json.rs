//! Canonical JSON: any accepted document has a canonical form that is valid JSON, canonical
//! again when re-read, and fingerprints like the original; the same for the exact reader.
#![no_main]

use idem_core::Fingerprint;
use idem_core::fingerprint::to_canonical_string;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The exact reader: never a panic; its canonical text is JSON (as the grammar has it:
    // `serde_json` itself refuses numbers past f64's range), and canonical again.
    if let Ok(exact) = idem_core::json::parse(data) {
        let text = exact.to_string();
        let again = idem_core::json::parse(text.as_bytes()).expect("canonical text is JSON");
        assert_eq!(again.to_string(), text);
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let canonical = to_canonical_string(&value);
    let reread: serde_json::Value =
        serde_json::from_str(&canonical).expect("canonical form is valid JSON");
    assert_eq!(to_canonical_string(&reread), canonical);
    assert_eq!(Fingerprint::of_json(&value), Fingerprint::of_json(&reread));
});
