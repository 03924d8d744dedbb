//! Messages per second through the idempotent consumer against a bare consumer, on RabbitMQ,
//! NATS JetStream and Redis Streams, in interleaved rounds.
//!
//! - `bare`: a loop over the same [`Source`] that settles each delivery with
//!   [`Disposition::Ack`], with the same concurrency as the consumer (the shape of
//!   `Consumer::run`: a slot, the next delivery, a task that settles it);
//! - `idem-<store>`: `Consumer::run` with a handler that does nothing, its records in Redis,
//!   PostgreSQL or memory (memory separates the consumer's own cost from the store's round
//!   trips); `idem-redis-1` is Redis with group commit off (`max_batch` 1);
//! - `redis-by-hand`: the dedupe table of the reference articles written by hand on the same
//!   Redis, as the peer of `idem-redis`: `SET key running NX PX` (the claim), the handler
//!   (nothing), `SET key done XX PX` (the record), then the ack; no fence, no fingerprint, no
//!   lease kept alive, no payload copy, no metrics. It is the least a consumer that runs each
//!   message once on Redis must do, so what `idem-redis` costs beyond it is the price of those.
//!
//! On Redis Streams, `bare` is `XREADGROUP` and one `XACK` per entry; the stream, the records
//! and `redis-by-hand`'s keys share one server.
//!
//! Each row publishes N messages (a fresh key each) to a fresh queue or stream, then times from
//! the first delivery to the last settle; the queue or stream is deleted after, and the run's
//! Redis keys at its end. One round runs every variant once, in order; the ratio of each other
//! row is to the `bare` row of its round. Two columns split the time a message is held: from
//! its arrival to the start of its settle (for `idem-*`: the claim, the handler and the
//! record), and the settle itself. A broker or store that does not answer at the test URLs
//! (`idem_testkit::services`) is skipped with a note.
//!
//! `cargo bench -p idem-mq --bench consumer -- [--messages N] [--rounds N] [--prefetch N]
//! [--broker rabbitmq|nats|redis-streams] [--only idem-memory|idem-redis|idem-redis-1|idem-postgres|redis-by-hand]
//! [--quick]` (`--only` keeps `bare` and the variants whose names begin with it; a word that
//! `idem-redis` begins with, such as `idem-redis` or `idem`, also keeps its peer,
//! `redis-by-hand`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_precision_loss
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage, stream};
use bytes::Bytes;
use idem::{PostgresOptions, PostgresStore, RedisOptions, RedisStore};
use idem_core::Store;
use idem_mq::amqp::AmqpSource;
use idem_mq::bench::{BODY, Meter, Row, Timed, all_settled, bare, fill_amqp, hex};
use idem_mq::nats::{DeadLetterTarget, NatsSource};
use idem_mq::redis_streams::{self, RedisStreamSource};
use idem_mq::{Consumer, Delivery, Disposition, Failure, Message, Source};
use idem_testkit::services::{NATS, POSTGRES, RABBITMQ, REDIS, forget_redis_keys};
use redis::aio::MultiplexedConnection;

struct Args {
    messages: usize,
    rounds: usize,
    prefetch: u16,
    broker: Option<String>,
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        messages: 20_000,
        rounds: 3,
        prefetch: 64,
        broker: None,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--messages" => a.messages = it.next().and_then(|v| v.parse().ok()).expect("N"),
            "--rounds" => a.rounds = it.next().and_then(|v| v.parse().ok()).expect("N"),
            "--prefetch" => a.prefetch = it.next().and_then(|v| v.parse().ok()).expect("N"),
            "--broker" => a.broker = it.next(),
            "--only" => a.only = it.next(),
            "--quick" => {
                a.messages = 2_000;
                a.rounds = 2;
            }
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

// ---------------------------------------------------------------------------------------------
// The two consumers.

/// The bare consumer's work on a delivery: an ack, nothing recorded.
async fn bare_ack(delivery: impl Delivery) {
    if let Err(e) = delivery.settle(Disposition::Ack).await {
        eprintln!("bare consumer: ack refused: {e}");
    }
}

/// The `redis-by-hand` consumer's work on a delivery: claim its id in Redis, run the handler
/// (nothing), record it done, ack. An id found taken is acked if done and requeued if still
/// running, and counted in `taken`: every row's ids are fresh (its keys are under a prefix of
/// its own), so none should be.
async fn by_hand(
    mut redis: MultiplexedConnection,
    prefix: Arc<str>,
    taken: Arc<AtomicUsize>,
    delivery: impl Delivery,
) {
    let key = format!("{prefix}{}", delivery.message_id().expect("a message id"));
    let claimed: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg("running")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut redis)
        .await
        .expect("the claim");
    let how = if claimed.is_some() {
        let _: redis::Value = redis::cmd("SET")
            .arg(&key)
            .arg("done")
            .arg("XX")
            .arg("PX")
            .arg(600_000)
            .query_async(&mut redis)
            .await
            .expect("the record");
        Disposition::Ack
    } else {
        taken.fetch_add(1, Ordering::Relaxed);
        let state: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .expect("the state");
        if state.as_deref() == Some("done") {
            Disposition::Ack
        } else {
            Disposition::Requeue {
                delay: Duration::from_secs(1),
            }
        }
    };
    if let Err(e) = delivery.settle(how).await {
        eprintln!("redis-by-hand: settle refused: {e}");
    }
}

/// The handler of the idempotent consumer: nothing to do.
async fn nothing(_: Message) -> Result<(), Failure<String>> {
    Ok(())
}

#[derive(Clone)]
enum Records {
    Memory,
    /// The store, and whether it groups concurrent calls (its default) or sends each alone.
    Redis(Box<RedisStore>, bool),
    Postgres(Box<PostgresStore>),
    /// The dedupe table by hand: a connection, and the prefix of the run's keys (each row
    /// adds one of its own).
    ByHand(MultiplexedConnection, Arc<str>),
}

impl Records {
    fn label(&self) -> &'static str {
        match self {
            Records::Memory => "idem-memory",
            Records::Redis(_, true) => "idem-redis",
            Records::Redis(_, false) => "idem-redis-1",
            Records::Postgres(_) => "idem-postgres",
            Records::ByHand(..) => "redis-by-hand",
        }
    }
}

/// Runs `variant` (`None`: bare) over `source` until all `n` messages are settled.
async fn consume<S: Source>(source: S, variant: Option<&Records>, prefetch: u16, n: usize) -> Row {
    let meter = Meter::new(n);
    let source = Timed {
        inner: source,
        meter: Arc::clone(&meter),
    };
    let concurrency = usize::from(prefetch);
    let shutdown = all_settled(Arc::clone(&meter));
    let note = match variant {
        None => {
            bare(source, "bare consumer", concurrency, shutdown, bare_ack).await;
            String::new()
        }
        Some(Records::Memory) => {
            let consumer = idem_consumer(idem::MemoryStore::new(), concurrency);
            consumer.run(source, nothing, shutdown).await.unwrap();
            counts_note(consumer.counts(), n)
        }
        Some(Records::Redis(store, _)) => {
            let consumer = idem_consumer((**store).clone(), concurrency);
            consumer.run(source, nothing, shutdown).await.unwrap();
            counts_note(consumer.counts(), n)
        }
        Some(Records::Postgres(store)) => {
            let consumer = idem_consumer((**store).clone(), concurrency);
            consumer.run(source, nothing, shutdown).await.unwrap();
            counts_note(consumer.counts(), n)
        }
        Some(Records::ByHand(redis, prefix)) => {
            let prefix: Arc<str> = format!("{prefix}{}:", hex()).into();
            let taken = Arc::new(AtomicUsize::new(0));
            let work = |delivery| by_hand(redis.clone(), prefix.clone(), taken.clone(), delivery);
            bare(source, "redis-by-hand", concurrency, shutdown, work).await;
            match taken.load(Ordering::Relaxed) {
                0 => String::new(),
                n => format!("{n} claims found the id taken"),
            }
        }
    };
    Row::of(&meter, note)
}

fn idem_consumer<S: Store + Clone>(store: S, concurrency: usize) -> Consumer<S> {
    // Ten minutes: long enough for the run, and the Redis records expire by themselves.
    Consumer::new(store)
        .concurrency(concurrency)
        .ttl(Duration::from_secs(600))
}

/// Empty when each message was handled exactly once, as it should be; else what happened.
fn counts_note(c: idem_mq::Counts, n: usize) -> String {
    let n = n as u64;
    if c.handled == n && c.received == n {
        String::new()
    } else {
        format!(
            "received {}, handled {}, replayed {}, requeued {}, unsettled {}",
            c.received, c.handled, c.replayed, c.requeued, c.unsettled
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Brokers: a fresh queue or stream per row, filled before the timed consume.

/// RabbitMQ: declares the queue as the source does (a quorum queue), publishes `n` messages
/// with publisher confirms, then consumes it with a fresh source.
async fn amqp_row(url: &str, variant: Option<&Records>, prefetch: u16, n: usize) -> Row {
    let queue = format!("idem-bench-{}", hex());
    fill_amqp(url, &queue, prefetch, n).await;
    let source = AmqpSource::builder(url, &queue)
        .prefetch(prefetch)
        .connect()
        .await
        .unwrap();
    let row = consume(source, variant, prefetch, n).await;
    AmqpSource::delete_topology(url, &queue).await.unwrap();
    row
}

/// NATS JetStream: a fresh stream on `<name>.in`, `n` messages published with `Nats-Msg-Id`
/// and acked by the stream, then consumed by a fresh durable pull consumer (batch = prefetch,
/// confirmed acks as by default; dead letters, of which there are none, only terminated).
async fn nats_row(url: &str, variant: Option<&Records>, prefetch: u16, n: usize) -> Row {
    let name = format!("IDEMB_{}", hex());
    let client = async_nats::connect(url).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.in")],
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .unwrap();
    let subject = format!("{name}.in");
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut acks = Vec::with_capacity(chunk.len());
        for i in chunk {
            let publish = PublishMessage::build()
                .message_id(format!("m-{i}"))
                .payload(Bytes::from_static(BODY));
            acks.push(js.send_publish(subject.clone(), publish).await.unwrap());
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    let source = NatsSource::builder(name.clone(), "bench")
        .batch(usize::from(prefetch))
        .dead_letter(DeadLetterTarget::TermOnly)
        .connect(url)
        .await
        .unwrap();
    let row = consume(source, variant, prefetch, n).await;
    js.delete_stream(&name).await.unwrap();
    row
}

/// Redis Streams: a fresh stream, `n` entries added in pipelines of 500 (a `message_id` and a
/// `payload` field each), then read through a fresh group; dead letters, of which there are
/// none, only acked.
async fn redis_streams_row(url: &str, variant: Option<&Records>, prefetch: u16, n: usize) -> Row {
    let name = format!("idem-bench-{}", hex());
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("XADD")
                .arg(&name)
                .arg("*")
                .arg(redis_streams::MESSAGE_ID_FIELD)
                .arg(format!("m-{i}"))
                .arg(redis_streams::PAYLOAD_FIELD)
                .arg(BODY)
                .ignore();
        }
        pipe.exec_async(&mut conn).await.unwrap();
    }
    let source = RedisStreamSource::builder(name.clone(), "bench")
        .batch(usize::from(prefetch))
        .dead_letter(redis_streams::DeadLetterTarget::AckOnly)
        .connect(url)
        .await
        .unwrap();
    let row = consume(source, variant, prefetch, n).await;
    redis::cmd("DEL")
        .arg(&name)
        .exec_async(&mut conn)
        .await
        .unwrap();
    row
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(args));
}

async fn run(args: Args) {
    let wanted = |b: &str| args.broker.as_deref().is_none_or(|w| w == b);
    // `idem-redis` keeps both Redis rows (with and without group commit).
    let only = |v: &str| args.only.as_deref().is_none_or(|w| v.starts_with(w));
    let mut variants: Vec<Option<Records>> = vec![None];
    // Every Redis key the run writes starts with one of these.
    let mut redis_prefixes = Vec::new();
    if only("idem-memory") {
        variants.push(Some(Records::Memory));
    }
    if let Some(url) = REDIS.url() {
        for (batched, label) in [(true, "idem-redis"), (false, "idem-redis-1")] {
            if !only(label) {
                continue;
            }
            let prefix = format!("idem-bench-{}:", hex());
            redis_prefixes.push(prefix.clone());
            let options = RedisOptions {
                prefix,
                max_batch: if batched { 64 } else { 1 },
                ..RedisOptions::default()
            };
            let store = RedisStore::connect(&url, options).await.unwrap();
            variants.push(Some(Records::Redis(Box::new(store), batched)));
        }
        if only("redis-by-hand") || only("idem-redis") {
            let client = redis::Client::open(url.as_str()).unwrap();
            let conn = client.get_multiplexed_async_connection().await.unwrap();
            let prefix = format!("idem-bench-{}:", hex());
            redis_prefixes.push(prefix.clone());
            variants.push(Some(Records::ByHand(conn, prefix.into())));
        }
    }
    let table = format!("idem_bench_mq_{}", hex());
    let mut postgres = None;
    if let Some(url) = POSTGRES.url().filter(|_| only("idem-postgres")) {
        let options = PostgresOptions {
            table: table.clone(),
            ..PostgresOptions::default()
        };
        let store = PostgresStore::connect_with(&url, options).await.unwrap();
        postgres = Some(store.clone());
        variants.push(Some(Records::Postgres(Box::new(store))));
    }

    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "consumer bench: {} messages per row, prefetch and concurrency {}, {} rounds; {cores} cores\n",
        args.messages, args.prefetch, args.rounds
    );
    println!(
        "| broker | round | consumer | s | msg/s | × bare (same round) | ms to settle | ms settling | note |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---|");
    let mut ratios: BTreeMap<(&str, &str), Vec<f64>> = BTreeMap::new();
    let brokers = [
        ("rabbitmq", RABBITMQ.url()),
        ("nats", NATS.url()),
        ("redis-streams", REDIS.url()),
    ];
    for (broker, url) in brokers {
        let Some(url) = url.filter(|_| wanted(broker)) else {
            continue;
        };
        for round in 1..=args.rounds {
            let mut bare_rate = None;
            for variant in &variants {
                let row = match broker {
                    "rabbitmq" => {
                        amqp_row(&url, variant.as_ref(), args.prefetch, args.messages).await
                    }
                    "nats" => nats_row(&url, variant.as_ref(), args.prefetch, args.messages).await,
                    _ => {
                        redis_streams_row(&url, variant.as_ref(), args.prefetch, args.messages)
                            .await
                    }
                };
                let label = variant.as_ref().map_or("bare", Records::label);
                let ratio = match bare_rate {
                    None => {
                        bare_rate = Some(row.rate);
                        "1.00".to_owned()
                    }
                    Some(bare) => {
                        let ratio = row.rate / bare;
                        ratios.entry((broker, label)).or_default().push(ratio);
                        format!("{ratio:.2}")
                    }
                };
                println!(
                    "| {broker} | {round} | {label} | {:.2} | {:.0} | {ratio} | {:.2} | {:.2} | {} |",
                    row.seconds, row.rate, row.before_settle_ms, row.settle_ms, row.note
                );
            }
        }
    }

    println!("\n| broker | consumer | × bare, range over rounds |");
    println!("|---|---|---|");
    for ((broker, label), r) in &ratios {
        let min = r.iter().copied().fold(f64::INFINITY, f64::min);
        let max = r.iter().copied().fold(0.0, f64::max);
        println!("| {broker} | {label} | {min:.2}–{max:.2} |");
    }

    if let Some(url) = REDIS.url() {
        for prefix in &redis_prefixes {
            forget_redis_keys(&url, prefix).await;
        }
    }
    if let Some(store) = postgres {
        for t in [
            table.clone(),
            format!("{table}_counters"),
            format!("{table}_locks"),
            format!("{table}_migrations"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                .execute(store.pool())
                .await
                .unwrap();
        }
    }
}
