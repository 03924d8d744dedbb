//! Real `idem relay` processes under the nemesis: two relays consume one queue (RabbitMQ), one
//! durable consumer of a stream (NATS JetStream) or one consumer group of a Redis stream of this
//! run's own, and POST each message to the fenced ledger, which counts one effect per message
//! id (the relay's `Idempotency-Key`) and refuses an attempt whose `Idem-Fence` is lower than
//! one it took. A publisher publishes new message ids, [`PER_SECOND`] a second for as long as
//! the nemesis strikes, three in ten of them twice.
//!
//! The relays share one store, each through a proxy of its own. The nemesis stops a relay
//! past its lease, kills and restarts one, restarts one with its wall clock ahead, stalls,
//! delays or cuts one's store connections, and crashes the store, in the seeded order of
//! `Schedule`. Once the broker has nothing left to deliver, the checker reads the publisher's
//! history with the ledger, the broker's dead letters and the store: every message has its
//! effect once, none is lost, none is left unacked, and every message acked has a completed
//! record (acked only once recorded).
//!
//! The Redis stream and JetStream runs each carry a second source on the same store, named so
//! that the two sources' records would share one namespace under the old default (the names
//! joined by dots): `S.eu` with group `x` beside `S` with group `eu.x`; JetStream stream `S`
//! with consumer `relay` beside RabbitMQ queue `S.relay`. Both get every message id; a relay
//! that took the other source's records for its own would ack without POSTing, and the
//! ledger would miss those effects.
//!
//! Each backend runs when its broker answers (`IDEM_TEST_AMQP_URL`, `IDEM_TEST_NATS_URL`,
//! `IDEM_TEST_REDIS_URL`; under `CI=true` a missing one fails). `IDEM_FAULTS_SECS` sets how
//! long the nemesis runs (at least half of it for each run, and until every kind has struck),
//! `IDEM_FAULTS_STORE` the relays' store (as for the other runs: by default a Redis of the
//! run's own), `IDEM_FAULTS_HISTORY` a file to keep the history in (suffixed with the
//! backend), `IDEM_FAULTS_SEED` the nemesis's schedule.

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_core::{ClientKey, Clock, Key, Namespace, Scope, Status, SystemClock};
use idem_mq::Identity;
use idem_mq::amqp::lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use idem_mq::amqp::lapin::types::FieldTable;
use idem_mq::amqp::lapin::{Connection, ConnectionProperties};
use idem_mq::amqp::{AmqpPublisher, AmqpSource, BasicProperties};

use crate::check::{Drained, Event, History, RelayEvent, RelayReport, check_relay};
use crate::ledger::{Entries, Ledger};
use crate::proxy::{Mode, Proxy};
use crate::{Schedule, cluster, fault_kinds, seconds};

/// Relays consuming each source at once.
const RELAYS: usize = 2;

/// Message ids published per second while the nemesis strikes (three in ten once more). Each
/// run's nemesis runs at least half of `IDEM_FAULTS_SECS`, so that the relay runs together
/// take about as long as the gateways' run beside them on two cores.
const PER_SECOND: usize = 25;

/// How long the run may take to drain once the nemesis is done: bounded, so that a message
/// that never settles ends the run with a report instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(90);

/// The delay queues the AMQP source requeues through (idem-mq's `DELAY_BUCKETS_MS`, up to
/// the longest a requeue in this run can ask for): a message waiting in one is not settled.
const AMQP_DELAY_BUCKETS_MS: &[u64] = &[100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000];

/// The durable consumer the relays read a JetStream stream through.
const NATS_CONSUMER: &str = "relay";

#[test]
fn relays_stopped_killed_and_restarted_deliver_each_amqp_message_once() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let queue = format!("faults-relay-{}", run_id());
    run_clean(&[Broker::Amqp { url, queue }], &super::chosen_store());
}

/// The same on a Valkey 9, where the relays' records settle by plain `SET … IFEQ` (unless
/// `IDEM_FAULTS_STORE` chose the runs' store).
#[test]
fn relays_on_valkey_deliver_each_amqp_message_once() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    if std::env::var_os("IDEM_FAULTS_STORE").is_some() {
        println!("IDEM_FAULTS_STORE chose the store: the Valkey runs are left to it");
        return;
    }
    let queue = format!("faults-relay-valkey-{}", run_id());
    run_clean(&[Broker::Amqp { url, queue }], "own-valkey");
}

/// Beside the stream, on the same store, a RabbitMQ queue named as the stream and its
/// consumer joined by a dot.
#[test]
fn relays_stopped_killed_and_restarted_deliver_each_jetstream_message_once() {
    let Some(url) = idem_testkit::services::NATS.url() else {
        return;
    };
    let stream = format!("FAULTS_RELAY_{}", run_id());
    let mut sources = vec![Broker::Nats {
        url,
        stream: stream.clone(),
    }];
    if let Some(url) = idem_testkit::services::RABBITMQ.url() {
        let queue = format!("{stream}.{NATS_CONSUMER}");
        sources.push(Broker::Amqp { url, queue });
    }
    run_clean(&sources, &super::chosen_store());
}

/// A Redis stream read through one consumer group: a relay killed or stopped leaves its entries
/// pending, and the other claims them after twice the lease. Beside it, on the same store,
/// a stream and group whose names join with a dot as the first's do.
#[test]
fn relays_stopped_killed_and_restarted_deliver_each_redis_stream_entry_once() {
    let Some(url) = idem_testkit::services::REDIS.url() else {
        return;
    };
    let stream = format!("faults-relay:{}", run_id());
    let sources = [
        Broker::Redis {
            url: url.clone(),
            stream: format!("{stream}.eu"),
            group: "x".into(),
        },
        Broker::Redis {
            url,
            stream,
            group: "eu.x".into(),
        },
    ];
    run_clean(&sources, &super::chosen_store());
}

/// Runs the relays of `sources` on one store, and asserts every source's report is clean.
fn run_clean(sources: &[Broker], chosen: &str) {
    let runs = relay_under_faults(sources, chosen);
    for ran in &runs {
        println!("{ran}");
    }
    for ran in &runs {
        ran.assert_clean();
    }
}

/// A run's report for one source, and what else it has to say.
struct Ran {
    source: String,
    report: RelayReport,
    notes: Vec<String>,
}

impl Ran {
    fn assert_clean(&self) {
        assert!(self.report.faults >= 2, "the nemesis ran: {self}");
        assert!(self.report.violations.is_empty(), "{self}");
    }
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for note in &self.notes {
            writeln!(f, "{note}")?;
        }
        write!(f, "relay over {}: {}", self.source, self.report)
    }
}

/// A name of this run's own: the brokers and the store are shared.
fn run_id() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// Where the relays take messages from, a queue or a stream of this run's own.
enum Broker {
    Amqp {
        url: String,
        queue: String,
    },
    Nats {
        url: String,
        stream: String,
    },
    Redis {
        url: String,
        stream: String,
        group: String,
    },
}

/// A publisher on either broker.
enum Publisher {
    Amqp(AmqpPublisher, String),
    Nats(jetstream::Context, String),
    Redis(redis::aio::MultiplexedConnection, String),
}

impl Publisher {
    /// Publishes one copy of `id`; `false` if the broker dropped it as a duplicate.
    async fn publish(&self, id: &str) -> bool {
        let body = format!("{{\"pay\":\"{id}\"}}");
        match self {
            Publisher::Amqp(p, queue) => {
                p.publish_once("", queue, id, body.as_bytes(), BasicProperties::default())
                    .await
                    .unwrap();
                true
            }
            Publisher::Nats(js, subject) => {
                let published =
                    idem_mq::nats::publish_once(js, subject.clone(), id, body.into_bytes().into())
                        .await
                        .unwrap();
                !published.duplicate
            }
            Publisher::Redis(conn, stream) => {
                idem_mq::redis_streams::publish(&mut conn.clone(), stream, id, body.as_bytes())
                    .await
                    .unwrap();
                true
            }
        }
    }
}

impl Broker {
    fn name(&self) -> &'static str {
        match self {
            Broker::Amqp { .. } => "amqp",
            Broker::Nats { .. } => "nats",
            Broker::Redis { .. } => "redis-streams",
        }
    }

    /// What picks the relays' source out on the store: its records' default namespace.
    fn identity(&self) -> Identity<'_> {
        match self {
            Broker::Amqp { queue, .. } => Identity::new("amqp", [queue.as_str()]),
            Broker::Nats { stream, .. } => Identity::new("nats", [stream.as_str(), NATS_CONSUMER]),
            Broker::Redis { stream, group, .. } => {
                Identity::new("redis", [stream.as_str(), group.as_str()])
            }
        }
    }

    /// The source as the report names it: the broker and its names.
    fn describe(&self) -> String {
        let names = match self {
            Broker::Amqp { queue, .. } => format!("queue {queue}"),
            Broker::Nats { stream, .. } => format!("stream {stream}, consumer {NATS_CONSUMER}"),
            Broker::Redis { stream, group, .. } => format!("stream {stream}, group {group}"),
        };
        format!("{} ({names})", self.name())
    }

    /// The relay's `--from` and queue or stream flags.
    fn flags(&self) -> Vec<String> {
        match self {
            Broker::Amqp { url, queue } => vec![
                "--from".into(),
                url.clone(),
                "--queue".into(),
                queue.clone(),
            ],
            Broker::Nats { url, stream } => vec![
                "--from".into(),
                url.clone(),
                "--stream".into(),
                stream.clone(),
                "--consumer".into(),
                NATS_CONSUMER.into(),
            ],
            Broker::Redis { url, stream, group } => vec![
                "--from".into(),
                url.clone(),
                "--stream".into(),
                stream.clone(),
                "--group".into(),
                group.clone(),
            ],
        }
    }

    /// Declares the queue (or makes the streams and the durable consumer) and connects a
    /// publisher.
    async fn prepare(&self) -> Publisher {
        match self {
            Broker::Amqp { url, queue } => {
                AmqpSource::builder(url.as_str(), queue.as_str())
                    .connect()
                    .await
                    .unwrap()
                    .shutdown()
                    .await;
                Publisher::Amqp(AmqpPublisher::connect(url).await.unwrap(), queue.clone())
            }
            Broker::Nats { url, stream } => {
                use jetstream::stream;
                let js = jetstream::new(async_nats::connect(url).await.unwrap());
                js.create_stream(stream::Config {
                    name: stream.clone(),
                    subjects: vec![format!("{stream}.in")],
                    // Short, so that the second copies reach the relays, which must drop them.
                    duplicate_window: Duration::from_millis(100),
                    max_age: Duration::from_secs(3600),
                    ..Default::default()
                })
                .await
                .unwrap();
                // An ack wait shorter than a pause: a stopped relay's messages are delivered
                // to the other while its lease may still run.
                js.create_consumer_on_stream(
                    jetstream::consumer::pull::Config {
                        durable_name: Some(NATS_CONSUMER.into()),
                        ack_wait: cluster::LEASE,
                        ..Default::default()
                    },
                    stream.as_str(),
                )
                .await
                .unwrap();
                js.create_stream(stream::Config {
                    name: format!("{stream}_DL"),
                    subjects: vec![format!("{stream}.dead")],
                    max_age: Duration::from_secs(3600),
                    ..Default::default()
                })
                .await
                .unwrap();
                Publisher::Nats(js, format!("{stream}.in"))
            }
            Broker::Redis { url, stream, group } => {
                let mut conn = redis_conn(url).await;
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(stream)
                    .arg(group)
                    .arg("0")
                    .arg("MKSTREAM")
                    .exec_async(&mut conn)
                    .await
                    .unwrap();
                Publisher::Redis(conn, stream.clone())
            }
        }
    }

    /// Messages the broker has not seen settled: ready or waiting in a delay queue, or
    /// delivered and not acked (RabbitMQ: asked of `rabbitmqctl` where it runs, since AMQP
    /// tells only the ready ones), or not yet delivered or not acked (JetStream).
    async fn unsettled(&self) -> u64 {
        match self {
            Broker::Amqp { url, queue } => {
                if let Some(n) = rabbitmqctl_unsettled(queue) {
                    return n;
                }
                let conn = Connection::connect(url, ConnectionProperties::default())
                    .await
                    .unwrap();
                let mut n = 0;
                let delays = AMQP_DELAY_BUCKETS_MS
                    .iter()
                    .map(|ms| format!("{queue}.delay.{ms}"));
                for name in std::iter::once(queue.clone()).chain(delays) {
                    // A delay queue nobody declared is refused, and its channel closed.
                    let ch = conn.create_channel().await.unwrap();
                    let passive = QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    };
                    if let Ok(q) = ch
                        .queue_declare(name.as_str().into(), passive, FieldTable::default())
                        .await
                    {
                        n += u64::from(q.message_count());
                        let _ = ch.close(200, "OK".into()).await;
                    }
                }
                let _ = conn.close(200, "OK".into()).await;
                n
            }
            Broker::Nats { url, stream } => {
                let js = jetstream::new(async_nats::connect(url).await.unwrap());
                let info = js
                    .get_stream(stream)
                    .await
                    .unwrap()
                    .consumer_info(NATS_CONSUMER)
                    .await
                    .unwrap();
                info.num_pending + info.num_ack_pending as u64
            }
            Broker::Redis { url, stream, group } => {
                let mut conn = redis_conn(url).await;
                let groups: Vec<std::collections::HashMap<String, redis::Value>> =
                    redis::cmd("XINFO")
                        .arg("GROUPS")
                        .arg(stream)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                let name = redis::Value::BulkString(group.as_bytes().to_vec());
                let group = groups
                    .iter()
                    .find(|g| g.get("name") == Some(&name))
                    .expect("the relays' group");
                let int = |field: &str| match group.get(field) {
                    Some(redis::Value::Int(n)) => u64::try_from(*n).ok(),
                    _ => None,
                };
                // Not read yet (the group's lag; unknown, so counted as one, when the stream
                // had entries deleted), and read but not acked.
                int("lag").unwrap_or(1) + int("pending").unwrap_or(0)
            }
        }
    }

    /// How many dead letters there are, taking none.
    async fn dead_letters_count(&self) -> usize {
        match self {
            Broker::Amqp { url, queue } => {
                let conn = Connection::connect(url, ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                let q = ch
                    .queue_declare(
                        format!("{queue}.dead").as_str().into(),
                        passive,
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                let _ = conn.close(200, "OK".into()).await;
                usize::try_from(q.message_count()).unwrap()
            }
            Broker::Nats { url, stream } => {
                let js = jetstream::new(async_nats::connect(url).await.unwrap());
                let mut dl = js.get_stream(format!("{stream}_DL")).await.unwrap();
                usize::try_from(dl.info().await.unwrap().state.messages).unwrap()
            }
            Broker::Redis { url, stream, .. } => redis::cmd("XLEN")
                .arg(format!("{stream}:dead"))
                .query_async(&mut redis_conn(url).await)
                .await
                .unwrap(),
        }
    }

    /// Every dead letter: its message id and reason.
    async fn dead_letters(&self) -> Vec<(String, String)> {
        let mut dead = Vec::new();
        match self {
            Broker::Amqp { url, queue } => {
                let conn = Connection::connect(url, ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                let from = format!("{queue}.dead");
                while let Some(m) = ch
                    .basic_get(from.as_str().into(), BasicGetOptions::default())
                    .await
                    .unwrap()
                {
                    let props = &m.delivery.properties;
                    let id = props
                        .message_id()
                        .as_ref()
                        .map_or_else(String::new, |s| s.to_string());
                    let why = [idem_mq::amqp::REASON_HEADER, idem_mq::amqp::DETAIL_HEADER]
                        .map(|h| idem_mq::bench::header_text(props, h).unwrap_or_default())
                        .join(": ");
                    dead.push((id, why));
                    m.delivery
                        .acker
                        .ack(BasicAckOptions::default())
                        .await
                        .unwrap();
                }
                let _ = conn.close(200, "OK".into()).await;
            }
            Broker::Nats { url, stream } => {
                use idem_mq::nats::{DETAIL_HEADER, MSG_ID_HEADER, REASON_HEADER};
                let js = jetstream::new(async_nats::connect(url).await.unwrap());
                let mut dl = js.get_stream(format!("{stream}_DL")).await.unwrap();
                let last = dl.info().await.unwrap().state.last_sequence;
                for seq in 1..=last {
                    let Ok(m) = dl.get_raw_message(seq).await else {
                        continue;
                    };
                    let text = |h: &str| {
                        m.headers
                            .get(h)
                            .map_or_else(String::new, |v| v.as_str().to_owned())
                    };
                    dead.push((
                        text(MSG_ID_HEADER),
                        format!("{}: {}", text(REASON_HEADER), text(DETAIL_HEADER)),
                    ));
                }
            }
            Broker::Redis { url, stream, .. } => {
                use idem_mq::redis_streams::{DETAIL_FIELD, MESSAGE_ID_FIELD, REASON_FIELD};
                let entries: Vec<(String, std::collections::HashMap<String, String>)> =
                    redis::cmd("XRANGE")
                        .arg(format!("{stream}:dead"))
                        .arg("-")
                        .arg("+")
                        .query_async(&mut redis_conn(url).await)
                        .await
                        .unwrap();
                for (_, fields) in entries {
                    let text = |f: &str| fields.get(f).cloned().unwrap_or_default();
                    dead.push((
                        text(MESSAGE_ID_FIELD),
                        format!("{}: {}", text(REASON_FIELD), text(DETAIL_FIELD)),
                    ));
                }
            }
        }
        dead
    }

    /// Deletes what the run made on the broker.
    async fn delete(&self) {
        match self {
            Broker::Amqp { url, queue } => AmqpSource::delete_topology(url, queue).await.unwrap(),
            Broker::Nats { url, stream } => {
                let js = jetstream::new(async_nats::connect(url).await.unwrap());
                js.delete_stream(stream).await.unwrap();
                js.delete_stream(format!("{stream}_DL")).await.unwrap();
            }
            Broker::Redis { url, stream, .. } => redis::cmd("DEL")
                .arg(stream)
                .arg(format!("{stream}:dead"))
                .exec_async(&mut redis_conn(url).await)
                .await
                .unwrap(),
        }
    }
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Messages ready or delivered and not acked in `queue` and its delay queues, as the broker
/// itself counts them; `None` where `rabbitmqctl` does not run here.
fn rabbitmqctl_unsettled(queue: &str) -> Option<u64> {
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let delay = format!("{queue}.delay.");
    let n = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let name = cols.next()?;
            (name == queue || name.starts_with(&delay)).then_some(())?;
            Some(cols.filter_map(|c| c.parse::<u64>().ok()).sum::<u64>())
        })
        .sum();
    Some(n)
}

/// One relay process: the source it consumes, and what stands between it and the store.
struct Relay {
    source: usize,
    store: String,
    proxy: Option<Proxy>,
    child: Child,
}

/// The relay processes, [`RELAYS`] per source, on one store, each writing its log to a file
/// of the run's.
struct Relays {
    relays: Vec<Relay>,
    /// Per source, the arguments of its relays but the store.
    args: Vec<Vec<String>>,
    dir: std::path::PathBuf,
    started: usize,
}

impl Relays {
    fn start(sources: &[Source<'_>], store: &str, dir: &std::path::Path) -> Self {
        let args = sources
            .iter()
            .map(|s| {
                let mut args = vec!["relay".to_owned()];
                args.extend(s.broker.flags());
                args.extend(
                    [
                        "--to",
                        &format!("http://{}/pay", s.ledger.addr),
                        "--prefetch",
                        "8",
                        "--lease",
                        &format!("{}s", cluster::LEASE.as_secs()),
                        "--status-every",
                        "1s",
                    ]
                    .map(str::to_owned),
                );
                args
            })
            .collect();
        let mut relays = Self {
            relays: Vec::new(),
            args,
            dir: dir.to_owned(),
            started: 0,
        };
        for source in 0..sources.len() {
            for _ in 0..RELAYS {
                let (store, proxy) = cluster::behind_proxy(store);
                let child = relays.spawn(source, &store, None);
                relays.relays.push(Relay {
                    source,
                    store,
                    proxy,
                    child,
                });
            }
        }
        relays
    }

    /// A relay of source `source` on `store`, its wall clock `ahead` of the others' if given.
    fn spawn(&mut self, source: usize, store: &str, ahead: Option<Duration>) -> Child {
        self.started += 1;
        let log =
            std::fs::File::create(self.dir.join(format!("relay-{}.log", self.started))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(&self.args[source])
            .args(["--store", store])
            .env_remove("IDEM_STORE")
            .env("IDEM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(ahead) = ahead {
            cluster::step_clock(&mut cmd, ahead);
        }
        cmd.spawn().unwrap()
    }

    fn kill_and_restart(&mut self, i: usize, ahead: Option<Duration>) {
        self.relays[i].child.kill().unwrap();
        self.relays[i].child.wait().unwrap();
        let (source, store) = (self.relays[i].source, self.relays[i].store.clone());
        self.relays[i].child = self.spawn(source, &store, ahead);
    }

    /// Whether the nemesis can come between the relays and their store.
    fn has_proxies(&self) -> bool {
        self.relays.iter().all(|r| r.proxy.is_some())
    }

    fn proxy(&self, i: usize) -> &Proxy {
        self.relays[i].proxy.as_ref().unwrap()
    }

    /// SIGTERM to each, and waits for it to drain and exit (killed if it does not).
    fn stop(&mut self) {
        for r in &self.relays {
            cluster::signal("-TERM", r.child.id());
        }
        let started = Instant::now();
        for r in &mut self.relays {
            while r.child.try_wait().unwrap().is_none() && started.elapsed() < PATIENCE {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for r in &mut self.relays {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

/// The ledger's entries by message id: the relay sends each key as a structured-field string
/// (`"r…-m1"`), which the ledger keeps as it came.
fn by_message_id(e: Entries) -> Entries {
    let id = |k: String| idem_http::parse_key(k.as_bytes()).unwrap_or(k);
    Entries {
        counted: e.counted.into_iter().map(|(k, f)| (id(k), f)).collect(),
        accepted: e.accepted.into_iter().map(|(k, f)| (id(k), f)).collect(),
        refused: e.refused.into_iter().map(|(k, f)| (id(k), f)).collect(),
    }
}

/// One source of a run: its broker, the ledger its relays POST to, and its history.
struct Source<'a> {
    broker: &'a Broker,
    ledger: Ledger,
    history: Arc<History>,
}

/// One fault of kind `fault` at relay `victim` (or at the store).
fn strike(relays: &mut Relays, store: &mut cluster::Store, fault: &str, victim: usize) {
    let past_lease = cluster::LEASE + Duration::from_millis(800);
    match fault {
        // Past the lease: the other relay takes over the keys it held.
        "pause" => {
            let pid = relays.relays[victim].child.id();
            cluster::signal("-STOP", pid);
            std::thread::sleep(past_lease);
            cluster::signal("-CONT", pid);
        }
        // Its wall clock a lease and a half ahead: it takes over leases the other still
        // holds, until a kill restarts it on the true time.
        "clock" => relays.kill_and_restart(victim, Some(cluster::LEASE + Duration::from_secs(1))),
        "kill" => relays.kill_and_restart(victim, None),
        // Its store answers nothing past the lease: its claims, settles and renewals wait,
        // time out, and must not be taken for done.
        "stall" => {
            relays.proxy(victim).set(Mode::Hold);
            std::thread::sleep(past_lease);
            relays.proxy(victim).set(Mode::Pass);
        }
        "jitter" => {
            relays.proxy(victim).set(Mode::Jitter(300));
            std::thread::sleep(Duration::from_secs(3));
            relays.proxy(victim).set(Mode::Pass);
        }
        // Its store connections drop, answers in flight lost after the store did the work.
        "cut" => {
            relays.proxy(victim).cut();
        }
        // Down long enough that a `complete` in flight fails through its retries: the
        // handled message's result is not recorded, and it must not be acked.
        "store" => assert!(store.crash_and_restart(Duration::from_millis(1500))),
        other => unreachable!("no fault {other}"),
    }
}

/// Per message id of `ids` not dead-lettered: a completed record in `broker`'s namespace on
/// the store at `url`. Once the broker holds nothing (checked apart), every such message was
/// acked, and the relay acks only once the record is stored, so one without it is a violation.
/// The namespace is the relay's default, built here from the broker's names as the sources
/// build it: a namespace that differed would show every message without its record.
async fn acked_without_record(
    url: &str,
    broker: &Broker,
    ids: &[String],
    drained: &Drained,
) -> Vec<String> {
    let store = idem_store::open(url).await.unwrap();
    let scope = Scope::new(idem_gateway::relay::SCOPE).unwrap();
    let namespace: Namespace = broker.identity().namespace();
    let dead: HashSet<&str> = drained.dead.iter().map(|(id, _)| id.as_str()).collect();
    let mut violations = Vec::new();
    for id in ids.iter().filter(|id| !dead.contains(id.as_str())) {
        let key = Key::new(
            scope.clone(),
            namespace.clone(),
            ClientKey::new(id).unwrap(),
        );
        match store.get(&key, SystemClock.now()).await.unwrap() {
            Some(r) if r.status == Status::Completed => {}
            Some(r) => violations.push(format!(
                "{id}: acked, and its record is {:?} (fence {}), not completed",
                r.status, r.fence
            )),
            None => violations.push(format!("{id}: acked, and the store has no record of it")),
        }
    }
    violations
}

fn relay_under_faults(brokers: &[Broker], chosen: &str) -> Vec<Ran> {
    let mut notes = Vec::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The store `chosen` names (see `cluster::Store::named`).
    let mut store = cluster::Store::named(chosen, dir.path());
    let sources: Vec<Source<'_>> = brokers
        .iter()
        .map(|broker| Source {
            broker,
            ledger: Ledger::start(),
            history: Arc::new(History::default()),
        })
        .collect();
    let length = Duration::from_secs(seconds()) / 2;
    let publishers: Vec<(Publisher, Arc<History>)> = sources
        .iter()
        .map(|s| (rt.block_on(s.broker.prepare()), s.history.clone()))
        .collect();
    let mut relays = Relays::start(&sources, &store.url(), dir.path());

    // The publisher: new ids at `PER_SECOND` for as long as the nemesis strikes, so that every
    // fault finds messages in flight, each of three in ten again some thirty ids later (a
    // publisher's retry, or a copy the broker delivered twice); then those copies still due.
    let run = run_id();
    let striking = Arc::new(AtomicBool::new(true));
    let published = rt.spawn({
        let striking = striking.clone();
        async move {
            let id = |i: usize| format!("r{run}-m{i}");
            let copy = |i: usize| i % 10 < 3;
            let publish = async |id: String| {
                for (publisher, history) in &publishers {
                    if publisher.publish(&id).await {
                        let id = id.clone();
                        history.push(Event::Relay(RelayEvent::Published { id }));
                    }
                }
            };
            let pace = Duration::from_secs(1) / u32::try_from(PER_SECOND).unwrap();
            let mut n = 0;
            while striking.load(Ordering::Relaxed) {
                publish(id(n)).await;
                if n >= 30 && copy(n - 30) {
                    publish(id(n - 30)).await;
                }
                n += 1;
                tokio::time::sleep(pace).await;
            }
            for i in n.saturating_sub(30)..n {
                if copy(i) {
                    publish(id(i)).await;
                }
            }
            for (publisher, _) in publishers {
                if let Publisher::Amqp(p, _) = publisher {
                    p.close().await;
                }
            }
            (0..n).map(id).collect::<Vec<String>>()
        }
    });

    // The nemesis: a fault every second or so, in the schedule's order, until the time is up
    // and every round has struck whole.
    let (kinds, left_out) = fault_kinds(relays.has_proxies(), &store);
    if std::env::var("CI").as_deref() == Ok("true")
        && std::env::var_os("IDEM_FAULTS_STORE").is_none()
    {
        assert!(left_out.is_empty(), "{left_out:?}");
    }
    notes.extend(left_out);
    let mut schedule = Schedule::new(kinds);
    notes.push(format!(
        "nemesis seed {} (IDEM_FAULTS_SEED replays it)",
        schedule.seed
    ));
    let started = Instant::now();
    while started.elapsed() < length || !schedule.rounds_done() {
        std::thread::sleep(Duration::from_millis(500 + schedule.dice.below(1000)));
        let victim = schedule.dice.pick(relays.relays.len());
        let fault = schedule.next();
        for s in &sources {
            s.history.push(Event::Relay(RelayEvent::Fault {
                fault: fault.to_owned(),
                relay: victim,
            }));
        }
        strike(&mut relays, &mut store, fault, victim);
    }
    striking.store(false, Ordering::Relaxed);
    let ids = rt.block_on(published).unwrap();

    // Drained: every id has its effect or a dead letter at every source, and the brokers have
    // nothing left to deliver; then the relays stop, and what a broker still holds was never
    // acked.
    let draining = Instant::now();
    let drained = |s: &Source<'_>| {
        let done = by_message_id(s.ledger.entries()).counted.len();
        let dead = rt.block_on(s.broker.dead_letters_count());
        done + dead >= ids.len() && rt.block_on(s.broker.unsettled()) == 0
    };
    while draining.elapsed() < PATIENCE && !sources.iter().all(drained) {
        std::thread::sleep(Duration::from_millis(250));
    }
    notes.push(format!(
        "drained {:.1} s after the nemesis ended",
        draining.elapsed().as_secs_f64()
    ));
    let stopping = Instant::now();
    relays.stop();
    notes.push(format!(
        "the relays stopped in {:.1} s",
        stopping.elapsed().as_secs_f64()
    ));
    let mut runs = Vec::new();
    let mut keep = false;
    for (i, s) in sources.iter().enumerate() {
        let drained = Drained {
            left: rt.block_on(s.broker.unsettled()),
            dead: rt.block_on(s.broker.dead_letters()),
        };
        rt.block_on(s.broker.delete());
        if let Ok(path) = std::env::var("IDEM_FAULTS_HISTORY") {
            s.history.save(&format!(
                "{path}.relay-{}-{i}.{}",
                s.broker.name(),
                store.kind()
            ));
        }
        let mut report = check_relay(&s.history, &by_message_id(s.ledger.entries()), &drained);
        report.violations.extend(rt.block_on(acked_without_record(
            &store.url(),
            s.broker,
            &ids,
            &drained,
        )));
        keep |= !report.violations.is_empty();
        runs.push(Ran {
            source: s.broker.describe(),
            report,
            notes: if i == 0 {
                std::mem::take(&mut notes)
            } else {
                Vec::new()
            },
        });
    }
    if keep {
        let kept = dir.keep();
        runs[0]
            .notes
            .push(format!("the relays' logs are kept in {}", kept.display()));
    }
    runs
}
