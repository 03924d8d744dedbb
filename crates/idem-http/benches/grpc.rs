//! Load bench of the gRPC layer beside the same tonic method without it, in one run.
//!
//! One unary method (`/bench.v1.Payments/Charge`, a small reply, no work) is served by tonic on
//! one one-thread runtime: bare, behind the layer on Redis, and behind the layer on Redis with
//! a [`ReplayCache`]. Clients (one HTTP/2 connection each) on another one-thread runtime call
//! it for a number of seconds per row:
//!
//! - `plain`: the bare method (with an `idempotency-key` it ignores);
//! - `layer, new keys`: a fresh key per call (claim, run, store the answer);
//! - `layer, replays`: keys answered before (the store replays them);
//! - `layer + cache, replays`: the same through the replay cache (answered from memory).
//!
//! Rows are interleaved: each way runs right after a run of `plain`, and its row gives the
//! ratio to that run.
//!
//! `cargo bench -p idem-http --bench grpc -- [--seconds N] [--concurrency N] [--rounds N]
//! [--store memory]` (`REDIS_URL`, default `redis://127.0.0.1:6379`).

#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::expect_used,
    clippy::cast_precision_loss
)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::uri::PathAndQuery;
use idem_core::{BoxFuture, SharedStore};
use idem_http::{GrpcIdempotencyLayer, Policy};
use idem_store::{ReplayCache, ReplayCacheLimits};
use idem_testkit::load;
use tonic::Status;
use tonic::metadata::MetadataValue;
use tonic::server::{NamedService, UnaryService};
use tonic::transport::{Channel, Server};

const CHARGE: &str = "/bench.v1.Payments/Charge";
/// How many keys the replay rows cycle through, each answered once before the rounds.
const REPLAY_KEYS: usize = 1000;

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeRequest {
    #[prost(string, tag = "1")]
    customer: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeReply {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(string, tag = "2")]
    status: String,
    #[prost(int64, tag = "3")]
    amount: i64,
}

#[derive(Clone)]
struct Payments;

impl NamedService for Payments {
    const NAME: &'static str = "bench.v1.Payments";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Payments {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(Charge, req).await)
        })
    }
}

struct Charge;

impl UnaryService<ChargeRequest> for Charge {
    type Response = ChargeReply;
    type Future = std::future::Ready<Result<tonic::Response<ChargeReply>, Status>>;

    fn call(&mut self, req: tonic::Request<ChargeRequest>) -> Self::Future {
        let amount = req.into_inner().amount;
        std::future::ready(Ok(tonic::Response::new(ChargeReply {
            id: "ch_1".into(),
            status: "succeeded".into(),
            amount,
        })))
    }
}

struct Args {
    seconds: u64,
    concurrency: usize,
    rounds: usize,
    store: String,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 5,
        concurrency: 16,
        rounds: 3,
        store: "redis".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().expect("a value");
        match flag.as_str() {
            "--seconds" => a.seconds = value().parse().unwrap(),
            "--concurrency" => a.concurrency = value().parse().unwrap(),
            "--rounds" => a.rounds = value().parse().unwrap(),
            "--store" => a.store = value(),
            "--quick" => (a.seconds, a.rounds) = (1, 1),
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

async fn store(kind: &str, run_id: &str) -> SharedStore {
    match kind {
        "memory" => Arc::new(idem_store::MemoryStore::new()),
        _ => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            let options = idem_store::RedisOptions {
                prefix: format!("idem-bench-grpc:{run_id}:"),
                ..idem_store::RedisOptions::default()
            };
            Arc::new(
                idem_store::RedisStore::connect(&url, options)
                    .await
                    .unwrap(),
            )
        }
    }
}

async fn serve(layer: Option<GrpcIdempotencyLayer>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    match layer {
        Some(layer) => tokio::spawn(
            Server::builder()
                .layer(layer)
                .add_service(Payments)
                .serve_with_incoming(incoming),
        ),
        None => tokio::spawn(
            Server::builder()
                .add_service(Payments)
                .serve_with_incoming(incoming),
        ),
    };
    addr
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// One call with `key`; panics unless it is answered (and replayed when `replayed`).
async fn charge(ch: &Channel, key: &str, replayed: bool) {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(ChargeRequest {
        customer: "cus_1".into(),
        amount: 2000,
    });
    req.metadata_mut()
        .insert("idempotency-key", MetadataValue::try_from(key).unwrap());
    let res: tonic::Response<ChargeReply> = grpc
        .unary(
            req,
            PathAndQuery::from_static(CHARGE),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        res.metadata().contains_key("idempotent-replayed"),
        replayed,
        "{key}"
    );
    assert_eq!(res.into_inner().amount, 2000);
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    Fresh,
    Replayed,
}

/// Calls answered and calls per second.
async fn run(
    target: SocketAddr,
    keys: Keys,
    replayed: bool,
    args: &Args,
    tag: &str,
) -> (usize, f64) {
    let done = Arc::new(AtomicUsize::new(0));
    let mut channels = Vec::new();
    for _ in 0..args.concurrency {
        channels.push(channel(target).await);
    }
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for (task, ch) in channels.into_iter().enumerate() {
        let (done, tag) = (done.clone(), tag.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while Instant::now() < until {
                let key = match keys {
                    Keys::Fresh => format!("{tag}-{task}-{i}"),
                    Keys::Replayed => format!("warm-{}", (task * 7919 + i) % REPLAY_KEYS),
                };
                charge(&ch, &key, replayed).await;
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n = done.load(Ordering::Relaxed);
    (n, n as f64 / start.elapsed().as_secs_f64())
}

fn main() {
    let args = args();
    let (server_rt, load_rt) = (load::runtime(), load::runtime());
    let run_id = format!(
        "{}-{}",
        std::process::id(),
        idem_core::Timestamp::now().as_millis()
    );
    let (plain, layered, cached) = server_rt.block_on(async {
        let shared = store(&args.store, &run_id).await;
        // Records outlive the run (every way and its plain run, every round, and a minute).
        let run_secs = args.seconds * 6 * args.rounds as u64;
        let policy = Policy::default().ttl(Duration::from_secs(60 + run_secs));
        let cache: SharedStore = Arc::new(ReplayCache::new(
            shared.clone(),
            ReplayCacheLimits::default(),
        ));
        let layer = |store| Some(GrpcIdempotencyLayer::new(store, policy.clone()).method(CHARGE));
        (
            serve(None).await,
            serve(layer(shared)).await,
            serve(layer(cache)).await,
        )
    });
    load_rt.block_on(async {
        // Both layered servers share the store: the keys warmed through one are answered by
        // both.
        let ch = channel(layered).await;
        for k in 0..REPLAY_KEYS {
            charge(&ch, &format!("warm-{k}"), false).await;
        }
    });
    println!(
        "gRPC layer bench: store {}, {} clients (one HTTP/2 connection each), {} s per row, {} rounds\n",
        args.store, args.concurrency, args.seconds, args.rounds
    );
    println!("| round | way | calls/s | plain calls/s | × plain |");
    println!("|---|---|---:|---:|---:|");
    for round in 1..=args.rounds {
        load_rt.block_on(async {
            let ways = [
                ("layer, new keys", layered, Keys::Fresh, false),
                ("layer, replays", layered, Keys::Replayed, true),
                ("layer + cache, replays", cached, Keys::Replayed, true),
            ];
            for (i, (way, target, keys, replayed)) in ways.into_iter().enumerate() {
                let (_, base) =
                    run(plain, Keys::Fresh, false, &args, &format!("p{round}w{i}")).await;
                let (_, rps) = run(target, keys, replayed, &args, &format!("r{round}w{i}")).await;
                println!(
                    "| {round} | {way} | {rps:.0} | {base:.0} | {:.2} |",
                    rps / base
                );
            }
        });
    }
    if args.store != "memory" {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        load_rt.block_on(idem_testkit::services::forget_redis_keys(
            &url,
            &format!("idem-bench-grpc:{run_id}:"),
        ));
    }
}
