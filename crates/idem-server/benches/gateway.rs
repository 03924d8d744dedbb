//! Load bench of `idem gateway`: one upstream, measured three ways in one run.
//!
//! - `direct`: clients call the upstream itself;
//! - `gateway, new keys`: through the gateway, every request with a fresh key (each one
//!   claims a record, reaches the upstream and stores its answer);
//! - `gateway, replays`: through the gateway, keys that were already answered (the gateway
//!   answers from the store; the upstream is not reached).
//!
//! For the memory and SQLite stores. The upstream answers a small JSON body after `--work-ms`
//! of simulated work (a sleep standing for its database write). Upstream, gateway and load
//! generator each run on a one-thread runtime of their own in this process.
//!
//! `cargo bench -p idem-server --bench gateway -- [--seconds N] [--concurrency N] [--work-ms N]`

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::SharedStore;
use idem_server::gateway::{FileConfig, Gateway, Upstream};
use tokio::runtime::Runtime;

struct Args {
    seconds: u64,
    concurrency: usize,
    work_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 5,
        concurrency: 64,
        work_ms: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().and_then(|v| v.parse().ok()).expect("a number");
        match flag.as_str() {
            "--seconds" => a.seconds = value(),
            "--concurrency" => a.concurrency = usize::try_from(value()).unwrap(),
            "--work-ms" => a.work_ms = value(),
            "--quick" => a.seconds = 1,
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

async fn upstream(work: Duration) -> SocketAddr {
    let app = Router::new().route(
        "/v1/charges",
        post(move |body: Bytes| async move {
            if !work.is_zero() {
                tokio::time::sleep(work).await;
            }
            (
                StatusCode::CREATED,
                [("content-type", "application/json")],
                format!(
                    "{{\"id\":\"ch_1\",\"object\":\"charge\",\"status\":\"succeeded\",\"request_bytes\":{}}}",
                    body.len()
                ),
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn gateway(upstream: SocketAddr, store: SharedStore) -> SocketAddr {
    let url = Upstream::parse(&format!("http://{upstream}")).unwrap();
    let gw = Gateway::new(url, store)
        .configure(&FileConfig::default())
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // As the binary serves it: with the peer address, for X-Forwarded-For.
    let app = gw
        .router()
        .into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    None,
    Fresh,
    Replayed,
}

const REPLAY_KEYS: usize = 1000;
const BODY: &str = r#"{"amount":1000,"currency":"eur","source":"tok_visa"}"#;

struct Outcome {
    rps: f64,
    p50_us: u64,
    p99_us: u64,
}

async fn load(target: SocketAddr, keys: Keys, args: &Args, run: &str) -> Outcome {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|task| {
            let client = client.clone();
            let run = run.to_owned();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0usize;
                while Instant::now() < deadline {
                    let mut req = Request::post(format!("http://{target}/v1/charges"))
                        .header("content-type", "application/json")
                        .header("authorization", "Bearer sk_test_bench");
                    match keys {
                        Keys::None => {}
                        Keys::Fresh => {
                            req = req.header("idempotency-key", format!("{run}-{task}-{i}"));
                        }
                        Keys::Replayed => {
                            req = req.header(
                                "idempotency-key",
                                format!("warm-{}", (task * 7919 + i) % REPLAY_KEYS),
                            );
                        }
                    }
                    let started = Instant::now();
                    let res = client
                        .request(
                            req.body(Full::new(Bytes::from_static(BODY.as_bytes())))
                                .unwrap(),
                        )
                        .await
                        .unwrap();
                    let status = res.status();
                    let replayed = res.headers().contains_key("idempotent-replayed");
                    res.into_body().collect().await.unwrap();
                    assert_eq!(status, StatusCode::CREATED);
                    assert_eq!(replayed, keys == Keys::Replayed);
                    latencies.push(u64::try_from(started.elapsed().as_micros()).unwrap());
                    i += 1;
                }
                latencies
            })
        })
        .collect();
    let started = Instant::now();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    // the q-quantile, q in per mille
    let at = |q: usize| all[(all.len() * q / 1000).min(all.len() - 1)];
    Outcome {
        rps: all.len() as f64 / elapsed,
        p50_us: at(500),
        p99_us: at(990),
    }
}

async fn warm(target: SocketAddr) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    for k in 0..REPLAY_KEYS {
        let req = Request::post(format!("http://{target}/v1/charges"))
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk_test_bench")
            .header("idempotency-key", format!("warm-{k}"))
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .unwrap();
        let res = client.request(req).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
}

fn main() {
    let args = args();
    let (up_rt, gw_rt, load_rt) = (runtime(), runtime(), runtime());
    let up = up_rt.block_on(upstream(Duration::from_millis(args.work_ms)));
    let dir = tempfile::tempdir().unwrap();
    println!(
        "gateway bench: {} concurrent clients, {} s per row, upstream work {} ms\n",
        args.concurrency, args.seconds, args.work_ms
    );
    println!("| store | way | req/s | p50 (ms) | p99 (ms) | × direct |");
    println!("|---|---|---:|---:|---:|---:|");
    let stores: Vec<(&str, SharedStore)> = vec![
        // Unbounded: a long run of fresh keys passes the default bound.
        (
            "memory",
            Arc::new(idem_store::MemoryStore::with_limits(
                idem_store::MemoryLimits::new(usize::MAX, usize::MAX),
            )),
        ),
        (
            "sqlite",
            Arc::new(idem_store::SqliteStore::open(dir.path().join("bench.db")).unwrap()),
        ),
    ];
    for (name, store) in stores {
        let gw = gw_rt.block_on(gateway(up, store));
        load_rt.block_on(warm(gw));
        let direct = load_rt.block_on(load(up, Keys::None, &args, "direct"));
        let fresh = load_rt.block_on(load(gw, Keys::Fresh, &args, name));
        let replay = load_rt.block_on(load(gw, Keys::Replayed, &args, name));
        for (way, o) in [
            ("direct", &direct),
            ("gateway, new keys", &fresh),
            ("gateway, replays", &replay),
        ] {
            println!(
                "| {name} | {way} | {:.0} | {:.2} | {:.2} | {:.2} |",
                o.rps,
                o.p50_us as f64 / 1000.0,
                o.p99_us as f64 / 1000.0,
                o.rps / direct.rps
            );
        }
    }
}
