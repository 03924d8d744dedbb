//! The form-token layer: the first submission with a token reaches the handler, repeats and
//! strangers are refused with their codes, and a request without a token is 400.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem::{SharedStore, SystemClock, Tokens};
use idem_http::{FormTokenLayer, ScopeSource};
use idem_store::MemoryStore;
use serde_json::Value;
use tower::ServiceExt;

async fn send(app: &Router, token: Option<&str>, auth: &str) -> (StatusCode, Value) {
    let mut req = Request::post("/orders").header("authorization", auth);
    if let Some(t) = token {
        req = req.header("form-token", t);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn a_form_is_submitted_once_per_token() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let tokens = Tokens::new(store, Arc::new(SystemClock));
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let app = Router::new().route(
        "/orders",
        post(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                "ordered"
            }
        })
        .layer(FormTokenLayer::new(tokens.clone(), "order-form")),
    );
    // The token is issued to the scope the layer derives from the caller's credential.
    let alice = "Bearer alice";
    let parts = Request::get("/")
        .header("authorization", alice)
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let scope = ScopeSource::default().scope_of(&parts);
    let t = tokens
        .issue(scope.as_str(), "order-form", Duration::from_secs(600))
        .await
        .unwrap();

    let (status, body) = send(&app, None, alice).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_missing"))
    );
    // Someone else's request with Alice's token is refused and leaves it usable.
    let (status, body) = send(&app, Some(&t.token), "Bearer mallory").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("unknown"))
    );
    let (status, _) = send(&app, Some(&t.token), alice).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = send(&app, Some(&t.token), alice).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("already_used"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
