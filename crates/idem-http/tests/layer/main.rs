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
    UnstoredAnswers,
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

/// Waits for the gate, then answers 400 KiB.
async fn wide(State(c): State<Counters>) -> String {
    c.entered.notify_one();
    c.gate.notified().await;
    c.runs.fetch_add(1, Ordering::SeqCst);
    "w".repeat(400 << 10)
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
    app_with(store, policy, |layer| layer)
}

/// An app whose layer is set up further by `setup`.
fn app_with(
    store: SharedStore,
    policy: Policy,
    setup: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> App {
    let counters = Counters::default();
    let clock = ManualClock::starting_now();
    let layer = setup(IdempotencyLayer::new(store, policy).clock(clock.clone()));
    let router = Router::new()
        .route("/orders", post(order).get(order).put(order))
        .route("/fail", post(fail))
        .route("/limited", post(limited))
        .route("/declined", post(declined))
        .route("/big", post(big))
        .route("/panics", post(panics))
        .route("/slow", post(slow))
        .route("/wide", post(wide))
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
        self.reply(res).await
    }

    async fn reply(&self, res: Response) -> Reply {
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

mod concurrency;
mod keys;
mod settling;
