//! The order route under retries: one order per key, the first answer replayed.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use orders_service::{Orders, app};
use tower::ServiceExt;

fn order(key: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::post("/orders").header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

async fn send(app: &axum::Router, req: Request<Body>) -> (StatusCode, bool, String) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, replayed, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn retries_create_one_order() {
    let orders = Orders::default();
    let app = app(Arc::new(idem_store::MemoryStore::new()), orders.clone());
    let body = r#"{"item":"tea","quantity":2}"#;
    let (status, replayed, first) = send(&app, order(Some("o-1"), body)).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    for _ in 0..3 {
        let (status, replayed, again) = send(&app, order(Some("o-1"), body)).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true));
        assert_eq!(again, first);
    }
    assert_eq!(orders.count(), 1);
    // The same key for another order is refused; a new key makes a new order.
    let (status, _, _) = send(&app, order(Some("o-1"), r#"{"item":"tea","quantity":3}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, _, _) = send(&app, order(Some("o-2"), body)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(orders.count(), 2);
    // The route requires a key; reads do not.
    let (status, _, problem) = send(&app, order(None, body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(problem.contains("idempotency_key_missing"));
    let res = app
        .clone()
        .oneshot(Request::get("/orders/1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(orders.count(), 2);
}
