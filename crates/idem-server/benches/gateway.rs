//! Load bench of `idem gateway`: one upstream, measured four ways in one run.
//!
//! - `direct`: clients call the upstream itself;
//! - `gateway, new keys`: through the gateway, every request with a fresh key (each one
//!   claims a record, reaches the upstream and stores its answer);
//! - `gateway, replays`: through the gateway, keys that were already answered (the gateway
//!   answers from the store; the upstream is not reached);
//! - `gateway + cache, replays`: the same through a gateway whose store is behind the replay
//!   cache, as `idem gateway` runs by default (answered from memory).
//!
//! For the memory and SQLite stores. The upstream answers a small JSON body after `--work-ms`
//! of simulated work (a sleep standing for its database write). Upstream, gateway and load
//! generator each run on a one-thread runtime of their own in this process.
//!
//! `cargo bench -p idem-server --bench gateway -- [--seconds N] [--concurrency N] [--work-ms N]
//! [--rounds N] [--only TEXT]` (`--only`: just the rows whose "store way" holds TEXT, beside
//! `direct`, as when profiling one).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use idem_core::SharedStore;
use idem_gateway::gateway::{FileConfig, Gateway, Upstream};
use idem_store::{ReplayCache, ReplayCacheLimits};
use idem_testkit::load;

// As the `idem` binary runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Args {
    seconds: u64,
    concurrency: usize,
    work_ms: u64,
    rounds: usize,
    /// Only the rows whose "store way" holds this text, beside `direct` (for profiling one).
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 5,
        concurrency: 64,
        work_ms: 0,
        rounds: 1,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--only" {
            a.only = it.next();
            continue;
        }
        let mut value = || it.next().and_then(|v| v.parse().ok()).expect("a number");
        match flag.as_str() {
            "--seconds" => a.seconds = value(),
            "--concurrency" => a.concurrency = usize::try_from(value()).unwrap(),
            "--work-ms" => a.work_ms = value(),
            "--rounds" => a.rounds = usize::try_from(value()).unwrap(),
            "--quick" => a.seconds = 1,
            _ => {} // cargo bench passes --bench
        }
    }
    a
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

fn request(target: SocketAddr, key: Option<String>) -> Request<Full<Bytes>> {
    let mut req = Request::post(format!("http://{target}/v1/charges"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk_test_bench");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap()
}

async fn load(target: SocketAddr, keys: Keys, args: &Args, run: &str) -> load::Outcome {
    let run = run.to_owned();
    load::run(
        args.concurrency,
        Duration::from_secs(args.seconds),
        move |task, i| {
            let key = match keys {
                Keys::None => None,
                Keys::Fresh => Some(format!("{run}-{task}-{i}")),
                Keys::Replayed => Some(format!("warm-{}", (task * 7919 + i) % REPLAY_KEYS)),
            };
            request(target, key)
        },
        move |res, _| {
            assert_eq!(res.status(), StatusCode::CREATED);
            let replayed = res.headers().contains_key("idempotent-replayed");
            assert_eq!(replayed, keys == Keys::Replayed);
        },
    )
    .await
}

async fn warm(target: SocketAddr) {
    let client = load::client();
    for k in 0..REPLAY_KEYS {
        let res = client
            .request(request(target, Some(format!("warm-{k}"))))
            .await
            .unwrap();
        res.into_body().collect().await.unwrap();
    }
}

fn main() {
    let args = args();
    let (up_rt, gw_rt, load_rt) = (load::runtime(), load::runtime(), load::runtime());
    let up = up_rt.block_on(upstream(Duration::from_millis(args.work_ms)));
    let dir = tempfile::tempdir().unwrap();
    println!(
        "gateway bench: {} concurrent clients, {} s per row, upstream work {} ms, {} rounds\n",
        args.concurrency, args.seconds, args.work_ms, args.rounds
    );
    println!("| round | store | way | req/s | p50 (ms) | p99 (ms) | × direct |");
    println!("|---|---|---|---:|---:|---:|---:|");
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
    // Each store as `idem gateway` serves it (behind the replay cache, by default) and bare.
    let gateways: Vec<_> = stores
        .into_iter()
        .map(|(name, store)| {
            let cached: SharedStore = Arc::new(ReplayCache::new(
                store.clone(),
                ReplayCacheLimits::default(),
            ));
            let bare = gw_rt.block_on(gateway(up, store));
            let cached = gw_rt.block_on(gateway(up, cached));
            load_rt.block_on(warm(bare));
            (name, bare, cached)
        })
        .collect();
    for round in 1..=args.rounds {
        for (name, bare, cached) in &gateways {
            let direct = load_rt.block_on(load(up, Keys::None, &args, "direct"));
            let tag = format!("{name}-{round}");
            let ways = [
                ("gateway, new keys", *bare, Keys::Fresh),
                ("gateway, replays", *bare, Keys::Replayed),
                ("gateway + cache, replays", *cached, Keys::Replayed),
            ];
            let wanted = |way: &str| {
                let row = format!("{name} {way}");
                args.only
                    .as_ref()
                    .is_none_or(|only| row.contains(only.as_str()))
            };
            let rows: Vec<_> = ways
                .into_iter()
                .filter(|(way, ..)| wanted(way))
                .map(|(way, gw, keys)| (way, load_rt.block_on(load(gw, keys, &args, &tag))))
                .collect();
            for (way, o) in std::iter::once(("direct", direct)).chain(rows) {
                println!(
                    "| {round} | {name} | {way} | {:.0} | {:.2} | {:.2} | {:.2} |",
                    o.rps,
                    o.p50_us as f64 / 1000.0,
                    o.p99_us as f64 / 1000.0,
                    o.rps / direct.rps
                );
            }
        }
    }
}
