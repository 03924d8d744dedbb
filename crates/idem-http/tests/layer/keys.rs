//! What makes two requests one: keys, fingerprints and callers.

use super::*;

#[tokio::test]
async fn a_retry_gets_the_first_answer_without_running_again() {
    let app = app(Policy::default());
    let first = app.send(post_with("/orders", "k1", "pay 10")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "run 1: pay 10");
    assert!(!first.replayed());
    for _ in 0..3 {
        let again = app.send(post_with("/orders", "k1", "pay 10")).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.body, "run 1: pay 10");
        assert!(again.replayed());
        assert_eq!(again.headers["x-order"], "ord_1");
        assert_eq!(again.headers["content-type"], first.headers["content-type"]);
        assert!(again.headers.get("set-cookie").is_none());
        assert!(again.headers.get("date").is_none());
    }
    assert_eq!(app.runs(), 1);
    // another key runs again
    let other = app.send(post_with("/orders", "k2", "pay 10")).await;
    assert_eq!(other.body, "run 2: pay 10");
}

#[tokio::test]
async fn quoted_and_bare_keys_name_the_same_record() {
    let app = app(Policy::default());
    app.send(post_with("/orders", "abc", "x")).await;
    let again = app.send(post_with("/orders", "\"abc\"", "x")).await;
    assert!(again.replayed());
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn unguarded_methods_pass_through() {
    let app = app(Policy::default());
    for method in [Method::GET, Method::PUT] {
        for _ in 0..2 {
            let r = app
                .send(req(
                    method.clone(),
                    "/orders",
                    &[("idempotency-key", "k")],
                    "",
                ))
                .await;
            assert_eq!(r.status, StatusCode::CREATED);
            assert!(!r.replayed());
        }
    }
    assert_eq!(app.runs(), 4);
    // PUT can be guarded when configured
    let app = crate::app(Policy::default().methods([Method::PUT]));
    for _ in 0..2 {
        app.send(req(Method::PUT, "/orders", &[("idempotency-key", "k")], ""))
            .await;
    }
    app.send(post_with("/orders", "k", "")).await;
    assert_eq!(app.runs(), 2);
}

#[tokio::test]
async fn missing_key_is_refused_only_where_required() {
    let optional = app(Policy::default());
    for _ in 0..2 {
        let r = optional.send(req(Method::POST, "/orders", &[], "x")).await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    assert_eq!(optional.runs(), 2);

    let required = app(Policy::default().key(KeyRequirement::Required));
    let r = required.send(req(Method::POST, "/orders", &[], "x")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "idempotency_key_missing");
    assert_eq!(r.headers["content-type"], "application/problem+json");
    assert_eq!(required.runs(), 0);
}

#[tokio::test]
async fn invalid_or_repeated_keys_are_refused_before_the_handler() {
    let app = app(Policy::default());
    let long = "k".repeat(256);
    for bad in ["", "a b", "\"open", "a,b", long.as_str()] {
        let r = app.send(post_with("/orders", bad, "x")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(r.code(), "idempotency_key_invalid");
        assert!(!r.body.contains("kkkk"), "the value is never echoed");
    }
    let twice = req(
        Method::POST,
        "/orders",
        &[("idempotency-key", "a"), ("idempotency-key", "a")],
        "x",
    );
    let r = app.send(twice).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "idempotency_key_invalid");
    assert_eq!(app.runs(), 0);
}

#[tokio::test]
async fn another_request_with_the_same_key_is_a_mismatch() {
    let app = app(Policy::default());
    app.send(post_with("/orders", "k", "pay 10")).await;
    for other in [
        post_with("/orders", "k", "pay 99"),
        post_with("/orders?currency=eur", "k", "pay 10"),
        post_with("/fail", "k", "pay 10"),
    ] {
        let r = app.send(other).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(r.code(), "idempotency_key_mismatch");
    }
    assert_eq!(app.runs(), 1);

    let stripe = crate::app(Policy::default().preset(Preset::Stripe));
    stripe.send(post_with("/orders", "k", "pay 10")).await;
    let r = stripe.send(post_with("/orders", "k", "pay 99")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "idempotency_key_mismatch");
}

/// A JSON POST to `/orders` under `key`.
fn json(key: &str, body: &str) -> Request<Body> {
    req(
        Method::POST,
        "/orders",
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        body,
    )
}

#[tokio::test]
async fn json_bodies_are_compared_by_value() {
    let app = app(Policy::default());
    app.send(json("k", r#"{"amount": 10, "to": "bob"}"#)).await;
    let r = app.send(json("k", r#"{"to":"bob","amount":10.0}"#)).await;
    assert!(r.replayed());
    assert_eq!(app.runs(), 1);

    // only the chosen fields count
    let app = crate::app(Policy::default().fingerprint_json_fields(["/amount", "/to"]));
    app.send(json("k", r#"{"amount":10,"to":"bob","sent_at":1}"#))
        .await;
    let r = app
        .send(json("k", r#"{"amount":10,"to":"bob","sent_at":2}"#))
        .await;
    assert!(r.replayed());
    let r = app
        .send(json("k", r#"{"amount":11,"to":"bob","sent_at":2}"#))
        .await;
    assert_eq!(r.code(), "idempotency_key_mismatch");
}

/// Numbers count as written, a member named twice is refused before anything runs, and the
/// stored answer comes back byte for byte.
#[tokio::test]
async fn json_numbers_count_exactly_and_a_member_named_twice_is_refused() {
    let app = app(Policy::default());
    let first = app.send(json("big", r#"{"n":18446744073709551616}"#)).await;
    let r = app.send(json("big", r#"{"n":18446744073709551617}"#)).await;
    assert_eq!(r.code(), "idempotency_key_mismatch");
    app.send(json("tenth", r#"{"n":0.1}"#)).await;
    let r = app
        .send(json("tenth", r#"{"n":0.10000000000000000001}"#))
        .await;
    assert_eq!(r.code(), "idempotency_key_mismatch");
    assert!(app.send(json("tenth", r#"{"n":1e-1}"#)).await.replayed());
    let again = app
        .send(json("big", r#"{ "n" : 18446744073709551616 }"#))
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "replayed byte for byte");
    let runs = app.runs();
    for twice in [r#"{"amount":100,"amount":999}"#, r#"{"a":[{"x":1,"x":1}]}"#] {
        let r = app.send(json("dup", twice)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.code(), "malformed_json");
    }
    assert_eq!(app.runs(), runs, "nothing ran");
    // Fields chosen by pointer are read exactly too.
    let fields = crate::app(Policy::default().fingerprint_json_fields(["/n"]));
    fields
        .send(json("f", r#"{"n":18446744073709551616,"at":1}"#))
        .await;
    let r = fields
        .send(json("f", r#"{"n":18446744073709551617,"at":1}"#))
        .await;
    assert_eq!(r.code(), "idempotency_key_mismatch");
}

#[tokio::test]
async fn fingerprint_headers_are_part_of_the_request() {
    let app =
        app(Policy::default()
            .fingerprint_headers([axum::http::HeaderName::from_static("x-tenant")]));
    let with = |tenant: &str| {
        req(
            Method::POST,
            "/orders",
            &[("idempotency-key", "k"), ("x-tenant", tenant)],
            "x",
        )
    };
    app.send(with("a")).await;
    assert!(app.send(with("a")).await.replayed());
    assert_eq!(app.send(with("b")).await.code(), "idempotency_key_mismatch");
}

#[tokio::test]
async fn callers_never_see_each_others_answers() {
    let app = app(Policy::default());
    let as_caller = |who: &str, body: &str| {
        req(
            Method::POST,
            "/orders",
            &[("idempotency-key", "shared-key"), ("authorization", who)],
            body,
        )
    };
    let a = app.send(as_caller("Bearer alice", "alice pays")).await;
    assert_eq!(a.body, "run 1: alice pays");
    // Bob reuses Alice's key, even with Alice's exact body: his request runs on its own.
    let b = app.send(as_caller("Bearer bob", "alice pays")).await;
    assert!(!b.replayed());
    assert_eq!(b.body, "run 2: alice pays");
    // and without credentials: a third scope
    let anon = app
        .send(post_with("/orders", "shared-key", "alice pays"))
        .await;
    assert_eq!(anon.body, "run 3: alice pays");
    // each caller's retry replays its own answer
    assert_eq!(
        app.send(as_caller("Bearer alice", "alice pays")).await.body,
        a.body
    );
    assert_eq!(
        app.send(as_caller("Bearer bob", "alice pays")).await.body,
        b.body
    );
    assert_eq!(app.runs(), 3);
}
