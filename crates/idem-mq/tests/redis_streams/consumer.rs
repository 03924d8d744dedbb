//! Through the consumer: entries published twice, two instances on one group, failures.

use std::sync::Arc;

use super::*;
use crate::runs::*;
use idem::RedisStore;
use idem_mq::Consumer;
use idem_mq::redis_streams::{DETAIL_FIELD, REASON_FIELD};
use idem_testkit::{Op, PATIENCE};

async fn store(url: &str) -> RedisStore {
    let prefix = format!("idemt:{:08x}:", rand::random::<u32>());
    RedisStore::connect(
        url,
        idem::RedisOptions {
            prefix,
            ..Default::default()
        },
    )
    .await
    .expect("the Redis store")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_published_twice_run_once_per_id_across_two_instances() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    const N: usize = 300;
    let twice: Vec<usize> = (0..N).filter(|i| i % 10 < 3).collect();
    for i in 0..N {
        stream
            .publish(&format!("order-{i}"), i.to_string().as_bytes())
            .await;
    }
    for &i in &twice {
        stream
            .publish(&format!("order-{i}"), i.to_string().as_bytes())
            .await;
    }
    let store = store(&url).await;
    let consumer = Consumer::new(store).concurrency(16);
    let runs = Arc::new(Runs::default());
    let (stop, shutdown) = shutdown_switch();
    let shutdown = futures_util::FutureExt::shared(Box::pin(shutdown));
    let mut instances = Vec::new();
    for _ in 0..2 {
        let source = stream
            .builder("once")
            .batch(16)
            .connect(&url)
            .await
            .expect("source");
        let (consumer, handler, shutdown) = (
            consumer.clone(),
            timed_handler(&runs, Duration::from_millis(2)),
            shutdown.clone(),
        );
        instances.push(tokio::spawn(async move {
            consumer.run(source, handler, shutdown).await
        }));
    }
    until(PATIENCE * 2, "every entry settled", || {
        let c = consumer.counts();
        c.handled + c.replayed >= (N + twice.len()) as u64
    })
    .await;
    stop.notify_waiters();
    for instance in instances {
        instance.await.expect("task").expect("run");
    }
    for i in 0..N {
        assert_eq!(runs.of(&format!("order-{i}")), 1, "order-{i} ran once");
    }
    assert_eq!(runs.ids(), N);
    let c = consumer.counts();
    assert_eq!(c.handled, N as u64);
    assert_eq!(c.replayed, twice.len() as u64, "{c:?}");
    assert_eq!(
        *lock(&runs.most_at_once),
        1,
        "never two runs of one id at once"
    );
    assert_eq!(stream.pending("once").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_then_dead_lettered_with_their_reason() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("poison-1", b"poison").await;
    stream.publish("flaky-1", b"flaky").await;
    stream.publish("once-flaky", b"once").await;
    stream.publish("fine-1", b"fine").await;
    let _: String = redis::cmd("XADD")
        .arg(&stream.name)
        .arg("*")
        .arg("payload")
        .arg("anonymous")
        .query_async(&mut stream.conn.clone())
        .await
        .expect("XADD");
    let source = stream
        .builder("dl")
        .claim_idle(Duration::from_secs(2))
        .claim_every(Duration::from_millis(20))
        .connect(&url)
        .await
        .expect("source");
    let consumer = Consumer::new(idem::MemoryStore::new())
        .max_attempts(3)
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let runs = Arc::new(Runs::default());
    let handler = failing_handler(&runs);
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(PATIENCE * 2, "three dead letters and two handled", || {
        let c = consumer.counts();
        c.dead_lettered >= 3 && c.handled >= 2
    })
    .await;
    stop.notify_one();
    run.await.expect("task").expect("run");

    let dead = stream.entries(&stream.dead()).await;
    let reason_of = |id: &str| {
        dead.iter()
            .find(|(_, f)| f.get("message_id").map(String::as_str) == Some(id))
            .map(|(_, f)| f[REASON_FIELD].clone())
    };
    assert_eq!(dead.len(), 3, "poison, keyless, exhausted: {dead:?}");
    assert_eq!(reason_of("poison-1").as_deref(), Some("permanent"));
    assert_eq!(reason_of("flaky-1").as_deref(), Some("attempts_exhausted"));
    let keyless = dead
        .iter()
        .find(|(_, f)| !f.contains_key("message_id"))
        .expect("the keyless entry");
    assert_eq!(keyless.1[REASON_FIELD], "no_key");
    assert_eq!(keyless.1["payload"], "anonymous");
    assert!(
        dead.iter()
            .any(|(_, f)| f[DETAIL_FIELD].contains("malformed order"))
    );
    assert_eq!(runs.of("poison-1"), 1);
    assert_eq!(
        runs.of("flaky-1"),
        3,
        "one run per attempt, up to max_attempts"
    );
    assert_eq!(runs.of("once-flaky"), 2, "requeued once, then handled");
    assert_eq!(runs.of("fine-1"), 1);
    assert_eq!(stream.pending("dl").await, 0);
}

/// Two streams whose names and groups join alike with a dot (`X.eu` with group `x`, `X` with
/// group `eu.x`), with the same message ids and payloads, on one store: each group runs every
/// one of its own entries, rather than acking them on the other's records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_whose_names_join_alike_never_share_records() {
    let Some(url) = redis_url() else { return };
    let base = format!("idemt:{:016x}:X", rand::random::<u64>());
    let pairs = [
        (Stream::named(&url, format!("{base}.eu")).await, "x"),
        (Stream::named(&url, base).await, "eu.x"),
    ];
    const N: usize = 5;
    let store = store(&url).await;
    for (stream, group) in &pairs {
        for i in 0..N {
            stream.publish(&format!("order-{i}"), b"{}").await;
        }
        let consumer = Consumer::new(store.clone());
        let runs = run_until_settled(&consumer, stream.source(group).await, N).await;
        assert_eq!(runs.ids(), N, "{} / {group} ran every entry", stream.name);
        assert_eq!(consumer.counts().replayed, 0, "{} / {group}", stream.name);
    }
}

/// One entry whose store fails `op` `times` in a row: requeued (still pending), claimed
/// again, then acked, leaving nothing pending (see [`store_failure_requeues`]).
async fn a_store_failure_requeues(op: Op, times: usize, ran_first: u32) {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("order-1", b"{}").await;
    let mut source = stream
        .builder("g")
        .claim_idle(Duration::from_secs(2))
        .claim_every(Duration::from_millis(20))
        .connect(&url)
        .await
        .expect("source");
    let pending = async || assert_eq!(stream.pending("g").await, 1, "still pending");
    store_failure_requeues(&mut source, "order-1", (op, times), ran_first, pending).await;
    assert_eq!(stream.pending("g").await, 0, "acked");
}

/// The store fails to take a handled message's result: the entry is requeued, never acked;
/// once the record's lease has ended, the redelivery runs it again and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_did_not_take_is_requeued_never_acked() {
    a_store_failure_requeues(Op::Complete, 3, 1).await;
}

/// The store fails the claim: nothing runs, the entry is requeued, and its redelivery runs
/// once and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_store_failed_runs_nothing_and_is_requeued() {
    a_store_failure_requeues(Op::Begin, 1, 0).await;
}
