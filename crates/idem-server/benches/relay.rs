//! `idem relay` against a bare relay, on RabbitMQ, in interleaved rounds.
//!
//! - `bare`: consume the queue, POST each body to the target, ack; no records. The same
//!   request as the relay's (POST, `Content-Type: application/json`, the message id as
//!   `Idempotency-Key`), the same HTTP client (hyper-util's pooled client, `TCP_NODELAY`), the
//!   same prefetch and concurrency, the loop shaped like `Consumer::run`;
//! - `relay-<store>`: `Consumer::new(store)` with [`idem_gateway::relay::Relay`] as the handler,
//!   built as `idem relay` builds it (scope `relay`, concurrency = prefetch, connection named
//!   `idem relay`), its records in the relay's default store (an SQLite file, here in a temp
//!   dir) or in Redis.
//!
//! The target is an axum server on loopback that answers 201 with an empty body at once, on a
//! one-thread runtime of its own in this process. Each row publishes N messages to a fresh
//! quorum queue, then times from the first delivery to the last settle; the queue is deleted
//! after. One round runs every variant once; ratios are to the `bare` row of the same round.
//! RabbitMQ and Redis are found at the test URLs (`idem_testkit::services`) and skipped with a
//! note when they do not answer.
//!
//! `cargo bench -p idem-server --bench relay -- [--messages N] [--rounds N] [--prefetch N]
//! [--quick]`

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_precision_loss
)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::SharedStore;
use idem_gateway::relay::{Relay, Target};
use idem_mq::amqp::AmqpSource;
use idem_mq::bench::{Meter, Row, Timed, all_settled, bare, fill_amqp, hex};
use idem_mq::{Consumer, Delivery, Disposition, Source};
use idem_testkit::services::{RABBITMQ, REDIS};

struct Args {
    messages: usize,
    rounds: usize,
    prefetch: u16,
}

fn args() -> Args {
    let mut a = Args {
        messages: 10_000,
        rounds: 3,
        prefetch: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--messages" => a.messages = it.next().and_then(|v| v.parse().ok()).expect("N"),
            "--rounds" => a.rounds = it.next().and_then(|v| v.parse().ok()).expect("N"),
            "--prefetch" => a.prefetch = it.next().and_then(|v| v.parse().ok()).expect("N"),
            "--quick" => {
                a.messages = 1_000;
                a.rounds = 2;
            }
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

// ---------------------------------------------------------------------------------------------
// The target, and the two relays.

/// The target: answers 201 at once, counting the requests it got.
async fn target(hits: Arc<AtomicUsize>) -> SocketAddr {
    let app = Router::new().route(
        "/orders",
        post(move |_body: axum::body::Bytes| {
            let hits = Arc::clone(&hits);
            async move {
                hits.fetch_add(1, Ordering::Relaxed);
                StatusCode::CREATED
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The bare relay: `concurrency` deliveries at once, each POSTed, then acked; no records.
async fn bare_relay<S: Source>(
    source: S,
    url: &str,
    concurrency: usize,
    shutdown: impl Future<Output = ()>,
) {
    // As `Relay::new` builds its client.
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Body> =
        Client::builder(TokioExecutor::new()).build(connector);
    bare(source, "bare relay", concurrency, shutdown, |delivery| {
        let (client, url) = (client.clone(), url.to_owned());
        async move {
            let mut req = Request::builder()
                .method(Method::POST)
                .uri(url)
                .header("content-type", "application/json");
            if let Some(id) = delivery.message_id() {
                req = req.header("idempotency-key", id);
            }
            let req = req.body(Body::from(bytes_of(delivery.payload()))).unwrap();
            let sent = tokio::time::timeout(Duration::from_secs(30), async {
                let res = client.request(req).await?;
                let status = res.status();
                let _ = res.into_body().collect().await;
                Ok::<_, hyper_util::client::legacy::Error>(status)
            })
            .await;
            let how = match sent {
                Ok(Ok(status)) if status.is_success() => Disposition::Ack,
                other => {
                    eprintln!("bare relay: the target did not take a message: {other:?}");
                    Disposition::Requeue {
                        delay: Duration::ZERO,
                    }
                }
            };
            if let Err(e) = delivery.settle(how).await {
                eprintln!("bare relay: settle refused: {e}");
            }
        }
    })
    .await;
}

/// The body as the relay takes it: a copy of the delivery's payload.
fn bytes_of(payload: &[u8]) -> axum::body::Bytes {
    axum::body::Bytes::copy_from_slice(payload)
}

/// One row: a fresh queue of `n` messages, relayed by `store`'s relay (`None`: bare).
async fn row(
    amqp: &str,
    to: &str,
    hits: &AtomicUsize,
    store: Option<&SharedStore>,
    prefetch: u16,
    n: usize,
) -> Row {
    let queue = format!("idem-bench-relay-{}", hex());
    fill_amqp(amqp, &queue, prefetch, n).await;
    let source = AmqpSource::builder(amqp, &queue)
        .prefetch(prefetch)
        .connection_name("idem relay")
        .connect()
        .await
        .unwrap();
    let meter = Meter::new(n);
    let source = Timed {
        inner: source,
        meter: Arc::clone(&meter),
    };
    let shutdown = all_settled(Arc::clone(&meter));
    let hits_before = hits.load(Ordering::Relaxed);
    let mut note = String::new();
    match store {
        None => bare_relay(source, to, usize::from(prefetch), shutdown).await,
        Some(store) => {
            // As `idem relay` builds it (TTL ten minutes rather than a day: the Redis records
            // of the run expire by themselves).
            let consumer = Consumer::new(store.clone())
                .scope("relay")
                .ttl(Duration::from_secs(600))
                .concurrency(usize::from(prefetch));
            let relay = Relay::new(Target::parse(to).unwrap());
            consumer.run(source, relay, shutdown).await.unwrap();
            let c = consumer.counts();
            if c.handled != n as u64 || c.received != n as u64 {
                note = format!(
                    "received {}, handled {}, replayed {}, requeued {}",
                    c.received, c.handled, c.replayed, c.requeued
                );
            }
        }
    }
    let posted = hits.load(Ordering::Relaxed) - hits_before;
    if posted != n {
        note = format!("{note} {posted} POSTs").trim().to_owned();
    }
    AmqpSource::delete_topology(amqp, &queue).await.unwrap();
    Row::of(&meter, note)
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let args = args();
    let Some(amqp) = RABBITMQ.url() else {
        println!("relay bench skipped: no RabbitMQ");
        return;
    };
    let hits = Arc::new(AtomicUsize::new(0));
    let target_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let addr = target_rt.block_on(target(Arc::clone(&hits)));
    let to = format!("http://{addr}/orders");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stores: Vec<(&str, SharedStore)> = runtime.block_on(async {
        let sqlite = format!("sqlite://{}", dir.path().join("idem-relay.db").display());
        let mut stores = vec![("relay-sqlite", idem_store::open(&sqlite).await.unwrap())];
        if let Some(url) = REDIS.url() {
            let options = idem_store::RedisOptions {
                prefix: format!("idem-bench-{}:", hex()),
                ..idem_store::RedisOptions::default()
            };
            let store = idem_store::RedisStore::connect(&url, options)
                .await
                .unwrap();
            stores.push(("relay-redis", Arc::new(store) as SharedStore));
        }
        stores
    });

    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "relay bench: {} messages per row, prefetch and concurrency {}, {} rounds; {cores} cores\n",
        args.messages, args.prefetch, args.rounds
    );
    println!("| round | relay | s | msg/s | × bare (same round) | note |");
    println!("|---:|---|---:|---:|---:|---|");
    let mut ratios: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 1..=args.rounds {
        let bare = runtime.block_on(row(&amqp, &to, &hits, None, args.prefetch, args.messages));
        println!(
            "| {round} | bare | {:.2} | {:.0} | 1.00 | {} |",
            bare.seconds, bare.rate, bare.note
        );
        for (label, store) in &stores {
            let r = runtime.block_on(row(
                &amqp,
                &to,
                &hits,
                Some(store),
                args.prefetch,
                args.messages,
            ));
            let ratio = r.rate / bare.rate;
            ratios.entry(label).or_default().push(ratio);
            println!(
                "| {round} | {label} | {:.2} | {:.0} | {ratio:.2} | {} |",
                r.seconds, r.rate, r.note
            );
        }
    }
    println!("\n| relay | × bare, range over rounds |");
    println!("|---|---|");
    for (label, r) in &ratios {
        let min = r.iter().copied().fold(f64::INFINITY, f64::min);
        let max = r.iter().copied().fold(0.0, f64::max);
        println!("| {label} | {min:.2}–{max:.2} |");
    }
}
