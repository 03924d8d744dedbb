//! The AMQP adapter against a real RabbitMQ (skipped, with a note, when none answers; a
//! failure under `CI=true`).

#![cfg(feature = "amqp")]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{MemoryStore, PostgresOptions, PostgresStore};

use futures_util::future::BoxFuture;
use idem_mq::amqp::lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use idem_mq::amqp::lapin::types::FieldTable;
use idem_mq::amqp::lapin::{Connection, ConnectionProperties};
use idem_mq::amqp::{ATTEMPT_HEADER, AmqpPublisher, AmqpSource, BasicProperties, QueueType};
use idem_mq::inbox::{Inbox, InboxFn, inbox_fn};
use idem_mq::{Consumer, DeadLetter, Delivery, Disposition, Failure, Message, Reason, Source};
use idem_testkit::services::{POSTGRES, RABBITMQ};
use idem_testkit::{PATIENCE, within};

fn unique(prefix: &str) -> String {
    format!("idem-test-{prefix}-{:016x}", rand::random::<u64>())
}

/// Deletes the queue's topology when the test ends, even by a panic.
struct Cleanup {
    url: String,
    queue: String,
    /// PostgreSQL tables to drop too, with the database's URL.
    tables: Option<(String, Vec<String>)>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some((pg, tables)) = self.tables.take() {
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async {
                    let Ok(pool) = sqlx::PgPool::connect(&pg).await else {
                        return;
                    };
                    for table in tables {
                        let sql = format!("DROP TABLE IF EXISTS {table}");
                        let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
                    }
                });
            })
            .join();
        }
        let (url, queue) = (self.url.clone(), self.queue.clone());
        // A fresh runtime on a fresh thread: the test's runtime may be gone or busy.
        let deleted = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async { AmqpSource::delete_topology(&url, &queue).await })
        })
        .join();
        if let Ok(Err(e)) = deleted {
            eprintln!("cleanup: {e}");
        }
    }
}

async fn next<S: Source>(source: &mut S) -> S::Delivery {
    within("a delivery", async {
        loop {
            match source.next().await {
                Some(Ok(d)) => return d,
                Some(Err(e)) => eprintln!("source error (retrying): {e}"),
                None => panic!("source closed"),
            }
        }
    })
    .await
}

/// How many messages a queue holds (ready, not unacked).
async fn depth(url: &str, queue: &str) -> u32 {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare");
    let _ = conn.close(200, "OK".into()).await;
    q.message_count()
}

/// Takes one message off `queue` (waiting up to [`PATIENCE`] for one) and acks it.
async fn get_one(url: &str, queue: &str) -> idem_mq::amqp::lapin::message::BasicGetMessage {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .expect("basic.get")
        {
            m.delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .expect("ack");
            let _ = conn.close(200, "OK".into()).await;
            return m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no message on {queue} within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn header_text(props: &BasicProperties, name: &str) -> Option<String> {
    use idem_mq::amqp::lapin::types::AMQPValue;
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}

async fn setup(prefix: &str, queue_type: QueueType) -> Option<(String, String, Cleanup)> {
    let url = RABBITMQ.url()?;
    let queue = unique(prefix);
    let cleanup = Cleanup {
        url: url.clone(),
        queue: queue.clone(),
        tables: None,
    };
    let _ = queue_type;
    Some((url, queue, cleanup))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_message_is_delivered_with_its_key_and_acked() {
    let Some((url, queue, _cleanup)) = setup("ack", QueueType::Quorum).await else {
        return;
    };
    let mut source = AmqpSource::connect(&url, &queue).await.expect("source");
    assert_eq!(source.name(), queue);
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    let props = BasicProperties::default().with_headers({
        let mut h = FieldTable::default();
        h.insert(
            "tenant".into(),
            idem_mq::amqp::lapin::types::AMQPValue::LongString("t-7".into()),
        );
        h.insert(
            "n".into(),
            idem_mq::amqp::lapin::types::AMQPValue::LongInt(42),
        );
        h
    });
    publisher
        .publish_once("", &queue, "order-1", b"hello", props)
        .await
        .expect("publish");

    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("order-1"));
    assert_eq!(d.payload(), b"hello");
    assert_eq!(d.header("tenant").as_deref(), Some("t-7"));
    assert_eq!(d.header("n").as_deref(), Some("42"));
    assert_eq!(d.header("absent"), None);
    assert_eq!(d.delivery_count(), Some(1));
    assert_eq!(d.properties().delivery_mode(), &Some(2));
    d.settle(Disposition::Ack).await.expect("ack");
    source.close().await;
    assert!(source.next().await.is_none(), "a closed source ends");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0, "the acked message is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_once_refuses_an_invalid_key_and_an_unroutable_message() {
    let Some(url) = RABBITMQ.url() else { return };
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    let err = publisher
        .publish_once("", "whatever", "", b"x", BasicProperties::default())
        .await
        .expect_err("empty key");
    assert!(matches!(err, idem_mq::MqError::Config(_)), "{err}");
    let err = publisher
        .publish_once(
            "",
            &unique("nowhere"),
            "k-1",
            b"x",
            BasicProperties::default(),
        )
        .await
        .expect_err("no queue takes it");
    assert!(matches!(err, idem_mq::MqError::Broker { .. }), "{err}");
}

async fn requeue_counts(queue_type: QueueType) {
    let Some((url, queue, _cleanup)) = setup("requeue", queue_type).await else {
        return;
    };
    let mut source = AmqpSource::builder(&url, &queue)
        .queue_type(queue_type)
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-requeue", b"body", BasicProperties::default())
        .await
        .expect("publish");

    let d = next(&mut source).await;
    assert_eq!(d.delivery_count(), Some(1));
    d.settle(Disposition::Requeue {
        delay: Duration::ZERO,
    })
    .await
    .expect("requeue now");

    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("k-requeue"));
    assert_eq!(d.payload(), b"body");
    assert_eq!(d.header(ATTEMPT_HEADER).as_deref(), Some("1"));
    assert_eq!(d.delivery_count(), Some(2));
    let requeued_at = tokio::time::Instant::now();
    d.settle(Disposition::Requeue {
        delay: Duration::from_millis(300),
    })
    .await
    .expect("requeue with a delay");

    let d = next(&mut source).await;
    assert!(
        requeued_at.elapsed() >= Duration::from_millis(300),
        "the delayed copy waited its delay"
    );
    assert_eq!(d.delivery_count(), Some(3));
    assert_eq!(d.message_id(), Some("k-requeue"));
    d.settle(Disposition::Ack).await.expect("ack");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_counts_deliveries_on_a_quorum_queue() {
    requeue_counts(QueueType::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_counts_deliveries_on_a_classic_queue() {
    requeue_counts(QueueType::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_carries_the_reason() {
    let Some((url, queue, _cleanup)) = setup("dead", QueueType::Quorum).await else {
        return;
    };
    let mut source = AmqpSource::connect(&url, &queue).await.expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once(
            "",
            &queue,
            "k-poison",
            b"poison",
            BasicProperties::default(),
        )
        .await
        .expect("publish");
    let d = next(&mut source).await;
    d.settle(Disposition::DeadLetter(DeadLetter {
        reason: Reason::Permanent,
        detail: "out of stock".into(),
    }))
    .await
    .expect("dead-letter");
    let dead = get_one(&url, source.dead_letter_queue()).await;
    let props = &dead.delivery.properties;
    assert_eq!(
        header_text(props, "x-idem-reason").as_deref(),
        Some("permanent")
    );
    assert_eq!(
        header_text(props, "x-idem-detail").as_deref(),
        Some("out of stock")
    );
    assert_eq!(
        props.message_id().as_ref().map(|m| m.as_str()),
        Some("k-poison")
    );
    assert_eq!(dead.delivery.data, b"poison");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0, "the original was acked");
}

async fn unsettled_delivery_comes_back(queue_type: QueueType) -> Option<u32> {
    let (url, queue, _cleanup) = setup("lost", queue_type).await?;
    let source = || {
        AmqpSource::builder(&url, &queue)
            .queue_type(queue_type)
            .connect()
    };
    let mut first = source().await.expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-lost", b"x", BasicProperties::default())
        .await
        .expect("publish");
    let d = next(&mut first).await;
    assert_eq!(d.delivery_count(), Some(1));
    first.shutdown().await;
    let err = d
        .settle(Disposition::Ack)
        .await
        .expect_err("the channel is gone");
    assert!(matches!(err, idem_mq::MqError::Broker { .. }), "{err}");

    let mut second = source().await.expect("source");
    let d = next(&mut second).await;
    assert_eq!(d.message_id(), Some("k-lost"));
    assert!(d.redelivered());
    let count = d.delivery_count();
    d.settle(Disposition::Ack).await.expect("ack");
    second.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0);
    count
}

/// A consumer task that is aborted (its source and deliveries dropped, no `shutdown`) must
/// not keep its connection, or the message it held would stay unacknowledged, delivered to
/// nobody, until the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_source_closes_its_connection_and_its_messages_come_back() {
    let Some((url, queue, _cleanup)) = setup("dropped", QueueType::Quorum).await else {
        return;
    };
    let mut first = AmqpSource::builder(&url, &queue)
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-dropped", b"x", BasicProperties::default())
        .await
        .expect("publish");
    let held = next(&mut first).await;
    drop(held);
    drop(first);
    let mut second = AmqpSource::builder(&url, &queue)
        .connect()
        .await
        .expect("source");
    let d = next(&mut second).await;
    assert_eq!(d.message_id(), Some("k-dropped"));
    d.settle(Disposition::Ack).await.expect("ack");
    second.shutdown().await;
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsettled_delivery_comes_back_counted_by_a_quorum_queue() {
    if RABBITMQ.url().is_none() {
        return;
    }
    assert_eq!(
        unsettled_delivery_comes_back(QueueType::Quorum).await,
        Some(2),
        "the quorum queue counted the return"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsettled_delivery_comes_back_uncounted_by_a_classic_queue() {
    if RABBITMQ.url().is_none() {
        return;
    }
    assert_eq!(
        unsettled_delivery_comes_back(QueueType::Classic).await,
        None,
        "a classic queue does not say how often it delivered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_source_hands_out_nothing_more_and_settles_what_it_handed_out() {
    let Some((url, queue, _cleanup)) = setup("close", QueueType::Quorum).await else {
        return;
    };
    let mut source = AmqpSource::builder(&url, &queue)
        .prefetch(1)
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    for key in ["k-1", "k-2"] {
        publisher
            .publish_once("", &queue, key, b"x", BasicProperties::default())
            .await
            .expect("publish");
    }
    let d = next(&mut source).await;
    source.close().await;
    assert!(source.next().await.is_none(), "a closed source ends");
    d.settle(Disposition::Ack)
        .await
        .expect("a delivery handed out before close can be acked");
    source.shutdown().await;
    assert_eq!(
        depth(&url, &queue).await,
        1,
        "the other message waits in the queue"
    );
}

/// Closes, on the broker's side, every connection whose client properties mention `name`
/// (`rabbitmqctl close_connection`). False when `rabbitmqctl` cannot be run.
fn kill_connections(name: &str) -> bool {
    let Ok(out) = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
    else {
        return false;
    };
    assert!(out.status.success(), "rabbitmqctl list_connections failed");
    let mut killed = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((pid, properties)) = line.split_once('\t') else {
            continue;
        };
        if !properties.contains(name) {
            continue;
        }
        let status = std::process::Command::new("rabbitmqctl")
            .args([
                "-q",
                "close_connection",
                pid,
                "closed by the idem test suite",
            ])
            .status()
            .expect("rabbitmqctl close_connection");
        assert!(status.success(), "rabbitmqctl close_connection failed");
        killed += 1;
    }
    assert!(killed > 0, "no connection named {name} at the broker");
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_reconnects_after_the_broker_closes_its_connection() {
    let Some((url, queue, _cleanup)) = setup("reconnect", QueueType::Quorum).await else {
        return;
    };
    let name = unique("conn");
    let mut source = AmqpSource::builder(&url, &queue)
        .connection_name(name.clone())
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-held", b"x", BasicProperties::default())
        .await
        .expect("publish");
    let held = next(&mut source).await;
    assert!(source.is_connected());
    if !kill_connections(&name) {
        eprintln!("rabbitmqctl cannot close connections here: reconnection test skipped");
        return;
    }
    publisher
        .publish_once("", &queue, "k-after", b"y", BasicProperties::default())
        .await
        .expect("publish");

    let mut seen = Vec::new();
    while seen.len() < 2 {
        let d = next(&mut source).await;
        seen.push(d.message_id().map(str::to_owned));
        d.settle(Disposition::Ack)
            .await
            .expect("ack on the new connection");
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![Some("k-after".to_owned()), Some("k-held".to_owned())],
        "the held message came back and the new one arrived"
    );
    assert!(source.is_connected());
    let err = held
        .settle(Disposition::Ack)
        .await
        .expect_err("a delivery of the lost channel cannot be settled");
    assert!(matches!(err, idem_mq::MqError::Broker { .. }), "{err}");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_options_are_declared_and_the_horizon_reported() {
    let Some((url, queue, _cleanup)) = setup("options", QueueType::Quorum).await else {
        return;
    };
    let source = AmqpSource::builder(&url, &queue)
        .delivery_limit(5)
        .consumer_timeout(Duration::from_secs(3600))
        .connect()
        .await
        .expect("a quorum queue with a delivery limit and a consumer timeout");
    assert_eq!(source.redelivery_horizon(), idem_mq::Horizon::Unbounded);
    source.shutdown().await;
    let source = AmqpSource::builder(&url, &queue)
        .delivery_limit(5)
        .consumer_timeout(Duration::from_secs(3600))
        .redelivery_horizon(Duration::from_secs(7200))
        .connect()
        .await
        .expect("declaring again with the same arguments");
    assert_eq!(
        source.redelivery_horizon(),
        idem_mq::Horizon::Bounded(Duration::from_secs(7200))
    );
    source.shutdown().await;
    let refused = AmqpSource::builder(&url, &queue)
        .queue_type(QueueType::Classic)
        .connect()
        .await
        .expect_err("an existing queue declared with other arguments");
    assert!(
        matches!(refused, idem_mq::MqError::Broker { .. }),
        "{refused}"
    );
}

// ---------------------------------------------------------------------------------------------
// The consumer engine over RabbitMQ.

/// Per key: how many handlers run it now, the most that ever did at once, and how many ran.
#[derive(Default)]
struct Tracker {
    keys: Mutex<HashMap<String, (u32, u32, u32)>>,
}

impl Tracker {
    fn enter(&self, key: &str) {
        let mut keys = self.keys.lock().expect("lock");
        let e = keys.entry(key.to_owned()).or_default();
        e.0 += 1;
        e.1 = e.1.max(e.0);
        e.2 += 1;
    }

    fn leave(&self, key: &str) {
        let mut keys = self.keys.lock().expect("lock");
        if let Some(e) = keys.get_mut(key) {
            e.0 -= 1;
        }
    }

    fn runs(&self) -> HashMap<String, u32> {
        let keys = self.keys.lock().expect("lock");
        keys.iter().map(|(k, v)| (k.clone(), v.2)).collect()
    }

    fn max_at_once(&self) -> u32 {
        let keys = self.keys.lock().expect("lock");
        keys.values().map(|v| v.1).max().unwrap_or(0)
    }
}

/// A shutdown future that completes once `done` holds (checked every 20 ms), or after 60 s,
/// then setting `timed_out`.
async fn when(done: impl Fn() -> bool + Send + 'static, timed_out: Arc<AtomicBool>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        if tokio::time::Instant::now() > deadline {
            timed_out.store(true, Ordering::SeqCst);
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_twice_run_once() {
    let Some((url, queue, _cleanup)) = setup("twice", QueueType::Quorum).await else {
        return;
    };
    const N: usize = 300;
    let source = AmqpSource::builder(&url, &queue)
        .prefetch(32)
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    let tracker = Arc::new(Tracker::default());
    let consumer = Consumer::new(MemoryStore::new())
        .concurrency(32)
        .wait_in_flight(Duration::from_secs(2))
        .backoff(Duration::from_millis(50), Duration::from_millis(500));
    let handler = {
        let tracker = tracker.clone();
        move |msg: Message| {
            let tracker = tracker.clone();
            async move {
                let id = msg.message_id.clone().expect("an id");
                tracker.enter(&id);
                tokio::time::sleep(Duration::from_millis(2)).await;
                tracker.leave(&id);
                Ok::<_, Failure<String>>(id)
            }
        }
    };
    // 30 % published twice back to back, 10 % again once the first copy was handled.
    let twice = |i: usize| i % 10 < 3;
    let late = |i: usize| i % 10 == 3;
    let mut published = 0u64;
    for i in 0..N {
        let copies = if twice(i) { 2 } else { 1 };
        for _ in 0..copies {
            publisher
                .publish_once(
                    "",
                    &queue,
                    &format!("m-{i}"),
                    b"x",
                    BasicProperties::default(),
                )
                .await
                .expect("publish");
            published += 1;
        }
    }
    let timed_out = Arc::new(AtomicBool::new(false));
    let total = published + (0..N).filter(|i| late(*i)).count() as u64;
    let run = {
        let consumer = consumer.clone();
        let counts = consumer.clone();
        let shutdown = when(
            move || {
                let c = counts.counts();
                c.handled + c.replayed >= total
            },
            timed_out.clone(),
        );
        tokio::spawn(async move { consumer.run(source, handler, shutdown).await })
    };
    wait_for("the first copies handled", || {
        let c = consumer.counts();
        c.handled + c.replayed >= published
    })
    .await;
    for i in (0..N).filter(|i| late(*i)) {
        publisher
            .publish_once(
                "",
                &queue,
                &format!("m-{i}"),
                b"x",
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }
    run.await.expect("join").expect("run");
    assert!(
        !timed_out.load(Ordering::SeqCst),
        "not every message was settled within 60 s"
    );

    let runs = tracker.runs();
    assert_eq!(runs.len(), N, "every id ran");
    let again: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(again.is_empty(), "ids that ran more than once: {again:?}");
    let c = consumer.counts();
    assert_eq!(c.handled, N as u64);
    assert_eq!(c.replayed, total - N as u64);
    assert_eq!(c.unsettled, 0);
    assert_eq!(c.dead_lettered, 0);
    assert_eq!(depth(&url, &queue).await, 0, "every message was acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_to_a_second_consumer_never_runs_beside_the_first() {
    let Some((url, queue, _cleanup)) = setup("beside", QueueType::Quorum).await else {
        return;
    };
    const N: usize = 20;
    let store = MemoryStore::new();
    let tracker = Arc::new(Tracker::default());
    let handler = {
        let tracker = tracker.clone();
        move |msg: Message| {
            let tracker = tracker.clone();
            async move {
                let id = msg.message_id.clone().expect("an id");
                tracker.enter(&id);
                tokio::time::sleep(Duration::from_millis(300)).await;
                tracker.leave(&id);
                Ok::<_, Failure<String>>(())
            }
        }
    };
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    // Two engines on one queue, sharing the records: the broker alternates deliveries between
    // them, so the two copies of an id go one to each.
    let consumers: Vec<_> = (0..2)
        .map(|_| {
            Consumer::new(store.clone())
                .concurrency(8)
                .wait_in_flight(Duration::from_millis(50))
                .backoff(Duration::from_millis(100), Duration::from_millis(400))
        })
        .collect();
    let mut runs = Vec::new();
    let timed_out = Arc::new(AtomicBool::new(false));
    let total = 2 * N as u64;
    for consumer in &consumers {
        let source = AmqpSource::builder(&url, &queue)
            .prefetch(8)
            .connect()
            .await
            .expect("source");
        let all = consumers.clone();
        let shutdown = when(
            move || {
                let settled: u64 = all
                    .iter()
                    .map(|c| c.counts().handled + c.counts().replayed)
                    .sum();
                settled >= total
            },
            timed_out.clone(),
        );
        let (consumer, handler) = (consumer.clone(), handler.clone());
        runs.push(tokio::spawn(async move {
            consumer.run(source, handler, shutdown).await
        }));
    }
    for i in 0..N {
        for _ in 0..2 {
            publisher
                .publish_once(
                    "",
                    &queue,
                    &format!("b-{i}"),
                    b"x",
                    BasicProperties::default(),
                )
                .await
                .expect("publish");
        }
    }
    for run in runs {
        run.await.expect("join").expect("run");
    }
    let counts: Vec<_> = consumers.iter().map(|c| c.counts()).collect();
    assert!(
        !timed_out.load(Ordering::SeqCst),
        "not every message was settled within 60 s: {counts:?}"
    );
    assert_eq!(tracker.max_at_once(), 1, "one key ran twice at once");
    let runs = tracker.runs();
    assert_eq!(runs.len(), N);
    assert!(runs.values().all(|n| *n == 1), "an id ran twice: {runs:?}");
    let requeued: u64 = consumers.iter().map(|c| c.counts().requeued).sum();
    assert!(
        requeued > 0,
        "no copy found its key held by the other consumer: the test did not test anything"
    );
    assert!(counts.iter().all(|c| c.dead_lettered == 0), "{counts:?}");
    assert_eq!(depth(&url, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_keyless_and_exhausted_messages_reach_the_dead_letter_with_the_reason() {
    let Some((url, queue, _cleanup)) = setup("poison", QueueType::Quorum).await else {
        return;
    };
    let source = AmqpSource::builder(&url, &queue)
        .connect()
        .await
        .expect("source");
    let dead_queue = source.dead_letter_queue().to_owned();
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    let flaky_runs = Arc::new(AtomicU64::new(0));
    let handler = {
        let flaky_runs = flaky_runs.clone();
        move |msg: Message| {
            let flaky_runs = flaky_runs.clone();
            async move {
                match msg.message_id.as_deref() {
                    Some("poison") => Err(Failure::Permanent("out of stock".to_owned())),
                    Some("flaky") => {
                        flaky_runs.fetch_add(1, Ordering::SeqCst);
                        Err(Failure::Retry("database down".to_owned()))
                    }
                    _ => Ok(()),
                }
            }
        }
    };
    let consumer = Consumer::new(MemoryStore::new())
        .max_attempts(3)
        .backoff(Duration::from_millis(50), Duration::from_millis(100));
    for key in ["poison", "flaky", "fine"] {
        publisher
            .publish_once("", &queue, key, b"x", BasicProperties::default())
            .await
            .expect("publish");
    }
    // No message id at all.
    publisher
        .channel()
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            Default::default(),
            b"keyless",
            BasicProperties::default(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    let timed_out = Arc::new(AtomicBool::new(false));
    let counts = consumer.clone();
    let shutdown = when(
        move || {
            let c = counts.counts();
            c.dead_lettered >= 3 && c.handled >= 1
        },
        timed_out.clone(),
    );
    consumer.run(source, handler, shutdown).await.expect("run");
    assert!(!timed_out.load(Ordering::SeqCst), "not settled within 60 s");
    assert_eq!(
        flaky_runs.load(Ordering::SeqCst),
        3,
        "the flaky message ran max_attempts times"
    );

    let mut reasons = HashMap::new();
    for _ in 0..3 {
        let dead = get_one(&url, &dead_queue).await;
        let props = &dead.delivery.properties;
        let id = props.message_id().as_ref().map(|m| m.as_str().to_owned());
        let reason = header_text(props, "x-idem-reason").expect("a reason header");
        assert!(header_text(props, "x-idem-detail").is_some_and(|d| !d.is_empty()));
        reasons.insert(id, reason);
    }
    let expected: HashMap<_, _> = [
        (Some("poison".to_owned()), "permanent".to_owned()),
        (Some("flaky".to_owned()), "attempts_exhausted".to_owned()),
        (None, "no_key".to_owned()),
    ]
    .into_iter()
    .collect();
    assert_eq!(reasons, expected);
    assert_eq!(
        depth(&url, &dead_queue).await,
        0,
        "nothing else was dead-lettered"
    );
    assert_eq!(depth(&url, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_runs_once_across_connections_closed_by_the_broker() {
    let Some((url, queue, _cleanup)) = setup("cut", QueueType::Quorum).await else {
        return;
    };
    const N: usize = 300;
    let name = unique("cut-conn");
    let source = AmqpSource::builder(&url, &queue)
        .prefetch(8)
        .connection_name(name.clone())
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    for i in 0..N {
        publisher
            .publish_once(
                "",
                &queue,
                &format!("c-{i}"),
                b"x",
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }
    // Cut k happens once a handler past CUT_AT[k] has started; such handlers hold (claimed,
    // not acked) until the cut is done, so every cut catches deliveries between claim and ack.
    const CUT_AT: [usize; 3] = [30, 130, 230];
    let tracker = Arc::new(Tracker::default());
    let started = Arc::new(AtomicUsize::new(0));
    let cuts = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (tracker, started, cuts) = (tracker.clone(), started.clone(), cuts.clone());
        move |msg: Message| {
            let (tracker, started, cuts) = (tracker.clone(), started.clone(), cuts.clone());
            async move {
                let id = msg.message_id.clone().expect("an id");
                tracker.enter(&id);
                let n = started.fetch_add(1, Ordering::SeqCst);
                while CUT_AT
                    .iter()
                    .enumerate()
                    .any(|(k, at)| n >= *at && cuts.load(Ordering::SeqCst) <= k)
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                tracker.leave(&id);
                Ok::<_, Failure<String>>(())
            }
        }
    };
    let consumer = Consumer::new(MemoryStore::new())
        .concurrency(8)
        .wait_in_flight(Duration::from_secs(1))
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let stop = Arc::new(AtomicBool::new(false));
    let timed_out = Arc::new(AtomicBool::new(false));
    let run = {
        let (consumer, handler, stop) = (consumer.clone(), handler.clone(), stop.clone());
        let shutdown = when(move || stop.load(Ordering::SeqCst), timed_out.clone());
        tokio::spawn(async move { consumer.run(source, handler, shutdown).await })
    };
    for (k, at) in CUT_AT.iter().enumerate() {
        wait_for("a handler waiting for the cut", || {
            started.load(Ordering::SeqCst) > *at
        })
        .await;
        if !kill_connections(&name) {
            eprintln!("rabbitmqctl cannot close connections here: test skipped");
            cuts.store(CUT_AT.len(), Ordering::SeqCst);
            stop.store(true, Ordering::SeqCst);
            return;
        }
        cuts.store(k + 1, Ordering::SeqCst);
    }
    wait_for("every message handled", || tracker.runs().len() >= N).await;
    stop.store(true, Ordering::SeqCst);
    run.await.expect("join").expect("run");
    // Deliveries the broker handed out when a connection closed come back: drain them with a
    // fresh source until the queue stays empty (their records make them replays).
    for _ in 0..5 {
        if depth(&url, &queue).await == 0 {
            break;
        }
        let source = AmqpSource::connect(&url, &queue).await.expect("source");
        let (c, h) = (consumer.clone(), handler.clone());
        let (u, q) = (url.clone(), queue.clone());
        let drained = Arc::new(AtomicBool::new(false));
        let flag = drained.clone();
        let watcher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            while depth(&u, &q).await != 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            flag.store(true, Ordering::SeqCst);
        });
        let shutdown = when(move || drained.load(Ordering::SeqCst), Arc::default());
        c.run(source, h, shutdown).await.expect("run");
        watcher.abort();
    }
    let runs = tracker.runs();
    assert_eq!(runs.len(), N);
    let again: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(again.is_empty(), "ids that ran more than once: {again:?}");
    assert_eq!(tracker.max_at_once(), 1);
    assert_eq!(depth(&url, &queue).await, 0, "every message was acked");
    // Each message was published once: a replay is a redelivery of a message whose ack a cut
    // lost, an unsettled delivery one whose ack a cut refused.
    let c = consumer.counts();
    assert_eq!(c.dead_lettered, 0, "{c:?}");
    assert!(
        c.unsettled + c.replayed > 0,
        "no cut caught a delivery between claim and ack: the test did not test anything ({c:?})"
    );
}

// ---------------------------------------------------------------------------------------------
// A consumer killed with SIGKILL and restarted, over hundreds of messages.

/// The child reads its task from this variable (JSON, a [`ChildTask`]).
const CHILD_ENV: &str = "IDEM_AMQP_KILL_CHILD";
const CHILD_LEASE: Duration = Duration::from_secs(1);

#[derive(serde::Serialize, serde::Deserialize)]
struct ChildTask {
    amqp: String,
    postgres: String,
    queue: String,
    /// The records table.
    records: String,
    /// One row per run of a handler, written outside any transaction.
    runs: String,
    /// Inbox mode: one row per committed effect, written in the inbox transaction. `None`
    /// for plain mode.
    effects: Option<String>,
}

type PgInboxFn = InboxFn<
    Box<
        dyn for<'t> Fn(
                &'t mut sqlx::Transaction<'static, sqlx::Postgres>,
                Message,
            ) -> BoxFuture<'t, Result<(), Failure<String>>>
            + Send
            + Sync,
    >,
>;

/// Records the start of a run: (id, fence, start, the lease's first expiry, pid).
async fn record_run(pool: &sqlx::PgPool, runs: &str, msg: &Message) -> Result<(), Failure<String>> {
    let lease = msg.lease.expect("a lease");
    let started = idem_core::Timestamp::now().as_millis();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {runs} (id, fence, started_ms, expires_ms, pid) VALUES ($1, $2, $3, $4, $5)"
    )))
    .bind(msg.message_id.clone().expect("an id"))
    .bind(i64::try_from(lease.fence).expect("fence"))
    .bind(i64::try_from(started).expect("ms"))
    .bind(i64::try_from(lease.expires_at.as_millis()).expect("ms"))
    .bind(i32::try_from(std::process::id()).expect("pid"))
    .execute(pool)
    .await
    .map(|_| ())
    .map_err(|e| Failure::Retry(e.to_string()))
}

async fn some_work() {
    tokio::time::sleep(Duration::from_millis(50 + rand::random::<u64>() % 100)).await;
}

/// The consumer the kill tests start, kill and start again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of the kill tests"]
async fn kill_child() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let task: ChildTask = serde_json::from_str(&task).expect("task");
    let store = PostgresStore::connect_with(
        &task.postgres,
        PostgresOptions {
            table: task.records.clone(),
            ..PostgresOptions::default()
        },
    )
    .await
    .expect("store");
    let pool = sqlx::PgPool::connect(&task.postgres).await.expect("pool");
    // Crash-loop protection is not under test: each kill returns the deliveries in flight,
    // and each wait for a lease left by a killed run requeues, both counting as deliveries.
    let consumer = Consumer::new(store.clone())
        .max_attempts(1000)
        .lease(CHILD_LEASE)
        .concurrency(8)
        .wait_in_flight(Duration::from_millis(200))
        .backoff(Duration::from_millis(100), Duration::from_millis(500));
    let source = AmqpSource::builder(&task.amqp, &task.queue)
        .prefetch(8)
        .connect()
        .await
        .expect("source");
    let runs = task.runs.clone();
    match task.effects {
        None => {
            let handler = move |msg: Message| {
                let (pool, runs) = (pool.clone(), runs.clone());
                async move {
                    record_run(&pool, &runs, &msg).await?;
                    some_work().await;
                    Ok::<_, Failure<String>>(())
                }
            };
            consumer
                .run(source, handler, std::future::pending())
                .await
                .expect("run");
        }
        Some(effects) => {
            let handler: PgInboxFn = inbox_fn(Box::new(
                move |tx: &mut sqlx::Transaction<'static, sqlx::Postgres>, msg: Message| {
                    let (pool, runs, effects) = (pool.clone(), runs.clone(), effects.clone());
                    Box::pin(async move {
                        record_run(&pool, &runs, &msg).await?;
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO {effects} (id, fence) VALUES ($1, $2)"
                        )))
                        .bind(msg.message_id.clone().expect("an id"))
                        .bind(i64::try_from(msg.fence().expect("a fence")).expect("fence"))
                        .execute(&mut **tx)
                        .await
                        .map_err(|e| Failure::Retry(e.to_string()))?;
                        // Killed here, the effect above rolls back with the record.
                        some_work().await;
                        Ok(())
                    })
                },
            ));
            consumer
                .run(source, Inbox::new(store, handler), std::future::pending())
                .await
                .expect("run");
        }
    }
}

fn spawn_child(task: &ChildTask) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "kill_child", "--nocapture", "--ignored"])
        .env(CHILD_ENV, serde_json::to_string(task).expect("json"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the child consumer")
}

fn kill(mut child: std::process::Child) {
    // SIGKILL: no destructor runs, no connection is closed, nothing is settled.
    let _ = child.kill();
    let _ = child.wait();
}

async fn count(pool: &sqlx::PgPool, sql: String) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Publishes `N` messages, then starts a child consumer and kills it at a random moment eight
/// times, then lets one run until every id ran and the queue is empty (killing it too, and
/// starting another if its unacked deliveries came back). Returns the task (tables to check)
/// and the pool, or `None` if a service is missing.
async fn kill_and_restart(
    prefix: &str,
    inbox: bool,
    n: i64,
) -> Option<(ChildTask, sqlx::PgPool, Cleanup)> {
    let (url, queue, mut cleanup) = setup(prefix, QueueType::Quorum).await?;
    let pg = POSTGRES.url()?;
    let suffix = format!("{:012x}", rand::random::<u64>() >> 16);
    let task = ChildTask {
        amqp: url.clone(),
        postgres: pg.clone(),
        queue: queue.clone(),
        records: format!("idem_amqp_{prefix}_records_{suffix}"),
        runs: format!("idem_amqp_{prefix}_runs_{suffix}"),
        effects: inbox.then(|| format!("idem_amqp_{prefix}_effects_{suffix}")),
    };
    // Dropped at the end, or when an assertion fails.
    let companions = ["counters", "locks", "migrations"].map(|t| format!("{}_{t}", task.records));
    let tables = [Some(&task.runs), Some(&task.records), task.effects.as_ref()];
    cleanup.tables = Some((
        pg.clone(),
        tables
            .into_iter()
            .flatten()
            .chain(&companions)
            .cloned()
            .collect(),
    ));
    let pool = sqlx::PgPool::connect(&pg).await.expect("pool");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (id text NOT NULL, fence bigint NOT NULL, started_ms bigint NOT NULL, \
         expires_ms bigint NOT NULL, pid int NOT NULL)",
        task.runs
    )))
    .execute(&pool)
    .await
    .expect("runs table");
    if let Some(effects) = &task.effects {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {effects} (id text NOT NULL, fence bigint NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("effects table");
    }
    // The queue must exist before the first publish.
    AmqpSource::connect(&url, &queue)
        .await
        .expect("declare")
        .shutdown()
        .await;
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    for i in 0..n {
        publisher
            .publish_once(
                "",
                &queue,
                &format!("k-{i}"),
                b"x",
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }
    let ran = || {
        count(
            &pool,
            format!("SELECT count(DISTINCT id) FROM {}", task.runs),
        )
    };

    for _ in 0..8 {
        let child = spawn_child(&task);
        tokio::time::sleep(Duration::from_millis(300 + rand::random::<u64>() % 700)).await;
        kill(child);
    }
    let mut empty = false;
    for _ in 0..10 {
        let child = spawn_child(&task);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while !(ran().await == n && depth(&url, &queue).await == 0) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "not done within 90 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Leave time for the settlements in flight, then kill this one too: what it had not
        // acked comes back to the queue.
        tokio::time::sleep(2 * CHILD_LEASE).await;
        kill(child);
        if depth(&url, &queue).await == 0 {
            empty = true;
            break;
        }
    }
    assert!(empty, "messages were left in the queue after 10 rounds");
    assert_eq!(
        depth(&url, &format!("{queue}.dead")).await,
        0,
        "nothing was dead-lettered"
    );
    Some((task, pool, cleanup))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_and_restarted_never_runs_an_id_twice_within_a_lease() {
    const N: i64 = 400;
    let Some((task, pool, _cleanup)) = kill_and_restart("kill", false, N).await else {
        return;
    };
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, fence, started_ms, expires_ms FROM {} ORDER BY id, fence",
        task.runs
    )))
    .fetch_all(&pool)
    .await
    .expect("runs");
    let mut by_id: HashMap<String, Vec<(i64, i64, i64)>> = HashMap::new();
    for (id, fence, started, expires) in rows {
        by_id.entry(id).or_default().push((fence, started, expires));
    }
    assert_eq!(i64::try_from(by_id.len()).ok(), Some(N), "every id ran");
    let mut again = 0;
    for (id, runs) in &by_id {
        for pair in runs.windows(2) {
            let ((f1, _, expires1), (f2, started2, _)) = (pair[0], pair[1]);
            assert!(f2 > f1, "{id}: two runs under one fence: {runs:?}");
            // The second run's claim came after the first lease ran out (the same clock: one
            // machine), and its start after its claim.
            assert!(
                started2 >= expires1,
                "{id}: a second run started within the first run's lease: {runs:?}"
            );
        }
        if runs.len() > 1 {
            again += 1;
        }
    }
    // Plain mode is at least once past the lease: a run killed before its result was stored
    // runs again once its lease has run out (never sooner, as asserted above).
    eprintln!("plain mode: {again} of {N} ids ran again after their lease ran out");
    assert!(
        again > 0,
        "no kill caught a handler between claim and ack: the test did not test anything"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_mode_consumer_killed_and_restarted_leaves_each_effect_exactly_once() {
    const N: i64 = 400;
    let Some((task, pool, _cleanup)) = kill_and_restart("inbox", true, N).await else {
        return;
    };
    let effects = task.effects.clone().expect("inbox mode");
    let total = count(&pool, format!("SELECT count(*) FROM {effects}")).await;
    let distinct = count(&pool, format!("SELECT count(DISTINCT id) FROM {effects}")).await;
    let runs = count(&pool, format!("SELECT count(*) FROM {}", task.runs)).await;
    assert_eq!(distinct, N, "every id has its effect");
    assert_eq!(total, N, "no id has two effects");
    assert!(
        runs > N,
        "no kill caught a handler between its write and its commit: the test did not test anything"
    );
    eprintln!("inbox mode: {runs} runs for {N} ids, one effect each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_whose_copy_is_refused_gives_the_original_back() {
    let Some((url, queue, _cleanup)) = setup("refused", QueueType::Quorum).await else {
        return;
    };
    let mut source = AmqpSource::connect(&url, &queue).await.expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-refused", b"x", BasicProperties::default())
        .await
        .expect("publish");
    // The first requeue declares the 100 ms delay queue.
    let d = next(&mut source).await;
    d.settle(Disposition::Requeue {
        delay: Duration::from_millis(50),
    })
    .await
    .expect("requeue");
    let d = next(&mut source).await;
    assert_eq!(d.delivery_count(), Some(2));
    // Without the delay queue the copy has nowhere to go: the broker returns it.
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(
        format!("{queue}.delay.100").as_str().into(),
        Default::default(),
    )
    .await
    .expect("delete the delay queue");
    let _ = conn.close(200, "OK".into()).await;
    let err = d
        .settle(Disposition::Requeue {
            delay: Duration::from_millis(50),
        })
        .await
        .expect_err("the copy was returned");
    assert!(matches!(err, idem_mq::MqError::Broker { .. }), "{err}");
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("k-refused"), "the original came back");
    assert!(d.redelivered());
    d.settle(Disposition::Ack).await.expect("ack");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0);
}
