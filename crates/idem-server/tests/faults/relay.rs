//! Real `idem relay` processes under the nemesis: two relays consume one queue (RabbitMQ), one
//! durable consumer of a stream (NATS JetStream) or one consumer group of a Redis stream of this
//! run's own, share one store, and
//! POST each message to the fenced ledger, which counts one effect per message id (the
//! relay's `Idempotency-Key`) and refuses an attempt whose `Idem-Fence` is lower than one it
//! took. A publisher publishes a fixed number of messages, three in ten of them twice; the
//! nemesis stops a relay past its lease, kills and restarts one, and restarts one with its
//! wall clock ahead. Once the broker has nothing left to deliver, the checker reads the
//! publisher's history with the ledger and the broker's dead letters: every message has its
//! effect once, none is lost, none is left unacked.
//!
//! Each backend runs when its broker answers (`IDEM_TEST_AMQP_URL`, `IDEM_TEST_NATS_URL`,
//! `IDEM_TEST_REDIS_URL`;
//! under `CI=true` a missing one fails). `IDEM_FAULTS_SECS` sets how long the nemesis runs
//! (half of it for each backend; the message count scales with it), `IDEM_FAULTS_STORE` the relays' store (as for the other
//! runs: by default a Redis of the run's own), `IDEM_FAULTS_HISTORY` a file to keep the history in (suffixed with the backend).

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idem_mq::amqp::lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use idem_mq::amqp::lapin::types::FieldTable;
use idem_mq::amqp::lapin::{Connection, ConnectionProperties};
use idem_mq::amqp::{AmqpPublisher, AmqpSource, BasicProperties};

use crate::check::{Drained, Event, History, RelayEvent, RelayReport, check_relay};
use crate::ledger::{Entries, Ledger};
use crate::{Dice, cluster, seconds};

/// Relays consuming at once.
const RELAYS: usize = 2;

/// Message ids published per second of `IDEM_FAULTS_SECS` (three in ten once more). Each
/// backend's nemesis runs half of it, so that the two relay runs together take about as long
/// as the gateways' run beside them on two cores.
const PER_SECOND: usize = 25;

/// How long the run may take to drain once the nemesis is done: bounded, so that a message
/// that never settles ends the run with a report instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(90);

/// The delay queues the AMQP source requeues through (idem-mq's `DELAY_BUCKETS_MS`, up to
/// the longest a requeue in this run can ask for): a message waiting in one is not settled.
const AMQP_DELAY_BUCKETS_MS: &[u64] = &[100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000];

#[test]
fn relays_stopped_killed_and_restarted_deliver_each_amqp_message_once() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let run = run_id();
    let broker = Broker::Amqp {
        url,
        queue: format!("faults-relay-{run}"),
    };
    let ran = relay_under_faults(&broker, &super::chosen_store());
    println!("{ran}");
    ran.assert_clean();
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
    let run = run_id();
    let broker = Broker::Amqp {
        url,
        queue: format!("faults-relay-valkey-{run}"),
    };
    let ran = relay_under_faults(&broker, "own-valkey");
    println!("{ran}");
    ran.assert_clean();
}

#[test]
fn relays_stopped_killed_and_restarted_deliver_each_jetstream_message_once() {
    let Some(url) = idem_testkit::services::NATS.url() else {
        return;
    };
    let run = run_id();
    let broker = Broker::Nats {
        url,
        stream: format!("FAULTS_RELAY_{run}"),
    };
    let ran = relay_under_faults(&broker, &super::chosen_store());
    println!("{ran}");
    ran.assert_clean();
}

/// A Redis stream read through one consumer group: a relay killed or stopped leaves its entries
/// pending, and the other claims them after twice the lease.
#[test]
fn relays_stopped_killed_and_restarted_deliver_each_redis_stream_entry_once() {
    let Some(url) = idem_testkit::services::REDIS.url() else {
        return;
    };
    let run = run_id();
    let broker = Broker::Redis {
        url,
        stream: format!("faults-relay:{run}"),
    };
    let ran = relay_under_faults(&broker, &super::chosen_store());
    println!("{ran}");
    ran.assert_clean();
}

/// A run's report, and what else it has to say.
struct Ran {
    broker: &'static str,
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
        write!(f, "relay over {}: {}", self.broker, self.report)
    }
}

/// A name of this run's own: the brokers and the store are shared.
fn run_id() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// Where the relays take messages from, a queue or a stream of this run's own.
enum Broker {
    Amqp { url: String, queue: String },
    Nats { url: String, stream: String },
    Redis { url: String, stream: String },
}

/// The consumer group the relays read a Redis stream through.
const GROUP: &str = "relay";

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
                "relay".into(),
            ],
            Broker::Redis { url, stream } => vec![
                "--from".into(),
                url.clone(),
                "--stream".into(),
                stream.clone(),
                "--group".into(),
                GROUP.into(),
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
                        durable_name: Some("relay".into()),
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
            Broker::Redis { url, stream } => {
                let mut conn = redis_conn(url).await;
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(stream)
                    .arg(GROUP)
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
                    .consumer_info("relay")
                    .await
                    .unwrap();
                info.num_pending + info.num_ack_pending as u64
            }
            Broker::Redis { url, stream } => {
                let mut conn = redis_conn(url).await;
                let groups: Vec<std::collections::HashMap<String, redis::Value>> =
                    redis::cmd("XINFO")
                        .arg("GROUPS")
                        .arg(stream)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                let group = groups
                    .iter()
                    .find(|g| g.get("name") == Some(&redis::Value::BulkString(GROUP.into())))
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
            Broker::Redis { url, stream } => redis::cmd("XLEN")
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
            Broker::Redis { url, stream } => {
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
            Broker::Redis { url, stream } => redis::cmd("DEL")
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

/// The relay processes, on one store, each writing its log to a file of the run's.
struct Relays {
    procs: Vec<Child>,
    args: Vec<String>,
    dir: std::path::PathBuf,
    started: usize,
    /// Kept for the run: a server of the run's own stops when dropped.
    _store: cluster::Store,
}

impl Relays {
    fn start(broker: &Broker, ledger: &str, dir: &std::path::Path, chosen: &str) -> Self {
        // The store `chosen` names (see `cluster::Store::named`), never restarted here.
        let store = cluster::Store::named(chosen, dir);
        let url = store.url();
        let mut args = vec!["relay".to_owned()];
        args.extend(broker.flags());
        args.extend(
            [
                "--to",
                &format!("http://{ledger}/pay"),
                "--store",
                &url,
                "--prefetch",
                "8",
                "--lease",
                &format!("{}s", cluster::LEASE.as_secs()),
                "--status-every",
                "1s",
            ]
            .map(str::to_owned),
        );
        let mut relays = Self {
            procs: Vec::new(),
            args,
            dir: dir.to_owned(),
            started: 0,
            _store: store,
        };
        for _ in 0..RELAYS {
            let child = relays.spawn(None);
            relays.procs.push(child);
        }
        relays
    }

    /// A relay, its wall clock `ahead` of the others' if given.
    fn spawn(&mut self, ahead: Option<Duration>) -> Child {
        self.started += 1;
        let log =
            std::fs::File::create(self.dir.join(format!("relay-{}.log", self.started))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(&self.args)
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
        self.procs[i].kill().unwrap();
        self.procs[i].wait().unwrap();
        self.procs[i] = self.spawn(ahead);
    }

    /// SIGTERM to each, and waits for it to drain and exit (killed if it does not).
    fn stop(&mut self) {
        for p in &self.procs {
            cluster::signal("-TERM", p.id());
        }
        let started = Instant::now();
        for p in &mut self.procs {
            while p.try_wait().unwrap().is_none() && started.elapsed() < PATIENCE {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
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

fn relay_under_faults(broker: &Broker, chosen: &str) -> Ran {
    let mut notes = Vec::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::start();
    let history = Arc::new(History::default());
    let secs = seconds();
    let length = Duration::from_secs(secs) / 2;
    let publisher = rt.block_on(broker.prepare());
    let mut relays = Relays::start(broker, &ledger.addr, dir.path(), chosen);

    // The publisher: every id once, spread over most of the run, and three in ten again some
    // thirty messages later (a publisher's retry, or a copy the broker delivered twice).
    let n = PER_SECOND * usize::try_from(secs).unwrap();
    let run = run_id();
    let ids: Vec<String> = (0..n).map(|i| format!("r{run}-m{i}")).collect();
    let mut order: Vec<&String> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        order.push(id);
        if i >= 30 && (i - 30) % 10 < 3 {
            order.push(&ids[i - 30]);
        }
    }
    order.extend(
        ids[n.saturating_sub(30)..]
            .iter()
            .enumerate()
            .filter_map(|(j, id)| ((n - 30 + j) % 10 < 3).then_some(id)),
    );
    let order: Vec<String> = order.into_iter().cloned().collect();
    let pace = length.mul_f64(0.8) / u32::try_from(order.len()).unwrap();
    let published = rt.spawn({
        let history = history.clone();
        async move {
            for id in order {
                if publisher.publish(&id).await {
                    history.push(Event::Relay(RelayEvent::Published { id }));
                }
                tokio::time::sleep(pace).await;
            }
            if let Publisher::Amqp(p, _) = publisher {
                p.close().await;
            }
        }
    });

    // The nemesis: a fault every second or so, each kind in turn.
    let kinds: &[&str] = if cluster::can_step_clocks() {
        &["pause", "kill", "clock"]
    } else {
        let note = "libfaketime is not installed (Debian's faketime): no clock steps";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{note}");
        notes.push(note.to_owned());
        &["pause", "kill"]
    };
    let started = Instant::now();
    let mut dice = Dice(11);
    let mut kind = 0;
    while started.elapsed() < length {
        std::thread::sleep(Duration::from_millis(500 + dice.below(1000)));
        let victim = dice.pick(RELAYS);
        let fault = kinds[kind % kinds.len()];
        history.push(Event::Relay(RelayEvent::Fault {
            fault: fault.to_owned(),
            relay: victim,
        }));
        match fault {
            // Past the lease: the other relay takes over the keys it held.
            "pause" => {
                let pid = relays.procs[victim].id();
                cluster::signal("-STOP", pid);
                std::thread::sleep(cluster::LEASE + Duration::from_millis(800));
                cluster::signal("-CONT", pid);
            }
            // Its wall clock a lease and a half ahead: it takes over leases the other still
            // holds, until a kill restarts it on the true time.
            "clock" => {
                relays.kill_and_restart(victim, Some(cluster::LEASE + Duration::from_secs(1)));
            }
            _ => relays.kill_and_restart(victim, None),
        }
        kind += 1;
    }
    rt.block_on(published).unwrap();

    // Drained: every id has its effect or a dead letter, and the broker has nothing left
    // to deliver; then the relays stop, and what the broker still holds was never acked.
    let want: HashSet<&String> = ids.iter().collect();
    let draining = Instant::now();
    while draining.elapsed() < PATIENCE {
        let done = by_message_id(ledger.entries()).counted.len();
        let dead = rt.block_on(broker.dead_letters_count());
        if done + dead >= want.len() && rt.block_on(broker.unsettled()) == 0 {
            break;
        }
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
    let drained = Drained {
        left: rt.block_on(broker.unsettled()),
        dead: rt.block_on(broker.dead_letters()),
    };
    rt.block_on(broker.delete());
    if let Ok(path) = std::env::var("IDEM_FAULTS_HISTORY") {
        history.save(&format!("{path}.relay-{}", broker.name()));
    }
    let report = check_relay(&history, &by_message_id(ledger.entries()), &drained);
    if !report.violations.is_empty() {
        let kept = dir.keep();
        notes.push(format!("the relays' logs are kept in {}", kept.display()));
    }
    Ran {
        broker: broker.name(),
        report,
        notes,
    }
}
