//! Every kind of bad input, each with its stable code.

use super::*;

#[tokio::test]
async fn bad_input_gets_a_stable_code() {
    let api = Api::new();
    let long_key = "k".repeat(256);
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (
            json!({"namespace": "pay", "key": long_key, "request": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_key",
        ),
        (
            json!({"namespace": "pay", "key": "", "request": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_key",
        ),
        (
            json!({"namespace": "pay", "key": "é", "request": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_key",
        ),
        (
            json!({"namespace": "p/q", "key": "k", "request": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_key",
        ),
        (
            json!({"namespace": "pay", "key": "k"}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"namespace": "pay", "key": "k", "request": 1, "fingerprint": "x"}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"namespace": "pay", "key": "k", "fingerprint": ""}),
            StatusCode::BAD_REQUEST,
            "invalid_fingerprint",
        ),
        (
            json!({"namespace": "pay", "key": "k", "fingerprint": "x".repeat(1025)}),
            StatusCode::BAD_REQUEST,
            "invalid_fingerprint",
        ),
        (
            json!({"namespace": "pay", "key": "k", "request": 1, "lease_ms": 0}),
            StatusCode::BAD_REQUEST,
            "invalid_duration",
        ),
        (
            json!({"namespace": "pay", "key": "k", "request": 1, "ttl_ms": 400u64 * 24 * 3600 * 1000}),
            StatusCode::BAD_REQUEST,
            "invalid_duration",
        ),
        (
            json!({"namespace": "pay", "key": "k", "request": 1, "lease_ms": -1}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"namespace": "pay", "key": 7, "request": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"namespace": "pay", "key": "k", "request": 1, "extra": true}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (json!([1, 2]), StatusCode::BAD_REQUEST, "invalid_request"),
    ];
    for (body, status, code) in cases {
        let r = api.post("/v1/records/begin", None, &body).await;
        assert_eq!((r.status, r.code()), (status, code), "{body}");
    }
    for lease in [
        "",
        "1",
        "x.y",
        "1.zz",
        "1.00",
        "-1.0123456789abcdef0123456789abcdef",
    ] {
        let r = api.complete(None, "k", lease, json!(1)).await;
        assert_eq!(r.code(), "invalid_lease", "{lease:?}");
    }
    let r = api
        .post_raw(
            "/v1/records/begin",
            None,
            "application/json",
            "{\"namespace\":".into(),
        )
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "malformed_json")
    );
    let r = api
        .post_raw("/v1/records/begin", None, "text/plain", "{}".into())
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
    );
    let big = json!({"namespace": "pay", "key": "k", "request": "x".repeat(5000)}).to_string();
    let r = api
        .post_raw("/v1/records/begin", None, "application/json", big)
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
    );
    let r = api
        .get(&format!("/v1/records/pay/{}", "k".repeat(256)), None)
        .await;
    assert_eq!(r.code(), "invalid_key");
    let r = api.get("/v1/records/pay/absent", None).await;
    assert_eq!((r.status, r.code()), (StatusCode::NOT_FOUND, "not_found"));
    let r = api.get("/v1/nothing", None).await;
    assert_eq!((r.status, r.code()), (StatusCode::NOT_FOUND, "not_found"));
    let r = api.get("/v1/records/begin", None).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
    );
}

/// Every POST endpoint, with a body of the right shape.
fn post_endpoints() -> Vec<(&'static str, Value)> {
    let lease = "1.0123456789abcdef0123456789abcdef";
    let lock = "0123456789abcdef0123.1";
    vec![
        (
            "/v1/records/begin",
            json!({"namespace": "pay", "key": "k", "request": 1}),
        ),
        (
            "/v1/records/complete",
            json!({"namespace": "pay", "key": "k", "lease": lease, "response": 1}),
        ),
        (
            "/v1/records/release",
            json!({"namespace": "pay", "key": "k", "lease": lease}),
        ),
        (
            "/v1/records/renew",
            json!({"namespace": "pay", "key": "k", "lease": lease}),
        ),
        ("/v1/tokens", json!({"purpose": "p"})),
        ("/v1/tokens/consume", json!({"token": "t", "purpose": "p"})),
        ("/v1/locks/l/acquire", json!({"lease_ms": 1000})),
        ("/v1/locks/l/renew", json!({"lock": lock, "lease_ms": 1000})),
        ("/v1/locks/l/release", json!({"lock": lock})),
    ]
}

#[tokio::test]
async fn undecodable_paths_and_bad_bodies_are_problems_on_every_endpoint() {
    let store = Arc::new(MemoryStore::new());
    let api = Api::with_state(
        AppState::new(store.clone()).with_locks(store),
        Auth::anonymous(),
    );
    // `send` checks that every refusal is problem+json.
    for path in [
        "/v1/ids/segment/%FF",
        "/v1/records/%FF/k",
        "/v1/records/pay/%C3%28",
    ] {
        let r = api.get(path, None).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "invalid_path"),
            "{path}"
        );
    }
    for (path, body) in post_endpoints() {
        if let Some(action) = path.strip_prefix("/v1/locks/l/") {
            let r = api
                .post(&format!("/v1/locks/%FF/{action}"), None, &body)
                .await;
            assert_eq!(
                (r.status, r.code()),
                (StatusCode::BAD_REQUEST, "invalid_path"),
                "{path}"
            );
        }
        let r = api
            .post_raw(path, None, "application/json", "{oops".into())
            .await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "malformed_json"),
            "{path}"
        );
        let r = api.post(path, None, &json!([1])).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "invalid_request"),
            "{path}"
        );
        let r = api
            .post_raw(path, None, "text/plain", body.to_string())
            .await;
        assert_eq!(r.code(), "unsupported_media_type", "{path}");
        let big = json!({"padding": "x".repeat(5000)}).to_string();
        let r = api.post_raw(path, None, "application/json", big).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            "{path}"
        );
    }
}

/// What the HTTP library refuses before idem sees the request (here a space in the path)
/// gets its bare answer, not a problem+json: the README lists these cases.
#[tokio::test]
async fn requests_the_http_parser_refuses_get_its_bare_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(AppState::new(Arc::new(MemoryStore::new())));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /v1/ids/uuid 7 HTTP/1.1\r\nHost: idem\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    within("the answer", conn.read_to_end(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 400"), "{answer}");
    assert!(!answer.contains("problem+json"), "{answer}");
    server.abort();
}
