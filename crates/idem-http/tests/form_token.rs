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
use idem_core::{SharedStore, SystemClock, Tokens};
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

/// A token for the order form, issued to the scope the layer derives from `auth`.
async fn token_for(tokens: &Tokens, auth: &str) -> idem_core::IssuedToken {
    let parts = Request::get("/")
        .header("authorization", auth)
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let scope = ScopeSource::default().scope_of(&parts);
    tokens
        .issue(scope.as_str(), "order-form", Duration::from_secs(600))
        .await
        .unwrap()
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
    let t = token_for(&tokens, alice).await;

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

/// A client that hangs up once its token is spent (a double click aborts the first submission)
/// does not cancel the handler: the order it was spending the token on is still made.
#[tokio::test]
async fn a_spent_token_s_handler_finishes_when_the_client_hangs_up() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let tokens = Tokens::new(store, Arc::new(SystemClock));
    let (started, finished) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (s, f) = (started.clone(), finished.clone());
    let app = Router::new().route(
        "/orders",
        post(move || {
            let (s, f) = (s.clone(), f.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                f.fetch_add(1, Ordering::SeqCst);
                "ordered"
            }
        })
        .layer(FormTokenLayer::new(tokens.clone(), "order-form")),
    );
    let alice = "Bearer alice";
    let t = token_for(&tokens, alice).await;
    let req = Request::post("/orders")
        .header("authorization", alice)
        .header("form-token", &t.token)
        .body(Body::empty())
        .unwrap();
    // The client gives up while the handler runs.
    let gave_up = tokio::time::timeout(Duration::from_millis(100), app.clone().oneshot(req)).await;
    assert!(gave_up.is_err());
    assert_eq!(started.load(Ordering::SeqCst), 1);
    idem_testkit::within("the handler to finish", async {
        while finished.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let (status, body) = send(&app, Some(&t.token), alice).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("already_used"))
    );
}
