//! What the endpoint suites share: two callers with API keys, and a JSON POST as one of them.

#![allow(clippy::unwrap_used)]
// Each suite uses some of these.
#![allow(dead_code)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use idem_server::auth::Auth;
use idem_server::{AppState, router};
use serde_json::Value;
use tower::ServiceExt;

/// The shop's API key.
pub(crate) const SHOP: &str = "shop-key-0123456789abcdef";
/// The bank's API key.
pub(crate) const BANK: &str = "bank-key-0123456789abcdef";

/// `state` with the shop and the bank as its callers.
pub(crate) fn with_callers(mut state: AppState) -> AppState {
    let keys = format!("shop {SHOP}\nbank {BANK}\n");
    state.auth = Arc::new(Auth::parse_keys(&keys, "keys").unwrap());
    state
}

/// The listener that serves `path`: the admin listener's for the operator's endpoints under
/// `/_idem` (the admin page, the record tools, segments, locks), the API's for the rest.
pub(crate) fn app_for(state: &AppState, path: &str) -> axum::Router {
    let on_api = ["/_idem/health", "/_idem/metrics"]
        .iter()
        .any(|p| path.starts_with(p));
    if path.starts_with("/_idem") && !on_api {
        idem_server::admin_router(state.clone())
    } else {
        router(state.clone())
    }
}

/// POSTs `body` to `path` as the caller with API key `key`: the status and the JSON answer.
pub(crate) async fn post(
    state: &AppState,
    key: &str,
    path: &str,
    body: Value,
) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Body::from(body.to_string()))
        .unwrap();
    let res = app_for(state, path).oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// GETs `path` as the caller with API key `key`: the status, the content type and the JSON
/// answer.
pub(crate) async fn get(state: &AppState, key: &str, path: &str) -> (StatusCode, String, Value) {
    let req = Request::get(path)
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Body::empty())
        .unwrap();
    let res = app_for(state, path).oneshot(req).await.unwrap();
    let status = res.status();
    let content_type = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        content_type,
        serde_json::from_slice(&bytes).unwrap(),
    )
}

/// Which acquisition of its record the fence in an answer is (1 for the lease that created it).
pub(crate) fn acquisition(fence: &Value) -> u32 {
    idem_core::Lease::acquisition_of(fence.as_u64().expect("a fence"))
}
