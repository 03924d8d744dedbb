//! What the gateway suites share: a counting upstream, a gateway in front of it, and a real
//! HTTP client.

#![allow(clippy::unwrap_used)]
// Each suite uses some of these.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post as route_post};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::SharedStore;
use idem_gateway::gateway::{FileConfig, Gateway, Upstream as UpstreamUrl};
use idem_store::MemoryStore;
use serde_json::Value;
use tokio::net::TcpListener;

#[derive(Clone, Default)]
pub(crate) struct Seen {
    pub(crate) runs: Arc<AtomicUsize>,
    pub(crate) headers: Arc<Mutex<Vec<HeaderMap>>>,
    pub(crate) paths: Arc<Mutex<Vec<String>>>,
}

impl Seen {
    pub(crate) fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// Counts the request, waits `x-delay-ms` if asked, and answers 201 with the run number.
/// Every path the upstream has no other route for ends here too, so nothing that reaches the
/// upstream goes uncounted.
pub(crate) async fn orders(
    State(seen): State<Seen>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = seen.runs.fetch_add(1, Ordering::SeqCst) + 1;
    seen.headers.lock().unwrap().push(headers.clone());
    seen.paths.lock().unwrap().push(uri.path().to_owned());
    if let Some(ms) = headers.get("x-delay-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let body = String::from_utf8_lossy(&body).into_owned();
    let status = headers.get("x-status").map_or(StatusCode::CREATED, |s| {
        StatusCode::from_bytes(s.as_bytes()).unwrap()
    });
    (
        status,
        [("x-upstream", "yes"), ("set-cookie", "s=1")],
        axum::Json(serde_json::json!({"run": n, "body": body})),
    )
        .into_response()
}

/// Counts the request, then breaks the connection half way through the answer.
pub(crate) async fn broken(State(seen): State<Seen>) -> Response {
    seen.runs.fetch_add(1, Ordering::SeqCst);
    let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from_static(b"{\"partial\":")),
        Err(std::io::Error::other("upstream crashed")),
    ];
    Response::new(Body::from_stream(futures_iter(chunks)))
}

pub(crate) fn futures_iter<T: Unpin>(items: Vec<T>) -> impl futures_core::Stream<Item = T> {
    struct Iter<T>(std::vec::IntoIter<T>);
    impl<T: Unpin> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(items.into_iter())
}

/// A 10 kB answer.
pub(crate) async fn big(State(seen): State<Seen>) -> String {
    seen.runs.fetch_add(1, Ordering::SeqCst);
    "x".repeat(10_000)
}

/// Sends its head at once and the rest of its body only after a second.
pub(crate) async fn stalls(State(seen): State<Seen>) -> Response {
    seen.runs.fetch_add(1, Ordering::SeqCst);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tokio::spawn(async move {
        let _ = tx.send(Ok(Bytes::from_static(b"{\"slow\":"))).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = tx.send(Ok(Bytes::from_static(b"true}"))).await;
    });
    Response::new(Body::from_stream(Receiver(rx)))
}

pub(crate) struct Receiver<T>(tokio::sync::mpsc::Receiver<T>);

impl<T> futures_core::Stream for Receiver<T> {
    type Item = T;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

/// Names a private header in `Connection`, and says of itself, in two spellings, that it is
/// a replay (which only idem may say).
pub(crate) async fn private() -> Response {
    (
        [
            ("connection", "x-secret"),
            ("x-secret", "1"),
            ("idempotent-replayed", "true"),
            ("idempotent_replayed", "true"),
        ],
        "ok",
    )
        .into_response()
}

pub(crate) async fn start_upstream_on(listener: TcpListener) -> Seen {
    let seen = Seen::default();
    let app = Router::new()
        .route("/orders", route_post(orders).get(orders))
        .route("/v1/payments", route_post(orders))
        .route("/broken", route_post(broken))
        .route("/big", route_post(big))
        .route("/stalls", route_post(stalls))
        .route("/private", route_post(private))
        .route("/_idem/health", get(|| async { "the upstream's own path" }))
        .fallback(orders)
        .with_state(seen.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    seen
}

pub(crate) async fn start_upstream() -> (Seen, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (start_upstream_on(listener).await, addr)
}

pub(crate) async fn start_gateway(
    upstream: SocketAddr,
    store: SharedStore,
    config: &str,
) -> SocketAddr {
    start_gateway_with_admin(upstream, store, config).await.0
}

/// A gateway, and its admin listener (the admin page and the record tools), each on an
/// address of its own, as `idem gateway` serves them.
pub(crate) async fn start_gateway_with_admin(
    upstream: SocketAddr,
    store: SharedStore,
    config: &str,
) -> (SocketAddr, SocketAddr) {
    let file = FileConfig::parse(config).unwrap();
    let url = UpstreamUrl::parse(&format!("http://{upstream}")).unwrap();
    let gateway = Gateway::new(url, store).configure(&file).unwrap();
    let mut addrs = Vec::new();
    for app in [gateway.router(), gateway.admin_router()] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    }
    (addrs[0], addrs[1])
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    pub(crate) fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

pub(crate) fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// The credential `send` adds when a test gives none: guarded requests without one are
/// refused by default.
pub(crate) const CALLER: &str = "Bearer test-caller";

/// Sends a request as the caller [`CALLER`], unless `headers` names another (or a blank one).
pub(crate) async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut all = headers.to_vec();
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
    {
        all.push(("authorization", CALLER));
    }
    send_anonymous(addr, method, path, &all, body).await
}

/// Sends a request with exactly `headers`.
pub(crate) async fn send_anonymous(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    let res = client().request(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

pub(crate) async fn post(addr: SocketAddr, path: &str, key: &str, body: &str) -> Reply {
    send(addr, Method::POST, path, &[("idempotency-key", key)], body).await
}

pub(crate) fn memory() -> SharedStore {
    Arc::new(MemoryStore::new())
}
