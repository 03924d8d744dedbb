//! The serving loop: HTTP/1.1 connections with timeouts and a connection cap.
//!
//! `axum::serve` has no knobs: a client that sends one header byte every few seconds, opens
//! keep-alive connections and never uses them, or trickles a body holds a descriptor forever,
//! and enough of them leave none for the health check. This loop serves the same router on
//! hyper's HTTP/1.1 connection with four limits (see [`Limits`]):
//!
//! - **header**: a request's head must arrive within the header timeout, counted from the
//!   connection's accept for the first request and from the first byte of each later one;
//!   otherwise the connection is closed.
//! - **idle**: a keep-alive connection with no request in flight and no byte received for the
//!   idle timeout is closed.
//! - **body**: a request body must arrive within the body timeout of its head; otherwise the
//!   handler's read fails and the answer is 408 `body_timeout` (problem+json,
//!   `Connection: close`), whatever the handler made of the failed read.
//! - **connections**: past `max_connections` open connections, new ones are still accepted
//!   (up to an overflow of an eighth more) but without keep-alive: a request for the health
//!   path is answered as usual, any other gets 503 `overloaded` with `Retry-After`, and the
//!   connection is closed. Past the overflow, the oldest over-cap connection with no request
//!   in flight is closed to make room (or, if all are busy, the new one).
//!
//! Each limit that bites is counted in `idem_server_timeouts_total{kind}` or
//! `idem_server_connections_refused_total{reason}` and logged: the first occurrence at once,
//! then at most one line a minute with the count.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, header};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use idem_http::ProblemCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, Sleep};
use tower_service::Service;
use tracing::{info, warn};

/// The default header timeout.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The default idle (keep-alive) timeout.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The default body timeout.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// The most the header timeout may be set to.
pub const MAX_HEADER_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// The most the idle and body timeouts may be set to.
pub const MAX_IDLE_OR_BODY_TIMEOUT: Duration = Duration::from_secs(60 * 60);
/// The most `max_connections` may be set to.
pub const MAX_CONNECTIONS: usize = 1_000_000;
/// The default cap when the descriptor limit cannot be read.
const FALLBACK_CONNECTIONS: usize = 768;
/// How long in-flight requests may take to finish once shutdown begins.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// How often the summary of limits that bit is logged.
const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// The limits of the serving loop.
#[derive(Debug, Clone)]
pub struct Limits {
    /// How long a request's head may take to arrive.
    pub header_timeout: Duration,
    /// How long a connection may sit with no request in flight.
    pub idle_timeout: Duration,
    /// How long a request's body may take to arrive, from its head.
    pub body_timeout: Duration,
    /// How many connections are served normally; the rest only reach the health path.
    pub max_connections: usize,
    /// The health path, answered even at the cap (`/healthz`, `/_idem/health`).
    pub health_path: String,
}

impl Limits {
    /// The defaults, with `health_path` answered at the cap.
    pub fn new(health_path: impl Into<String>) -> Self {
        Self {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: default_max_connections(),
            health_path: health_path.into(),
        }
    }

    /// How many connections over the cap are accepted to answer health checks and 503s.
    fn overflow(&self) -> usize {
        (self.max_connections / 8).max(4)
    }
}

/// The soft limit on open descriptors, from `/proc/self/limits` (Linux).
pub fn descriptor_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The smaller of 10,000 and three quarters of the descriptor limit: the rest is left for
/// the overflow, the store's connections and files.
pub fn default_max_connections() -> usize {
    match descriptor_limit() {
        Some(soft) => usize::try_from(soft / 4 * 3)
            .unwrap_or(usize::MAX)
            .clamp(1, 10_000),
        None => FALLBACK_CONNECTIONS,
    }
}

/// Describes the loop's metrics to the installed recorder.
pub fn describe_metrics() {
    metrics::describe_gauge!("idem_server_connections", "Open client connections.");
    metrics::describe_counter!(
        "idem_server_connections_refused_total",
        "Connections refused by the connection cap, by reason: at_capacity (answered 503 \
         overloaded unless for the health path), overflow (closed to make room)."
    );
    metrics::describe_counter!(
        "idem_server_timeouts_total",
        "Connections or requests cut by a timeout, by kind: header, idle, body."
    );
}

/// The events that are logged when they happen.
#[derive(Clone, Copy)]
enum Bite {
    Header,
    Idle,
    Body,
    AtCapacity,
    Overflow,
    Accept,
}

const BITES: [Bite; 6] = [
    Bite::Header,
    Bite::Idle,
    Bite::Body,
    Bite::AtCapacity,
    Bite::Overflow,
    Bite::Accept,
];

impl Bite {
    fn what(self) -> &'static str {
        match self {
            Bite::Header => {
                "a connection was closed: no complete request head within the header timeout"
            }
            Bite::Idle => "a keep-alive connection was closed after the idle timeout",
            Bite::Body => {
                "a request was answered 408: its body did not arrive within the body timeout"
            }
            Bite::AtCapacity => {
                "at the connection cap: a connection was served only the health path"
            }
            Bite::Overflow => {
                "past the connection cap and its overflow: a connection was closed to make room"
            }
            Bite::Accept => "accepting a connection failed (out of descriptors?)",
        }
    }

    fn count(self) {
        match self {
            Bite::Header => metrics::counter!("idem_server_timeouts_total", "kind" => "header"),
            Bite::Idle => metrics::counter!("idem_server_timeouts_total", "kind" => "idle"),
            Bite::Body => metrics::counter!("idem_server_timeouts_total", "kind" => "body"),
            Bite::AtCapacity => metrics::counter!(
                "idem_server_connections_refused_total",
                "reason" => "at_capacity"
            ),
            Bite::Overflow => {
                metrics::counter!("idem_server_connections_refused_total", "reason" => "overflow")
            }
            Bite::Accept => return,
        }
        .increment(1);
    }
}

/// Logs each kind of event once when it starts, then once a minute with a count.
#[derive(Default)]
struct Log {
    started: [AtomicBool; BITES.len()],
    since: [AtomicU64; BITES.len()],
}

impl Log {
    fn bite(&self, b: Bite) {
        b.count();
        let i = b as usize;
        if self.started[i].swap(true, Ordering::Relaxed) {
            self.since[i].fetch_add(1, Ordering::Relaxed);
        } else {
            warn!("{} (repeats are summed up once a minute)", b.what());
        }
    }

    /// Logs what happened since the last summary; a kind that was quiet starts over.
    fn summarize(&self) {
        for b in BITES {
            let i = b as usize;
            match self.since[i].swap(0, Ordering::Relaxed) {
                0 => self.started[i].store(false, Ordering::Relaxed),
                n => warn!(
                    count = n,
                    "in the last minute, {n} more times: {}",
                    b.what()
                ),
            }
        }
    }
}

/// Serves `app` on `listener` with `limits` until `shutdown` completes; then stops accepting
/// and gives in-flight requests [`SHUTDOWN_GRACE`] to finish.
///
/// Each request carries [`ConnectInfo<SocketAddr>`] of its peer, as with
/// `into_make_service_with_connect_info`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let limits = Arc::new(limits);
    let log = Arc::new(Log::default());
    let open = Arc::new(AtomicUsize::new(0));
    let normal = Arc::new(AtomicUsize::new(0));
    // The connections over the cap, oldest first.
    let mut over: VecDeque<Weak<Activity>> = VecDeque::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection holds a sender; when all are gone, recv() answers None.
    let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
    let summary = {
        let log = log.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(SUMMARY_EVERY);
            every.tick().await;
            loop {
                every.tick().await;
                log.summarize();
            }
        })
    };
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    if !is_connection_error(&e) {
                        log.bite(Bite::Accept);
                        // Out of descriptors: give closing connections a moment.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    continue;
                }
            },
        };
        let activity = Arc::new(Activity::new());
        let capped = normal.load(Ordering::Relaxed) >= limits.max_connections;
        if capped {
            over.retain(|a| a.strong_count() > 0);
            if over.len() >= limits.overflow() {
                // Make room by closing the oldest that has no request in flight: a flood
                // of silent connections must not keep the next health check out.
                let oldest = over
                    .iter()
                    .position(|a| a.upgrade().is_some_and(|a| a.evictable()));
                log.bite(Bite::Overflow);
                match oldest
                    .and_then(|i| over.remove(i))
                    .and_then(|a| a.upgrade())
                {
                    Some(a) => a.evict(),
                    None => {
                        drop(stream);
                        continue;
                    }
                }
            }
            over.push_back(Arc::downgrade(&activity));
            log.bite(Bite::AtCapacity);
        }
        let _ = stream.set_nodelay(true);
        let conn = Connection {
            limits: limits.clone(),
            log: log.clone(),
            app: app.clone(),
            peer,
            capped,
            activity,
            open: OpenGuard::new(open.clone(), (!capped).then(|| normal.clone())),
        };
        let stop = stop_rx.clone();
        let done = done_tx.clone();
        tokio::spawn(async move {
            conn.run(stream, stop).await;
            drop(done);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(done_tx);
    let open_now = open.load(Ordering::Relaxed);
    if open_now > 0 {
        info!(connections = open_now, "waiting for in-flight requests");
    }
    if tokio::time::timeout(SHUTDOWN_GRACE, done_rx.recv())
        .await
        .is_err()
    {
        warn!(
            connections = open.load(Ordering::Relaxed),
            "in-flight requests did not finish within {}; closing them",
            humantime::format_duration(SHUTDOWN_GRACE)
        );
    }
    summary.abort();
    log.summarize();
}

/// Errors of one incoming connection (the peer gave up), not of the listener.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Counts one open connection in the total, the gauge and (under the cap) the normal ones.
struct OpenGuard {
    open: Arc<AtomicUsize>,
    normal: Option<Arc<AtomicUsize>>,
}

impl OpenGuard {
    fn new(open: Arc<AtomicUsize>, normal: Option<Arc<AtomicUsize>>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        if let Some(n) = &normal {
            n.fetch_add(1, Ordering::Relaxed);
        }
        metrics::gauge!("idem_server_connections").increment(1.0);
        Self { open, normal }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        if let Some(n) = &self.normal {
            n.fetch_sub(1, Ordering::Relaxed);
        }
        metrics::gauge!("idem_server_connections").decrement(1.0);
    }
}

struct Connection {
    limits: Arc<Limits>,
    log: Arc<Log>,
    app: Router,
    peer: SocketAddr,
    capped: bool,
    activity: Arc<Activity>,
    open: OpenGuard,
}

impl Connection {
    async fn run(self, stream: TcpStream, mut stop: watch::Receiver<bool>) {
        let activity = self.activity;
        let io = TokioIo::new(Watched {
            inner: stream,
            activity: activity.clone(),
        });
        let service = RequestService {
            app: self.app,
            peer: self.peer,
            limits: self.limits.clone(),
            log: self.log.clone(),
            activity: activity.clone(),
            capped: self.capped,
        };
        let conn = hyper::server::conn::http1::Builder::new()
            .keep_alive(!self.capped)
            .header_read_timeout(None)
            .serve_connection(
                io,
                hyper::service::service_fn(move |req| service.clone().handle(req)),
            );
        let mut conn = std::pin::pin!(conn);
        let mut closing = false;
        loop {
            if activity.evicted.load(Ordering::Relaxed) {
                break;
            }
            let (deadline, bite) = activity.deadline(&self.limits);
            let expired = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = conn.as_mut() => break,
                () = expired => {
                    // The connection may have moved on in this same wakeup.
                    if activity.deadline(&self.limits).0.is_some_and(|at| at <= Instant::now()) {
                        // Nothing in flight: closing drops no answer.
                        self.log.bite(bite);
                        break;
                    }
                }
                () = activity.changed.notified() => {}
                _ = stop.wait_for(|s| *s), if !closing => {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
        drop(self.open);
    }
}

/// What a connection is doing, for the header and idle timeouts.
struct Activity {
    state: Mutex<Phase>,
    changed: Notify,
    /// Set to close the connection to make room for a newer one.
    evicted: AtomicBool,
}

struct Phase {
    in_flight: usize,
    /// Whether a request head is on its way (bytes arrived, or the connection is new).
    head: bool,
    since: Instant,
}

impl Activity {
    fn new() -> Self {
        Self {
            // A new connection owes its first request head.
            state: Mutex::new(Phase {
                in_flight: 0,
                head: true,
                since: Instant::now(),
            }),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
        }
    }

    /// Whether closing the connection drops no request.
    fn evictable(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_flight
            == 0
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::Relaxed);
        self.changed.notify_one();
    }

    fn update(&self, f: impl FnOnce(&mut Phase) -> bool) {
        let changed = f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
        if changed {
            self.changed.notify_one();
        }
    }

    fn received(&self) {
        self.update(|p| {
            let starts = p.in_flight == 0 && !p.head;
            if starts {
                p.head = true;
                p.since = Instant::now();
            }
            starts
        });
    }

    fn request_started(&self) {
        self.update(|p| {
            p.in_flight += 1;
            p.head = false;
            true
        });
    }

    fn request_finished(&self) {
        self.update(|p| {
            p.in_flight = p.in_flight.saturating_sub(1);
            if p.in_flight == 0 {
                p.since = Instant::now();
            }
            true
        });
    }

    /// When the connection is to be closed if nothing changes, and why.
    fn deadline(&self, limits: &Limits) -> (Option<Instant>, Bite) {
        let p = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if p.in_flight > 0 {
            (None, Bite::Idle)
        } else if p.head {
            (Some(p.since + limits.header_timeout), Bite::Header)
        } else {
            (Some(p.since + limits.idle_timeout), Bite::Idle)
        }
    }
}

/// The client's socket, noting when bytes arrive.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            self.activity.received();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// One connection's requests into the router.
#[derive(Clone)]
struct RequestService {
    app: Router,
    peer: SocketAddr,
    limits: Arc<Limits>,
    log: Arc<Log>,
    activity: Arc<Activity>,
    capped: bool,
}

impl RequestService {
    async fn handle(mut self, req: Request<Incoming>) -> Result<Response<Tracked>, Infallible> {
        self.activity.request_started();
        // Dropped with the response body, or with this future if the client goes away.
        let finished = Finished(self.activity.clone());
        if self.capped && req.uri().path() != self.limits.health_path {
            let res = ProblemCode::Overloaded
                .problem("The server is at its connection limit; try again shortly.")
                .retry_after(Duration::from_secs(1))
                .into_http::<Body>();
            return Ok(close(res).map(|b| Tracked::new(b, finished)));
        }
        let timed_out = Arc::new(AtomicBool::new(false));
        let (parts, body) = req.into_parts();
        let body = TimeoutBody {
            inner: body,
            deadline: tokio::time::Instant::now() + self.limits.body_timeout,
            sleep: None,
            timed_out: timed_out.clone(),
        };
        let mut req = Request::from_parts(parts, Body::new(body));
        req.extensions_mut().insert(ConnectInfo(self.peer));
        let Ok(mut res) = self.app.call(req).await;
        // Whatever the handler made of the failed read, the client hears why.
        if timed_out.load(Ordering::Relaxed) {
            self.log.bite(Bite::Body);
            res = close(
                ProblemCode::BodyTimeout
                    .problem(format!(
                        "The request body did not arrive within {}.",
                        humantime::format_duration(self.limits.body_timeout)
                    ))
                    .into_http::<Body>(),
            );
        }
        Ok(res.map(|b| Tracked::new(b, finished)))
    }
}

/// Marks the response to end its connection.
fn close(mut res: Response<Body>) -> Response<Body> {
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

/// Marks a request finished when its response has been written (or dropped).
struct Finished(Arc<Activity>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that marks its request finished when dropped.
pub struct Tracked {
    inner: Body,
    _finished: Finished,
}

impl Tracked {
    fn new(inner: Body, finished: Finished) -> Self {
        Self {
            inner,
            _finished: finished,
        }
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The error a request body gives when it is too slow.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the body timeout")]
struct BodyTimedOut;

/// A request body that fails once its deadline (counted from the head) passes. The timer is
/// armed only when a read has to wait, so a request whose body is already there (or empty, as
/// most are) registers none.
struct TimeoutBody {
    inner: Incoming,
    deadline: tokio::time::Instant,
    sleep: Option<Pin<Box<Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl http_body::Body for TimeoutBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = self.deadline;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(sleep.as_mut().poll(cx));
        self.timed_out.store(true, Ordering::Relaxed);
        Poll::Ready(Some(Err(BodyTimedOut.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_owes_a_head_then_idles_between_requests() {
        let limits = Limits::new("/healthz");
        let a = Activity::new();
        assert!(matches!(a.deadline(&limits), (Some(_), Bite::Header)));
        a.request_started();
        assert!(matches!(a.deadline(&limits), (None, _)));
        assert!(!a.evictable());
        a.received(); // a pipelined byte during the request changes nothing
        assert!(matches!(a.deadline(&limits), (None, _)));
        a.request_finished();
        assert!(matches!(a.deadline(&limits), (Some(_), Bite::Idle)));
        assert!(a.evictable());
        a.received();
        assert!(matches!(a.deadline(&limits), (Some(_), Bite::Header)));
    }

    #[test]
    fn the_default_cap_leaves_descriptors_over() {
        let n = default_max_connections();
        assert!((1..=10_000).contains(&n));
        if let Some(soft) = descriptor_limit() {
            assert!(u64::try_from(n).unwrap() <= soft);
        }
    }
}
