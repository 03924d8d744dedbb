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
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

mod activity;
mod connection;
mod request;

use activity::Activity;
use connection::Connection;

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
/// Each request carries [`ConnectInfo<SocketAddr>`](axum::extract::ConnectInfo) of its peer,
/// as with `into_make_service_with_connect_info`.
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
