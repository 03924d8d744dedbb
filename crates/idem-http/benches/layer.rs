//! Load bench of the `Idempotency-Key` layer beside the same axum route without it, in one run.
//!
//! One axum route (`POST /v1/charges`, a small JSON answer, no work) is served on one
//! one-thread runtime: bare, behind the layer on Redis with and without a [`ReplayCache`],
//! and behind the dedupe of the reference articles written by hand on the same Redis (`SET key
//! running NX GET PX`, the handler, `SET key answer XX PX`: two plain commands, no fence, no
//! lease renewal, no fingerprint), the peer the layer is held against. Keep-alive clients on
//! another one-thread runtime send, in each round:
//!
//! - `plain`: the bare route (with an `Idempotency-Key` header it ignores);
//! - `layer, new keys`: a fresh key per request (claim, run, store the answer);
//! - `layer, replays`: keys answered before (the store replays them);
//! - `layer + cache, replays`: the same through the replay cache (answered from memory);
//! - `by hand, new keys` and `by hand, replays`: the hand-written dedupe (Redis only).
//!
//! Rounds are interleaved (every way once per round), and each way runs right after a run of
//! `plain`, its row giving the ratio to that run, and the CPU time per request the server's
//! thread and the Redis server spent on it (where the machine's two cores go).
//!
//! `cargo bench -p idem-http --bench layer -- [--seconds N] [--concurrency N] [--rounds N]`
//! (`REDIS_URL`, default `redis://127.0.0.1:6379`; `--store memory` for no Redis; `--only TEXT`
//! for only the ways whose name holds TEXT, as when profiling one; `--max-batch N` bounds the
//! Redis store's group commit, 1 turning it off).

#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::expect_used,
    clippy::cast_precision_loss
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::Full;
use idem_core::SharedStore;
use idem_http::{IdempotencyLayer, Policy};
use idem_store::{ReplayCache, ReplayCacheLimits};
use idem_testkit::load;

struct Args {
    seconds: u64,
    concurrency: usize,
    rounds: usize,
    store: String,
    /// Only the ways whose name holds this text (for profiling one of them).
    only: Option<String>,
    /// The Redis store's group commit bound (`RedisOptions::max_batch`; 1 turns it off).
    max_batch: Option<usize>,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 5,
        concurrency: 16,
        rounds: 3,
        store: "redis".into(),
        only: None,
        max_batch: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect("a value");
        match flag.as_str() {
            "--seconds" => a.seconds = value().parse().unwrap(),
            "--concurrency" => a.concurrency = value().parse().unwrap(),
            "--rounds" => a.rounds = value().parse().unwrap(),
            "--store" => a.store = value(),
            "--only" => a.only = Some(value()),
            "--max-batch" => a.max_batch = Some(value().parse().unwrap()),
            "--quick" => (a.seconds, a.rounds) = (1, 1),
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

async fn charge(body: Bytes) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        format!(
            "{{\"id\":\"ch_1\",\"object\":\"charge\",\"status\":\"succeeded\",\"request_bytes\":{}}}",
            body.len()
        ),
    )
}

async fn serve(layer: Option<IdempotencyLayer>) -> SocketAddr {
    let route = match layer {
        Some(layer) => post(charge).layer(layer),
        None => post(charge),
    };
    listen(Router::new().route("/v1/charges", route)).await
}

/// Serves `app` on a free loopback port.
async fn listen(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The dedupe written by hand: claim the key with `SET … NX GET`, run the handler, keep its
/// status and body with `SET … XX`; a key found taken answers what it holds (409 while the
/// first request runs).
async fn by_hand(
    State((conn, prefix)): State<(redis::aio::MultiplexedConnection, Arc<str>)>,
    req: Request,
    next: Next,
) -> Response {
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .map(|k| format!("{prefix}{k}"));
    let Some(key) = key else {
        return next.run(req).await;
    };
    let held: Option<Vec<u8>> = redis::cmd("SET")
        .arg(&key)
        .arg("running")
        .arg("NX")
        .arg("GET")
        .arg("PX")
        .arg(600_000)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    match held.as_deref() {
        None => {
            let (parts, body) = next.run(req).await.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let mut kept = parts.status.as_u16().to_string().into_bytes();
            kept.push(b' ');
            kept.extend_from_slice(&body);
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(kept)
                .arg("XX")
                .arg("PX")
                .arg(600_000)
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            Response::from_parts(parts, Body::from(body))
        }
        Some(b"running") => StatusCode::CONFLICT.into_response(),
        Some(kept) => {
            let (status, body) = kept.split_at(3);
            let status = std::str::from_utf8(status).unwrap().parse().unwrap();
            (
                StatusCode::from_u16(status).unwrap(),
                [
                    ("content-type", "application/json"),
                    ("idempotent-replayed", "true"),
                ],
                Bytes::copy_from_slice(&body[1..]),
            )
                .into_response()
        }
    }
}

async fn serve_by_hand(run: &str) -> SocketAddr {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let prefix: Arc<str> = format!("bench-by-hand:{run}:").into();
    listen(Router::new().route(
        "/v1/charges",
        post(charge).layer(middleware::from_fn_with_state((conn, prefix), by_hand)),
    ))
    .await
}

async fn store(kind: &str, run: &str, max_batch: Option<usize>) -> SharedStore {
    match kind {
        "memory" => Arc::new(idem_store::MemoryStore::with_limits(
            idem_store::MemoryLimits::new(usize::MAX, usize::MAX),
        )),
        _ => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            let defaults = idem_store::RedisOptions::default();
            let options = idem_store::RedisOptions {
                prefix: format!("idem-bench-layer:{run}:"),
                max_batch: max_batch.unwrap_or(defaults.max_batch),
                ..defaults
            };
            Arc::new(
                idem_store::RedisStore::connect(&url, options)
                    .await
                    .unwrap(),
            )
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    Fresh,
    Replayed,
}

const REPLAY_KEYS: usize = 1000;
const BODY: &str = r#"{"amount":1000,"currency":"eur","source":"tok_visa"}"#;

fn request(target: SocketAddr, key: String) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{target}/v1/charges"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk_test_bench")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap()
}

/// Requests answered and requests per second.
async fn run(
    target: SocketAddr,
    keys: Keys,
    replayed: bool,
    args: &Args,
    tag: String,
) -> (usize, f64) {
    let out = load::run(
        args.concurrency,
        Duration::from_secs(args.seconds),
        move |task, i| {
            let key = match keys {
                Keys::Fresh => format!("{tag}-{task}-{i}"),
                Keys::Replayed => format!("warm-{}", (task * 7919 + i) % REPLAY_KEYS),
            };
            request(target, key)
        },
        move |res, _| {
            assert_eq!(res.status(), StatusCode::CREATED);
            assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
        },
    )
    .await;
    (out.requests, out.rps)
}

/// The CPU time the server's runtime thread has used, in ns, read on that thread (its
/// scheduler statistics): what the server spends on each way, apart from the load's clients.
async fn server_cpu(server: &tokio::runtime::Handle) -> u64 {
    server
        .spawn(async {
            let stats = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
            stats
                .split_whitespace()
                .next()
                .and_then(|ns| ns.parse().ok())
                .unwrap_or(0)
        })
        .await
        .unwrap()
}

/// The CPU time the Redis server has used, in ns (`INFO cpu`), or 0 without one.
async fn redis_cpu(conn: Option<&redis::aio::MultiplexedConnection>) -> u64 {
    let Some(conn) = conn else { return 0 };
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let seconds = |field: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let total = seconds("used_cpu_user:") + seconds("used_cpu_sys:");
    // Whole nanoseconds, from a figure given to the microsecond.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ns = (total * 1e9) as u64;
    ns
}

async fn warm(target: SocketAddr) {
    let client = load::client();
    for k in 0..REPLAY_KEYS {
        client
            .request(request(target, format!("warm-{k}")))
            .await
            .unwrap();
    }
}

fn main() {
    let args = args();
    let (server_rt, load_rt) = (load::runtime(), load::runtime());
    let run_id = format!(
        "{}-{}",
        std::process::id(),
        idem_core::Timestamp::now().as_millis()
    );
    let (plain, layered, cached, hand) = server_rt.block_on(async {
        let shared = store(&args.store, &run_id, args.max_batch).await;
        // Short-lived records (the bench writes many keys to a shared server), but the keys
        // warmed once must still be there for the last round's replays: every way and its
        // plain run, every round, and a minute to spare.
        let run_secs = args.seconds * 8 * args.rounds as u64;
        let policy = Policy::default().ttl(Duration::from_secs(60 + run_secs));
        let cache: SharedStore = Arc::new(ReplayCache::new(
            shared.clone(),
            ReplayCacheLimits::default(),
        ));
        let hand = match args.store.as_str() {
            "memory" => None,
            _ => Some(serve_by_hand(&run_id).await),
        };
        (
            serve(None).await,
            serve(Some(IdempotencyLayer::new(shared, policy.clone()))).await,
            serve(Some(IdempotencyLayer::new(cache, policy))).await,
            hand,
        )
    });
    load_rt.block_on(async {
        warm(layered).await;
        if let Some(hand) = hand {
            warm(hand).await;
        }
    });
    println!(
        "layer bench: store {}, {} keep-alive clients, {} s per row, {} rounds\n",
        args.store, args.concurrency, args.seconds, args.rounds
    );
    let redis = (args.store != "memory").then(|| {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        load_rt.block_on(async {
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap()
        })
    });
    let server = server_rt.handle().clone();
    println!(
        "| round | way | req/s | plain req/s | × plain | server CPU µs/req | Redis CPU µs/req |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for round in 1..=args.rounds {
        load_rt.block_on(async {
            let mut ways = vec![
                ("layer, new keys", layered, Keys::Fresh, false),
                ("layer, replays", layered, Keys::Replayed, true),
                ("layer + cache, new keys", cached, Keys::Fresh, false),
                ("layer + cache, replays", cached, Keys::Replayed, true),
            ];
            if let Some(hand) = hand {
                ways.push(("by hand, new keys", hand, Keys::Fresh, false));
                ways.push(("by hand, replays", hand, Keys::Replayed, true));
            }
            let wanted = |way: &str| {
                args.only
                    .as_ref()
                    .is_none_or(|only| way.contains(only.as_str()))
            };
            for (i, (way, target, keys, replayed)) in ways.into_iter().enumerate() {
                if !wanted(way) {
                    continue;
                }
                // The bare route right before each way: the machine's load drifts, and a
                // ratio to a run minutes away would measure the drift.
                let (_, base) =
                    run(plain, Keys::Fresh, false, &args, format!("p{round}w{i}")).await;
                let (cpu, redis_before) = (server_cpu(&server).await, redis_cpu(redis.as_ref()).await);
                let (n, rps) = run(target, keys, replayed, &args, format!("r{round}w{i}")).await;
                let per_request = |ns: u64| ns as f64 / 1000.0 / n.max(1) as f64;
                let cpu = per_request(server_cpu(&server).await - cpu);
                let redis_cpu = per_request(redis_cpu(redis.as_ref()).await - redis_before);
                println!(
                    "| {round} | {way} | {rps:.0} | {base:.0} | {:.2} | {cpu:.1} | {redis_cpu:.1} |",
                    rps / base
                );
            }
        });
    }
}
