//! What the endpoint suites share: two callers with API keys, and a JSON POST as one of them.

#![allow(clippy::unwrap_used)]

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
    let res = router(state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}
