//! The gateway's configuration file: any text gives a config or a readable error, never a
//! panic, and so does turning every route into a policy.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(file) = idem_gateway::gateway::FileConfig::parse(text) {
        let store: idem_core::SharedStore = std::sync::Arc::new(idem_store::MemoryStore::new());
        let upstream = idem_gateway::gateway::Upstream::parse("http://127.0.0.1:1").unwrap();
        let _ = idem_gateway::gateway::Gateway::new(upstream, store).configure(&file);
    }
});
