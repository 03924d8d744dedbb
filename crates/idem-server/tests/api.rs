//! The record API over HTTP semantics: outcomes, scopes, and every kind of bad input.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use idem_core::{ManualClock, SharedStore};
use idem_server::auth::Auth;
use idem_server::{AppState, router};
use idem_store::MemoryStore;
use idem_testkit::{Fault, FaultyStore, Op, Stall, within};
use serde_json::{Value, json};
use tower::ServiceExt;

const KEY_A: &str = "shop-key-0123456789abcdef";
const KEY_B: &str = "bank-key-0123456789abcdef";

struct Api {
    app: Router,
    clock: ManualClock,
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
}

impl Reply {
    fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }
}

impl Api {
    fn new() -> Self {
        Self::with(Arc::new(MemoryStore::new()), Auth::anonymous())
    }

    fn with(store: SharedStore, auth: Auth) -> Self {
        Self::with_state(AppState::new(store), auth)
    }

    fn with_state(mut state: AppState, auth: Auth) -> Self {
        let clock = ManualClock::starting_now();
        state.clock = Arc::new(clock.clone());
        state.auth = Arc::new(auth);
        state.max_body = 4096;
        Self {
            app: router(state),
            clock,
        }
    }

    async fn send(&self, req: Request<Body>) -> Reply {
        let res = self.app.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if !status.is_success() {
            assert_eq!(
                headers[header::CONTENT_TYPE],
                "application/problem+json",
                "every error is problem+json: {body}"
            );
            assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
            assert_eq!(body["status"], status.as_u16());
        }
        Reply {
            status,
            headers,
            body,
        }
    }

    async fn post(&self, path: &str, auth: Option<&str>, body: &Value) -> Reply {
        self.post_raw(path, auth, "application/json", body.to_string())
            .await
    }

    async fn post_raw(
        &self,
        path: &str,
        auth: Option<&str>,
        content_type: &str,
        body: String,
    ) -> Reply {
        let mut req = Request::post(path).header(header::CONTENT_TYPE, content_type);
        if let Some(key) = auth {
            req = req.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        self.send(req.body(Body::from(body)).unwrap()).await
    }

    async fn get(&self, path: &str, auth: Option<&str>) -> Reply {
        let mut req = Request::get(path);
        if let Some(key) = auth {
            req = req.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        self.send(req.body(Body::empty()).unwrap()).await
    }

    async fn begin(&self, auth: Option<&str>, key: &str, request: Value) -> Reply {
        self.post(
            "/v1/records/begin",
            auth,
            &json!({"namespace": "pay", "key": key, "request": request, "lease_ms": 10_000}),
        )
        .await
    }

    async fn complete(&self, auth: Option<&str>, key: &str, lease: &str, response: Value) -> Reply {
        self.post(
            "/v1/records/complete",
            auth,
            &json!({"namespace": "pay", "key": key, "lease": lease, "response": response}),
        )
        .await
    }
}

fn lease_of(r: &Reply) -> String {
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["outcome"], "acquired", "{}", r.body);
    r.body["lease"]["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn health_reports_the_store() {
    let api = Api::new();
    let r = api.get("/healthz", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body["status"], "ok", "{}", r.body);
    assert_eq!(r.body["store"], "memory");
    assert_eq!(r.body["components"]["store"], json!({"status": "ok"}));
}

#[tokio::test]
async fn full_record_lifecycle() {
    let api = Api::new();
    let b = api
        .begin(None, "k1", json!({"amount": 1, "to": "bob"}))
        .await;
    let lease = lease_of(&b);
    assert_eq!(b.body["lease"]["fence"], 1);

    let again = api
        .begin(None, "k1", json!({"to": "bob", "amount": 1}))
        .await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.code(), "in_progress");
    assert_eq!(again.headers[header::RETRY_AFTER], "10");

    let other = api
        .begin(None, "k1", json!({"amount": 2, "to": "bob"}))
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.code(), "fingerprint_mismatch");

    let c = api.complete(None, "k1", &lease, json!({"tx": "t-1"})).await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);

    let replay = api
        .begin(None, "k1", json!({"amount": 1, "to": "bob"}))
        .await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.body["outcome"], "replay");
    assert_eq!(replay.body["response"], json!({"tx": "t-1"}));
    assert_eq!(replay.body["fence"], 1);

    let rec = api.get("/v1/records/pay/k1", None).await;
    assert_eq!(rec.status, StatusCode::OK);
    assert_eq!(rec.body["status"], "completed");
    assert_eq!(rec.body["fence"], 1);
    assert_eq!(rec.body["response"], json!({"tx": "t-1"}));
    assert!(rec.body["expires_at"].as_str().unwrap().ends_with('Z'));
}

#[tokio::test]
async fn release_then_retry_runs_again_with_a_higher_fence() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    let r = api
        .post(
            "/v1/records/release",
            None,
            &json!({"namespace": "pay", "key": "k", "lease": lease}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let again = api.begin(None, "k", json!(1)).await;
    assert_eq!(again.body["lease"]["fence"], 2);
}

#[tokio::test]
async fn stale_lease_is_refused_after_takeover() {
    let api = Api::new();
    let old = lease_of(&api.begin(None, "k", json!(1)).await);
    api.clock.advance(Duration::from_secs(11));
    let new = lease_of(&api.begin(None, "k", json!(1)).await);
    assert_ne!(old, new);
    let r = api.complete(None, "k", &old, json!("old")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "stale_lease");
    let r = api
        .post(
            "/v1/records/release",
            None,
            &json!({"namespace": "pay", "key": "k", "lease": old}),
        )
        .await;
    assert_eq!(r.code(), "stale_lease");
    let r = api.complete(None, "k", &new, json!("new")).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn a_late_complete_is_accepted_and_a_different_repeat_is_stale() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    // The lease ran out but nobody took the key over: the result is kept.
    api.clock.advance(Duration::from_secs(11));
    let r = api.complete(None, "k", &lease, json!("first")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = api.complete(None, "k", &lease, json!("first")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = api.complete(None, "k", &lease, json!("second")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "stale_lease");
    let replay = api.begin(None, "k", json!(1)).await;
    assert_eq!(replay.body["response"], json!("first"));
}

#[tokio::test]
async fn a_null_request_is_a_request() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "null", Value::Null).await);
    api.complete(None, "null", &lease, json!("done")).await;
    assert_eq!(
        api.begin(None, "null", Value::Null).await.body["outcome"],
        "replay"
    );
    assert_eq!(
        api.begin(None, "null", json!(0)).await.code(),
        "fingerprint_mismatch"
    );
}

#[tokio::test]
async fn fingerprint_string_mode() {
    let api = Api::new();
    let begin = |fp: &'static str| {
        let api = &api;
        async move {
            api.post(
                "/v1/records/begin",
                None,
                &json!({"namespace": "pay", "key": "s", "fingerprint": fp}),
            )
            .await
        }
    };
    let lease = lease_of(&begin("sha256:abc").await);
    api.complete(None, "s", &lease, json!(null)).await;
    assert_eq!(begin("sha256:abc").await.body["outcome"], "replay");
    assert_eq!(begin("sha256:abd").await.code(), "fingerprint_mismatch");
}

fn keys() -> Auth {
    Auth::parse_keys(&format!("shop {KEY_A}\nbank {KEY_B}\n"), "test").unwrap()
}

#[tokio::test]
async fn callers_never_see_each_others_records() {
    let api = Api::with(Arc::new(MemoryStore::new()), keys());
    let a = lease_of(&api.begin(Some(KEY_A), "shared", json!({"a": 1})).await);
    api.complete(Some(KEY_A), "shared", &a, json!("A's answer"))
        .await;

    // B with A's key and A's request: not a replay of A's answer, a fresh record.
    let b = api.begin(Some(KEY_B), "shared", json!({"a": 1})).await;
    assert_eq!(b.body["outcome"], "acquired");
    let rec = api.get("/v1/records/pay/shared", Some(KEY_B)).await;
    assert_eq!(rec.body["status"], "in_progress");
    assert!(rec.body.get("response").is_none());
    // B cannot use A's lease on B's record either.
    let r = api
        .complete(Some(KEY_B), "shared", &a, json!("forged"))
        .await;
    assert_eq!(r.code(), "stale_lease");
    // and A still gets its own answer
    let replay = api.begin(Some(KEY_A), "shared", json!({"a": 1})).await;
    assert_eq!(replay.body["response"], "A's answer");
}

#[tokio::test]
async fn unknown_or_missing_api_keys_are_unauthorized() {
    let api = Api::with(Arc::new(MemoryStore::new()), keys());
    for auth in [None, Some("not-a-known-key-000000")] {
        let r = api.begin(auth, "k", json!(1)).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
        assert_eq!(r.code(), "unauthorized");
        let r = api.get("/v1/records/pay/k", auth).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    let raw = Request::post("/v1/records/begin")
        .header(header::AUTHORIZATION, "Basic Zm9vOmJhcg==")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(api.send(raw).await.code(), "unauthorized");
    // the scheme name is case-insensitive (RFC 9110 §11.1)
    let shouting = Request::post("/v1/records/begin")
        .header(header::AUTHORIZATION, format!("BEARER {KEY_A}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"namespace":"pay","key":"k","request":1}"#))
        .unwrap();
    assert_eq!(api.send(shouting).await.status, StatusCode::OK);
}

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

#[tokio::test]
async fn a_failing_store_fails_closed_with_503() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let api = Api::with(Arc::new(faulty.clone()), Auth::anonymous());
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    faulty.set_down(true);
    let r = api.begin(None, "k2", json!(1)).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
    );
    let r = api.complete(None, "k", &lease, json!(1)).await;
    assert_eq!(r.code(), "store_unavailable");
    let r = api.get("/healthz", None).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    faulty.set_down(false);
    assert_eq!(api.get("/healthz", None).await.status, StatusCode::OK);
    // the work never ran for k2: it is still absent
    assert_eq!(
        api.get("/v1/records/pay/k2", None).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn the_purge_loop_deletes_expired_records() {
    let store = MemoryStore::new();
    let api = Api::with(Arc::new(store.clone()), Auth::anonymous());
    for key in ["p1", "p2"] {
        let lease = lease_of(
            &api.post(
                "/v1/records/begin",
                None,
                &json!({"namespace": "pay", "key": key, "fingerprint": "f", "ttl_ms": 1000}),
            )
            .await,
        );
        api.complete(None, key, &lease, json!(1)).await;
    }
    assert_eq!(store.len(), 2);
    api.clock.advance(Duration::from_secs(2));
    let purger = tokio::spawn(idem_server::purge_loop(
        Arc::new(store.clone()),
        Arc::new(api.clock.clone()),
        Duration::from_millis(10),
    ));
    for _ in 0..200 {
        if store.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    purger.abort();
    assert!(store.is_empty(), "expired records were not purged");
}

#[tokio::test]
async fn records_kept_beyond_year_9999_are_still_shown() {
    use idem_core::{BeginRequest, Fingerprint, Key, Store, Timestamp};
    let store = MemoryStore::new();
    let api = Api::with(Arc::new(store.clone()), Auth::anonymous());
    let req = BeginRequest::new(
        Key::parse("default", "pay", "forever").unwrap(),
        Fingerprint::of_bytes(b"f"),
    )
    .with_lease(Duration::MAX)
    .with_ttl(Duration::MAX);
    store.begin(&req, Timestamp::now()).await.unwrap();
    let r = api.get("/v1/records/pay/forever", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["expires_at"], "9999-12-31T23:59:59.999Z");
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

/// A client that hangs up after the store took its key does not leave the key held for the
/// whole lease: the key is given back, and the next begin takes it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_its_key_is_taken_leaves_the_key_free() {
    let store = FaultyStore::new(MemoryStore::new());
    let api = Api::with(Arc::new(store.clone()), Auth::anonymous());
    // The begin is sent and waits at the store, then takes effect whatever the client does.
    let taken = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(taken.clone()));
    // Tells when the key is given back.
    let given_back = Stall::new();
    given_back.release();
    store.fail_next(Op::Release, Fault::Stall(given_back.clone()));
    let begin = json!({"namespace": "pay", "key": "k", "request": 1, "lease_ms": 600_000});
    let req = Request::post("/v1/records/begin")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(begin.to_string()))
        .unwrap();
    let app = api.app.clone();
    taken.abandon(async move { app.oneshot(req).await }).await;
    taken.release();
    within("the key to be taken", taken.landed()).await;
    within("the key to be given back", given_back.landed()).await;
    // The test clock never moves: a key still held would answer `in_progress`.
    let r = api.post("/v1/records/begin", None, &begin).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["outcome"], "acquired");
}
