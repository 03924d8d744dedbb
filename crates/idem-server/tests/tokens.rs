//! The token endpoints: issue, consume once, and the refusal codes.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::{BANK, SHOP, post, with_callers};
use idem_server::AppState;
use idem_store::MemoryStore;
use serde_json::json;

fn state() -> AppState {
    with_callers(AppState::new(Arc::new(MemoryStore::new())))
}

#[tokio::test]
async fn a_token_is_consumed_once_and_each_refusal_has_its_code() {
    let state = state();
    let (status, body) = post(&state, SHOP, "/v1/tokens", json!({"purpose": "order-form"})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let token = body["token"].as_str().unwrap().to_owned();
    assert_eq!(token.len(), 32);
    assert!(body["expires_at"].is_string());

    let consume = |key, purpose: &str| {
        let (state, token, purpose) = (state.clone(), token.clone(), purpose.to_owned());
        async move {
            post(
                &state,
                key,
                "/v1/tokens/consume",
                json!({"token": token, "purpose": purpose}),
            )
            .await
        }
    };
    let (status, body) = consume(SHOP, "password-reset").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("wrong_purpose"))
    );
    // Another caller is not told the token exists.
    let (status, body) = consume(BANK, "order-form").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("unknown"))
    );
    let (status, body) = consume(SHOP, "order-form").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({"consumed": true}));
    let (status, body) = consume(SHOP, "order-form").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("already_used"))
    );
    // Used or not, another caller is not told the token exists.
    let (status, body) = consume(BANK, "order-form").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("unknown"))
    );
}

#[tokio::test]
async fn bad_requests_are_refused() {
    let state = state();
    for (body, code) in [
        (json!({"purpose": "a b"}), "invalid_request"),
        // The code the README gives for a duration out of its range, as `begin` answers.
        (json!({"purpose": "x", "ttl_ms": 0}), "invalid_duration"),
        (
            json!({"purpose": "x", "ttl_ms": 40_000_000_000u64}),
            "invalid_duration",
        ),
        (json!({"purpose": "x", "extra": 1}), "invalid_request"),
    ] {
        let (status, reply) = post(&state, SHOP, "/v1/tokens", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {reply}");
        assert_eq!(reply["code"], code, "{body}");
    }
    let (status, _) = post(
        &state,
        "nobody-0123456789abcdef",
        "/v1/tokens",
        json!({"purpose": "x"}),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}
