//! A proxy that loses requests and answers, a ledger of what really ran, and a storm of
//! client calls through both: for testing that retries with `Idempotency-Key` run each
//! operation once and end with its first answer.
//!
//! [`ChaosProxy`] sits between a client and a server. Per request it draws a fate: pass it
//! on; close the connection before forwarding it (nothing reached the server); forward it and
//! close the connection instead of answering (the server did the work; the client never
//! hears); or forward it and hold the answer longer than the client waits.
//!
//! [`Ledger`] is what the server's handler calls to do an operation: it counts the runs of
//! each operation and remembers the answer of its first run. [`storm`] sends operations
//! through the proxy with `idem_client`, and [`Ledger::check`] compares.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

/// How long a client in a [`standard_storm`] gives an attempt.
pub const CLIENT_TIMEOUT: Duration = Duration::from_millis(800);

/// Longer than [`CLIENT_TIMEOUT`]: how long [`Ledger::serve`]'s slow operations take, and how
/// long a [`standard_storm`]'s proxy holds a delayed answer.
pub const SLOW: Duration = Duration::from_millis(1200);

/// How often each fault happens, as fractions of requests (the rest pass).
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    /// The connection is closed before the request is forwarded.
    pub drop_request: f64,
    /// The request is forwarded and answered, and the connection closed instead of answering.
    pub drop_answer: f64,
    /// The answer is held for [`Faults::delay`] before it is passed on.
    pub delay_answer: f64,
    /// How long a delayed answer is held.
    pub delay: Duration,
}

/// What the proxy did, by fate.
#[derive(Debug, Default)]
pub struct ChaosCounts {
    /// Requests passed on and answered.
    pub passed: AtomicUsize,
    /// Connections closed before forwarding.
    pub dropped_requests: AtomicUsize,
    /// Answers thrown away.
    pub dropped_answers: AtomicUsize,
    /// Answers held back.
    pub delayed_answers: AtomicUsize,
}

impl ChaosCounts {
    /// Every request that met a fault.
    pub fn faults(&self) -> usize {
        self.dropped_requests.load(Ordering::SeqCst)
            + self.dropped_answers.load(Ordering::SeqCst)
            + self.delayed_answers.load(Ordering::SeqCst)
    }
}

/// An HTTP/1 (or HTTP/2, for gRPC) proxy to one server that loses requests and answers as its
/// [`Faults`] say. Answers keep their trailers.
pub struct ChaosProxy {
    addr: SocketAddr,
    counts: Arc<ChaosCounts>,
}

/// The error a hyper service returns to have its connection closed without an answer.
#[derive(Debug)]
struct Hangup;

impl std::fmt::Display for Hangup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the proxy hung up")
    }
}

impl std::error::Error for Hangup {}

/// The largest body the proxy carries either way.
const BODY_LIMIT: usize = 1 << 20;

impl ChaosProxy {
    /// Listens on a free loopback port and forwards HTTP/1 to `target`.
    pub async fn start(target: SocketAddr, faults: Faults) -> Self {
        Self::start_with(target, faults, false).await
    }

    /// Listens on a free loopback port and forwards HTTP/2 (without TLS, as gRPC over
    /// `http://`) to `target`. A lost answer resets its stream.
    pub async fn start_h2(target: SocketAddr, faults: Faults) -> Self {
        Self::start_with(target, faults, true).await
    }

    async fn start_with(target: SocketAddr, faults: Faults, h2: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(ChaosCounts::default());
        let upstream: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
            .http2_only(h2)
            .build(HttpConnector::new());
        let shared = Arc::clone(&counts);
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                let (upstream, counts) = (upstream.clone(), Arc::clone(&shared));
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        forward(req, target, faults, upstream.clone(), Arc::clone(&counts))
                    });
                    // A hang-up ends the connection (or the HTTP/2 stream) with an error: that
                    // is the point.
                    let io = TokioIo::new(socket);
                    if h2 {
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, service)
                            .await;
                    } else {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service)
                            .await;
                    }
                });
            }
        });
        Self { addr, counts }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the proxy did so far.
    pub fn counts(&self) -> &ChaosCounts {
        &self.counts
    }
}

async fn forward(
    req: Request<Incoming>,
    target: SocketAddr,
    faults: Faults,
    upstream: Client<HttpConnector, Full<Bytes>>,
    counts: Arc<ChaosCounts>,
) -> Result<Response<UnsyncBoxBody<Bytes, Infallible>>, Hangup> {
    let fate: f64 = rand::random();
    if fate < faults.drop_request {
        counts.dropped_requests.fetch_add(1, Ordering::SeqCst);
        return Err(Hangup);
    }
    let (mut parts, body) = req.into_parts();
    let body = Limited::new(body, BODY_LIMIT)
        .collect()
        .await
        .map_err(|_| Hangup)?
        .to_bytes();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("http://{target}{path}")
        .parse()
        .map_err(|_| Hangup)?;
    let answer = upstream
        .request(Request::from_parts(parts, Full::new(body)))
        .await
        .map_err(|_| Hangup)?;
    let (parts, body) = answer.into_parts();
    let collected = Limited::new(body, BODY_LIMIT)
        .collect()
        .await
        .map_err(|_| Hangup)?;
    let trailers = collected.trailers().cloned();
    let body = Full::new(collected.to_bytes());
    let body = match trailers {
        Some(trailers) => body
            .with_trailers(std::future::ready(Some(Ok(trailers))))
            .boxed_unsync(),
        None => body.boxed_unsync(),
    };
    let fate = fate - faults.drop_request;
    if fate < faults.drop_answer {
        counts.dropped_answers.fetch_add(1, Ordering::SeqCst);
        return Err(Hangup);
    }
    if fate - faults.drop_answer < faults.delay_answer {
        counts.delayed_answers.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(faults.delay).await;
    } else {
        counts.passed.fetch_add(1, Ordering::SeqCst);
    }
    Ok(Response::from_parts(parts, body))
}

/// What really ran: per operation, how many times, and the answer of the first run.
#[derive(Clone, Default)]
pub struct Ledger {
    runs: Arc<Mutex<HashMap<u64, (usize, String)>>>,
    total: Arc<AtomicUsize>,
}

impl Ledger {
    /// Runs the operation a request's body names (see [`op_of`]) as a server under test does:
    /// every 25th takes [`SLOW`], longer than the client waits, so that its retries find it
    /// still in progress. Panics on a body that names none.
    pub async fn serve(&self, body: &[u8]) -> String {
        let op = op_of(body).expect("a body {\"op\": n}");
        if op.is_multiple_of(25) {
            tokio::time::sleep(SLOW).await;
        }
        self.execute(op)
    }

    /// Runs operation `op`: counts it and answers with text no other run has.
    pub fn execute(&self, op: u64) -> String {
        let run = self.total.fetch_add(1, Ordering::SeqCst) + 1;
        let answer = format!("{{\"op\":{op},\"run\":{run}}}");
        let mut runs = self.runs.lock().unwrap();
        let entry = runs.entry(op).or_insert((0, answer.clone()));
        entry.0 += 1;
        answer
    }

    /// How many operations ran more than once.
    pub fn repeated(&self) -> usize {
        self.runs
            .lock()
            .unwrap()
            .values()
            .filter(|(n, _)| *n > 1)
            .count()
    }

    /// Panics unless every call in `calls` ended with an answer equal to the one of its
    /// operation's first run, and no operation ran more than once.
    pub fn check(&self, calls: &[Call]) {
        let runs = self.runs.lock().unwrap();
        let twice: Vec<_> = runs.iter().filter(|(_, (n, _))| *n > 1).collect();
        assert!(twice.is_empty(), "operations run more than once: {twice:?}");
        for call in calls {
            let answer = call
                .answer
                .as_ref()
                .unwrap_or_else(|e| panic!("operation {} ended without an answer: {e}", call.op));
            let first = runs
                .get(&call.op)
                .unwrap_or_else(|| panic!("operation {} answered but never ran", call.op));
            assert_eq!(answer, &first.1, "operation {}", call.op);
        }
    }
}

/// One call of a [`storm`].
#[derive(Debug)]
pub struct Call {
    /// The operation.
    pub op: u64,
    /// Its answer's body, or why there was none.
    pub answer: Result<String, String>,
    /// How the call went, if it got an answer.
    pub report: Option<idem_client::Report>,
}

/// Sends `ops` POSTs of `{"op": n}` to `url`, `concurrency` at a time, each through `retries`
/// with `client` (give it a timeout shorter than the proxy's delay), as the caller named by
/// `authorization`.
pub async fn storm(
    client: &reqwest::Client,
    retries: &idem_client::Retries,
    url: &str,
    authorization: &str,
    ops: u64,
    concurrency: usize,
) -> Vec<Call> {
    let next = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, retries, url, authorization) = (
                client.clone(),
                retries.clone(),
                url.to_owned(),
                authorization.to_owned(),
            );
            let (next, calls) = (Arc::clone(&next), Arc::clone(&calls));
            tokio::spawn(async move {
                loop {
                    let op = u64::try_from(next.fetch_add(1, Ordering::SeqCst)).unwrap();
                    if op >= ops {
                        return;
                    }
                    let request = client
                        .post(&url)
                        .header("authorization", &authorization)
                        .header("content-type", "application/json")
                        .body(format!("{{\"op\":{op}}}"));
                    let call = match retries.send(&client, request).await {
                        Ok(answer) => {
                            let status = answer.response.status();
                            let report = answer.report;
                            let body = answer.response.text().await;
                            let answer = match body {
                                Ok(body) if status.is_success() => Ok(body),
                                Ok(body) => Err(format!("{status}: {body}")),
                                Err(e) => Err(format!("{status}, body lost: {e}")),
                            };
                            Call {
                                op,
                                answer,
                                report: Some(report),
                            }
                        }
                        Err(e) => Call {
                            op,
                            answer: Err(e.to_string()),
                            report: None,
                        },
                    };
                    calls.lock().unwrap().push(call);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    std::mem::take(&mut *calls.lock().unwrap())
}

/// 300 operations, 16 at a time, POSTed to `path` on `target` through a [`ChaosProxy`] that
/// drops 10% of requests, drops 15% of answers and holds 5% for [`SLOW`], by a client that
/// gives each attempt [`CLIENT_TIMEOUT`] and a call 12 attempts.
pub async fn standard_storm(target: SocketAddr, path: &str) -> (ChaosProxy, Vec<Call>) {
    let proxy = ChaosProxy::start(
        target,
        Faults {
            drop_request: 0.1,
            drop_answer: 0.15,
            delay_answer: 0.05,
            delay: SLOW,
        },
    )
    .await;
    let client = reqwest::Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .unwrap();
    let retries = idem_client::Retries::new(
        idem_client::RetryPolicy::default()
            .attempts(12)
            .backoff(Duration::from_millis(10), Duration::from_millis(200)),
    );
    let url = format!("http://{}{path}", proxy.addr());
    let calls = storm(&client, &retries, &url, "Bearer chaos", 300, 16).await;
    (proxy, calls)
}

/// Panics unless a [`standard_storm`] ran each operation once and ended each call with the
/// answer of that run ([`Ledger::check`]), and met enough trouble to show it: faults, calls
/// that needed retries, and retries answered with a replay.
pub fn check_storm(ledger: &Ledger, proxy: &ChaosProxy, calls: &[Call]) {
    assert_eq!(calls.len(), 300);
    ledger.check(calls);
    let counts = proxy.counts();
    assert!(counts.faults() > 30, "{counts:?}");
    let reports: Vec<_> = calls.iter().filter_map(|c| c.report.as_ref()).collect();
    assert!(
        reports.iter().any(|r| r.attempts > 1),
        "no call was retried"
    );
    assert!(reports.iter().any(|r| r.replayed), "no call got a replay");
}

/// The operation a request's JSON body `{"op": n}` names.
pub fn op_of(body: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(body).ok()?;
    let digits = text.trim().strip_prefix("{\"op\":")?.strip_suffix('}')?;
    digits.parse().ok()
}
