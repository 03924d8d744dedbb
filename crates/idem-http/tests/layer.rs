//! The layer on an axum router: every rule of the Idempotency-Key semantics, each test
//! counting how many times the handler really ran.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_core::{ManualClock, SharedStore};
use idem_http::{
    IdempotencyLayer, InFlight, KeyRequirement, LeaseFence, OnUnknown, Policy, Preset, Settle,
};
use idem_store::MemoryStore;
use idem_testkit::{Fault, FaultyStore, Op, PATIENCE, Stall, within};
use serde_json::Value;
use tokio::sync::Notify;
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Counters {
    runs: Arc<AtomicUsize>,
    gate: Arc<Notify>,
    entered: Arc<Notify>,
}

async fn order(State(c): State<Counters>, body: String) -> Response {
    let n = c.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [
            ("x-order", "ord_1"),
            ("set-cookie", "session=1"),
            ("date", "Sat, 21 Nov 2026 10:00:00 GMT"),
        ],
        format!("run {n}: {body}"),
    )
        .into_response()
}

async fn fail(State(c): State<Counters>) -> StatusCode {
    c.runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::INTERNAL_SERVER_ERROR
}

async fn limited(State(c): State<Counters>) -> StatusCode {
    c.runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::TOO_MANY_REQUESTS
}

async fn declined(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    let mut res = (StatusCode::BAD_REQUEST, "validation failed").into_response();
    res.extensions_mut().insert(Settle::Release);
    res
}

async fn big(State(c): State<Counters>) -> String {
    c.runs.fetch_add(1, Ordering::SeqCst);
    "x".repeat(10_000)
}

async fn panics(State(c): State<Counters>) -> String {
    if c.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        panic!("the handler failed");
    }
    "second time lucky".into()
}

async fn slow(State(c): State<Counters>) -> String {
    c.entered.notify_one();
    c.gate.notified().await;
    let n = c.runs.fetch_add(1, Ordering::SeqCst) + 1;
    format!("slow run {n}")
}

async fn unknown(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    let mut res = (StatusCode::GATEWAY_TIMEOUT, "upstream timed out").into_response();
    res.extensions_mut().insert(Settle::Unknown);
    res
}

/// Fails on its first run, then succeeds; answers with the fence it was given.
/// Fails with 503 on its first run, after the gate opens; answers at once afterwards.
async fn slow_then_fail(State(c): State<Counters>) -> Response {
    if c.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        c.entered.notify_one();
        c.gate.notified().await;
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    "ran again".into_response()
}

/// Names a private header in `Connection`: it describes the connection, not the answer.
async fn private(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    (
        [
            ("connection", "x-private"),
            ("x-private", "1"),
            ("x-public", "1"),
        ],
        "ok",
    )
        .into_response()
}

/// Answers with a body that breaks off half way.
async fn breaks(State(c): State<Counters>) -> Response {
    c.runs.fetch_add(1, Ordering::SeqCst);
    let chunks = vec![
        Ok(http_body::Frame::data(bytes::Bytes::from_static(
            b"{\"half\":",
        ))),
        Err(std::io::Error::other("the handler's stream failed")),
    ];
    Response::new(Body::new(http_body_util::StreamBody::new(
        tokio_stream_iter(chunks.into_iter()),
    )))
}

async fn fence(State(c): State<Counters>, Extension(g): Extension<LeaseFence>) -> Response {
    let status = if c.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::OK
    };
    (status, g.fence.to_string()).into_response()
}

struct App {
    router: Router,
    counters: Counters,
    clock: ManualClock,
}

fn app(policy: Policy) -> App {
    app_on(Arc::new(MemoryStore::new()), policy)
}

fn app_on(store: SharedStore, policy: Policy) -> App {
    let counters = Counters::default();
    let clock = ManualClock::starting_now();
    let layer = IdempotencyLayer::new(store, policy).clock(clock.clone());
    let router = Router::new()
        .route("/orders", post(order).get(order).put(order))
        .route("/fail", post(fail))
        .route("/limited", post(limited))
        .route("/declined", post(declined))
        .route("/big", post(big))
        .route("/panics", post(panics))
        .route("/slow", post(slow))
        .route("/unknown", post(unknown))
        .route("/fence", post(fence))
        .route("/slow-then-fail", post(slow_then_fail))
        .route("/private", post(private))
        .route("/breaks", post(breaks))
        .route_layer(layer)
        .with_state(counters.clone());
    App {
        router,
        counters,
        clock,
    }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn code(&self) -> String {
        serde_json::from_str::<Value>(&self.body).map_or(String::new(), |v| {
            v["code"].as_str().unwrap_or_default().to_owned()
        })
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

fn req(method: Method, path: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

fn post_with(path: &str, key: &str, body: &str) -> Request<Body> {
    req(Method::POST, path, &[("idempotency-key", key)], body)
}

impl App {
    async fn send(&self, req: Request<Body>) -> Reply {
        let res = self.router.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let body = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    /// Sends a keyed POST from a task of its own.
    fn spawn(&self, path: &'static str, key: &'static str) -> tokio::task::JoinHandle<Response> {
        let router = self.router.clone();
        tokio::spawn(async move { router.oneshot(post_with(path, key, "")).await.unwrap() })
    }

    fn runs(&self) -> usize {
        self.counters.runs.load(Ordering::SeqCst)
    }
}

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

#[tokio::test]
async fn json_bodies_are_compared_by_value() {
    let json = |key: &str, body: &str| {
        req(
            Method::POST,
            "/orders",
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            body,
        )
    };
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

#[tokio::test]
async fn server_errors_release_the_key_under_ietf_and_are_stored_under_stripe() {
    let ietf = app(Policy::default());
    for _ in 0..2 {
        let r = ietf.send(post_with("/fail", "k", "")).await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!r.replayed());
    }
    assert_eq!(ietf.runs(), 2);

    let stripe = app(Policy::default().preset(Preset::Stripe));
    stripe.send(post_with("/fail", "k", "")).await;
    let r = stripe.send(post_with("/fail", "k", "")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(r.replayed());
    assert_eq!(stripe.runs(), 1);

    // 429 says nothing was done, under both presets
    for preset in [Preset::Ietf, Preset::Stripe] {
        let app = app(Policy::default().preset(preset));
        app.send(post_with("/limited", "k", "")).await;
        app.send(post_with("/limited", "k", "")).await;
        assert_eq!(app.runs(), 2);
    }
}

#[tokio::test]
async fn a_handler_may_decline_to_store_its_answer() {
    let app = app(Policy::default());
    for _ in 0..2 {
        let r = app.send(post_with("/declined", "k", "")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert!(!r.replayed());
    }
    assert_eq!(app.runs(), 2);
}

#[tokio::test]
async fn a_request_in_flight_is_refused_with_retry_after() {
    let app = app(Policy::default().lease(Duration::from_secs(30)));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    let r = app.send(post_with("/slow", "k", "")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "request_in_progress");
    // Look again in a second, not at the end of the 30 s lease.
    assert_eq!(r.headers["retry-after"], "1");
    app.counters.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    let r = app.send(post_with("/slow", "k", "")).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_request_in_flight_can_wait_for_the_first_answer() {
    let app = app(Policy::default().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    let second = app.spawn("/slow", "k");
    tokio::time::sleep(Duration::from_millis(50)).await;
    app.counters.gate.notify_one();
    first.await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_does_not_cancel_the_work() {
    let app = app(Policy::default().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    first.abort(); // the connection is gone
    app.counters.gate.notify_one();
    let r = app.send(post_with("/slow", "k", "")).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_while_the_key_is_taken_leaves_no_stranded_record() {
    let store = FaultyStore::new(MemoryStore::new());
    // The begin is sent and waits at the store until released, whatever the client does.
    let taken = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(taken.clone()));
    let app = app_on(
        Arc::new(store),
        Policy::default().in_flight(InFlight::Wait(PATIENCE)),
    );
    let router = app.router.clone();
    // The connection is gone while the key is being taken.
    taken
        .abandon(async move { router.oneshot(post_with("/orders", "k", "")).await })
        .await;
    taken.release();
    // The retry gets the first attempt's answer; a stranded record would answer "in
    // progress" until its 60 s lease ran out (and the test clock never moves).
    let r = within("the retry", app.send(post_with("/orders", "k", ""))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(r.replayed());
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_while_waiting_for_another_attempt_leaves_nothing_behind() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(
        store.clone(),
        Policy::default().in_flight(InFlight::Wait(PATIENCE)),
    );
    let first = app.spawn("/slow", "k");
    within("the first attempt", app.counters.entered.notified()).await;
    // The second is told "in progress" once, then hangs up while it waits to ask again.
    let asked = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(asked.clone()));
    asked.release();
    let second = app.spawn("/slow", "k");
    within("the second attempt", asked.landed()).await;
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    app.counters.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    let r = within("a retry", app.send(post_with("/slow", "k", ""))).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_oversized_request_is_refused_and_stores_nothing() {
    let app = app(Policy::default().max_body(16));
    let r = app.send(post_with("/orders", "k", &"x".repeat(17))).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.code(), "body_too_large");
    // without a declared length (a streamed body), the limit holds too
    let stream = frames(vec![data("x".repeat(10)), data("x".repeat(10))]);
    let mut streamed = req(Method::POST, "/orders", &[("idempotency-key", "k")], "");
    *streamed.body_mut() = stream;
    assert_eq!(
        app.send(streamed).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(app.runs(), 0);
    // the key was not used up
    let r = app.send(post_with("/orders", "k", "small")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(!r.replayed());
}

/// A body of these frames, with no declared length.
fn frames(frames: Vec<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>) -> Body {
    Body::new(http_body_util::StreamBody::new(tokio_stream_iter(
        frames.into_iter(),
    )))
}

fn data(chunk: impl Into<bytes::Bytes>) -> Result<http_body::Frame<bytes::Bytes>, std::io::Error> {
    Ok(http_body::Frame::data(chunk.into()))
}

fn tokio_stream_iter<I: Iterator + Unpin>(it: I) -> impl futures_core::Stream<Item = I::Item> {
    struct Iter<I>(I);
    impl<I: Iterator + Unpin> futures_core::Stream for Iter<I> {
        type Item = I::Item;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<I::Item>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(it)
}

#[tokio::test]
async fn an_answer_too_large_to_store_is_delivered_once_and_never_rerun() {
    let app = app(Policy::default().max_response(1000));
    let r = app.send(post_with("/big", "k", "")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body.len(), 10_000);
    let again = app.send(post_with("/big", "k", "")).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.code(), "response_not_replayable");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_panicking_handler_releases_the_key() {
    let app = app(Policy::default());
    let r = app.send(post_with("/panics", "k", "")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.code(), "handler_failed");
    // the release runs in a task of its own; wait for the key to come back
    let mut r = app.send(post_with("/panics", "k", "")).await;
    for _ in 0..100 {
        if r.status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        r = app.send(post_with("/panics", "k", "")).await;
    }
    assert_eq!(r.body, "second time lucky");
}

#[tokio::test]
async fn an_unknown_outcome_is_held() {
    let app = app(Policy::default());
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    app.clock.advance(Duration::from_secs(3600));
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "outcome_unknown");
    assert!(r.headers.get("retry-after").is_none());
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_unknown_outcome_runs_again_after_the_lease_when_so_configured() {
    let app = app(Policy::default()
        .lease(Duration::from_secs(60))
        .on_unknown(OnUnknown::ReleaseAfterLease));
    app.send(post_with("/unknown", "k", "")).await;
    app.clock.advance(Duration::from_secs(30));
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.code(), "outcome_unknown");
    assert_eq!(r.headers["retry-after"], "30");
    assert_eq!(app.runs(), 1);
    app.clock.advance(Duration::from_secs(30));
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(app.runs(), 2);
}

/// Behind a replay cache, answers come from memory as the store would give them: the same
/// replay, the same mismatch; and an unknown outcome kept there (no `skip`) still runs again
/// once its lease is over, while memory still holds it (the lease ends before the entry's
/// `max_age` does).
#[tokio::test]
async fn answers_from_memory_are_the_stores_answers() {
    use idem_store::{ReplayCache, ReplayCacheLimits};
    let limits = ReplayCacheLimits::default();
    let cache = ReplayCache::new(MemoryStore::new(), limits);
    let lease = Duration::from_secs(30);
    assert!(lease < limits.max_age);
    let app = app_on(
        Arc::new(cache.clone()),
        Policy::default()
            .lease(lease)
            .on_unknown(OnUnknown::ReleaseAfterLease),
    );
    let first = app.send(post_with("/orders", "k", "pay 10")).await;
    let from_store = app.send(post_with("/orders", "k", "pay 10")).await;
    assert_eq!(cache.hits(), 0, "the first replay is the store's");
    for _ in 0..2 {
        let again = app.send(post_with("/orders", "k", "pay 10")).await;
        assert_eq!(
            (again.status, &again.body, again.replayed()),
            (from_store.status, &from_store.body, true)
        );
        assert_eq!(again.headers, from_store.headers);
        assert_eq!(again.body, first.body);
    }
    let other = app.send(post_with("/orders", "k", "pay 99")).await;
    assert_eq!(other.code(), "idempotency_key_mismatch");
    assert_eq!((cache.hits(), app.runs()), (3, 1));

    app.send(post_with("/unknown", "u", "")).await;
    let r = app.send(post_with("/unknown", "u", "")).await;
    assert_eq!(
        r.code(),
        "outcome_unknown",
        "from the store, and now kept in memory"
    );
    let r = app.send(post_with("/unknown", "u", "")).await;
    assert_eq!(r.code(), "outcome_unknown", "from memory");
    assert_eq!(app.runs(), 2);
    let hits = cache.hits();
    app.clock.advance(lease);
    let r = app.send(post_with("/unknown", "u", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "the retry ran again");
    assert_eq!(app.runs(), 3);
    assert!(cache.hits() > hits, "memory still held the unknown outcome");
}

#[tokio::test]
async fn an_operator_reopens_a_held_unknown_outcome_and_nothing_else() {
    use idem_core::{Clock, Key};
    use idem_http::operator::{RecordState, Reopened, inspect, reopen_unknown};
    let store: SharedStore = Arc::new(MemoryStore::new());
    let app = app_on(store.clone(), Policy::default());
    let key = |k: &str| Key::parse("anonymous", "http", k).unwrap();
    let now = || app.clock.now();

    app.send(post_with("/unknown", "k", "")).await;
    let view = inspect(&*store, &key("k"), now()).await.unwrap().unwrap();
    assert_eq!(view.state, RecordState::Unknown { until: None });
    assert_eq!(view.fence, 1);

    let r = reopen_unknown(&*store, &key("k"), now()).await.unwrap();
    assert_eq!(r, Reopened::Reopened { fence: 1 });
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "the retry ran again");
    assert_eq!(app.runs(), 2);
    let view = inspect(&*store, &key("k"), now()).await.unwrap().unwrap();
    assert_eq!(view.fence, 2);

    // A stored answer is never reopened; a missing record is reported as such.
    app.send(post_with("/orders", "o", "{}")).await;
    let Reopened::NotUnknown(view) = reopen_unknown(&*store, &key("o"), now()).await.unwrap()
    else {
        panic!("a stored answer was reopened");
    };
    assert_eq!(
        view.state,
        RecordState::Stored {
            status: StatusCode::CREATED
        }
    );
    let r = app.send(post_with("/orders", "o", "{}")).await;
    assert!(r.replayed());
    assert_eq!(
        reopen_unknown(&*store, &key("none"), now()).await.unwrap(),
        Reopened::NotFound
    );
}

#[tokio::test]
async fn a_listing_tells_unknown_outcomes_from_stored_answers() {
    use idem_core::{Clock, RecordFilter};
    use idem_http::operator::{RecordState, counts, listed_state};
    let store: SharedStore = Arc::new(MemoryStore::new());
    let app = app_on(store.clone(), Policy::default());
    app.send(post_with("/unknown", "u1", "")).await;
    app.send(post_with("/unknown", "u2", "")).await;
    app.send(post_with("/orders", "o", "{}")).await;
    let admin = store.admin().unwrap();
    let now = app.clock.now();
    let page = admin
        .list(&RecordFilter::default(), None, 10, now)
        .await
        .unwrap();
    let states: Vec<(String, RecordState)> = page
        .records
        .iter()
        .map(|l| (l.key.client_key().as_str().to_owned(), listed_state(l)))
        .collect();
    assert_eq!(
        states,
        [
            (
                "o".to_owned(),
                RecordState::Stored {
                    status: StatusCode::CREATED
                }
            ),
            ("u1".to_owned(), RecordState::Unknown { until: None }),
            ("u2".to_owned(), RecordState::Unknown { until: None }),
        ]
    );
    let counted = counts(admin, &RecordFilter::default(), now).await.unwrap();
    assert_eq!((counted.records.completed, counted.unknown), (3, 2));
}

#[tokio::test]
async fn a_full_store_refuses_new_keys_and_still_replays() {
    let store = MemoryStore::with_limits(idem_store::MemoryLimits::new(1, usize::MAX));
    let app = app_on(Arc::new(store), Policy::default());
    assert_eq!(
        app.send(post_with("/orders", "k", "x")).await.status,
        StatusCode::CREATED
    );
    let r = app.send(post_with("/orders", "other", "x")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.code(), "store_full");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(app.runs(), 1);
    assert!(app.send(post_with("/orders", "k", "x")).await.replayed());
}

#[tokio::test]
async fn a_failing_store_fails_closed() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(store.clone(), Policy::default());
    store.set_down(true);
    let r = app.send(post_with("/orders", "k", "x")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.code(), "store_unavailable");
    assert_eq!(app.runs(), 0);
    store.set_down(false);
    assert_eq!(
        app.send(post_with("/orders", "k", "x")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn the_handler_sees_a_rising_fence() {
    let app = app(Policy::default());
    let r = app.send(post_with("/fence", "k", "")).await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, "1")
    );
    // the released key is taken again with a higher fence
    let r = app.send(post_with("/fence", "k", "")).await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, "2"));
    assert_eq!(app.send(post_with("/fence", "other", "")).await.body, "1");
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_without_reading_the_body() {
    let app = app(Policy::default().max_body(16));
    // A body that fails if read: only the declared length can decide.
    let mut r = req(
        Method::POST,
        "/orders",
        &[("idempotency-key", "k"), ("content-length", "1000")],
        "",
    );
    *r.body_mut() = frames(vec![Err(std::io::Error::other("unread"))]);
    let r = app.send(r).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(app.runs(), 0);
}

#[tokio::test]
async fn a_waiter_runs_the_request_itself_when_the_first_attempt_gives_the_key_back() {
    let app = app(Policy::default().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = app.spawn("/slow-then-fail", "k");
    app.counters.entered.notified().await;
    let second = app.spawn("/slow-then-fail", "k");
    tokio::time::sleep(Duration::from_millis(50)).await;
    app.counters.gate.notify_one();
    assert_eq!(
        first.await.unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert!(second.headers().get("idempotent-replayed").is_none());
    assert_eq!(app.runs(), 2);
}

#[tokio::test]
async fn headers_named_in_connection_are_not_replayed() {
    let app = app(Policy::default());
    let first = app.send(post_with("/private", "k", "")).await;
    assert_eq!(first.headers["x-private"], "1");
    let again = app.send(post_with("/private", "k", "")).await;
    assert!(again.replayed());
    assert!(again.headers.get("x-private").is_none());
    assert!(again.headers.get("connection").is_none());
    assert_eq!(again.headers["x-public"], "1");
}

#[tokio::test]
async fn an_answer_that_breaks_off_is_an_unknown_outcome() {
    let app = app(Policy::default());
    let r = app.send(post_with("/breaks", "k", "")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.code(), "response_failed");
    let r = app.send(post_with("/breaks", "k", "")).await;
    assert_eq!(r.code(), "outcome_unknown");
    assert_eq!(app.runs(), 1);
}
