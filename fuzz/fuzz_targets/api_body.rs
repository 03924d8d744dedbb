//! The record API: any body on any record endpoint is answered without a server error.
#![no_main]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, header};
use idem_server::{AppState, router};
use idem_store::MemoryStore;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let path = match selector % 3 {
        0 => "/v1/records/begin",
        1 => "/v1/records/complete",
        _ => "/v1/records/release",
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let app = router(AppState::new(Arc::new(MemoryStore::new())));
        let req = Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_vec()))
            .expect("request");
        let res = app.oneshot(req).await.expect("infallible");
        assert!(!res.status().is_server_error(), "{path}: {}", res.status());
    });
});
