//! What the HTTP benches share: keep-alive clients sending requests for a fixed time, with
//! the rate and latency percentiles of what they got.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// What one load run measured.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// Requests answered per second.
    pub rps: f64,
    /// Median latency, µs.
    pub p50_us: u64,
    /// 99th percentile latency, µs.
    pub p99_us: u64,
    /// Requests answered.
    pub requests: usize,
}

/// A client that keeps its connections open, one per concurrent caller.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Runs `concurrency` callers on the current runtime for `time`, caller `t`'s `i`-th request
/// built by `request(t, i)`; every answer (head and body) is handed to `check`, which panics
/// on a wrong one.
pub async fn run<R, C>(concurrency: usize, time: Duration, request: R, check: C) -> Outcome
where
    R: Fn(usize, usize) -> Request<Full<Bytes>> + Send + Sync + 'static,
    C: Fn(&Response<()>, &[u8]) + Send + Sync + 'static,
{
    let client = client();
    let (request, check) = (Arc::new(request), Arc::new(check));
    let deadline = Instant::now() + time;
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let (client, request, check) = (client.clone(), request.clone(), check.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0usize;
                while Instant::now() < deadline {
                    let req = request(task, i);
                    let started = Instant::now();
                    let res = client.request(req).await.expect("an answer");
                    let (head, body) = res.into_parts();
                    let body = body.collect().await.expect("a body").to_bytes();
                    latencies.push(u64::try_from(started.elapsed().as_micros()).unwrap());
                    check(&Response::from_parts(head, ()), &body);
                    i += 1;
                }
                latencies
            })
        })
        .collect();
    let started = Instant::now();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("a caller"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    // The q-quantile, q in per mille.
    let at = |q: usize| all[(all.len() * q / 1000).min(all.len().saturating_sub(1))];
    Outcome {
        rps: all.len() as f64 / elapsed,
        p50_us: at(500),
        p99_us: at(990),
        requests: all.len(),
    }
}

/// A one-thread runtime: each side of a bench (server, load) gets its own.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}
