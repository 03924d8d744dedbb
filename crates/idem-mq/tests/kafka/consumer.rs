//! Through the consumer: records produced twice, members joining and leaving, failures, a
//! store that fails.

use std::sync::Arc;
use std::time::Duration;

use idem_mq::kafka::{DETAIL_HEADER, OFFSET_HEADER, REASON_HEADER};
use idem_mq::{Consumer, Source};
use idem_testkit::{Op, PATIENCE};

use super::*;
use crate::runs::*;

/// Waits until `group` has committed `ends` (partition → next offset) on every partition.
async fn committed_to_the_end(topic: &Topic, group: &str, ends: &HashMap<i32, i64>) {
    let bound = std::time::Instant::now() + PATIENCE;
    loop {
        let now = topic
            .committed(group, i32::try_from(ends.len()).expect("few"))
            .await;
        if ends.iter().all(|(p, end)| now[p] == Some(*end)) {
            return;
        }
        assert!(
            std::time::Instant::now() < bound,
            "committed {now:?}, the partitions end at {ends:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_produced_twice_run_once_per_key_across_two_members() {
    let Some(broker) = tansu() else { return };
    const PARTITIONS: i32 = 4;
    const N: i32 = 120;
    let topic = Topic::new(broker, PARTITIONS).await;
    let mut ends: HashMap<i32, i64> = HashMap::new();
    let mut produced = 0u64;
    for i in 0..N {
        let key = format!("order-{i}");
        let p = i % 4;
        ends.insert(p, topic.produce(p, Some(&key), b"x").await + 1);
        produced += 1;
        if i % 10 < 3 {
            // The same key again, on another partition: another member may hold it.
            let q = (p + 1) % PARTITIONS;
            ends.insert(q, topic.produce(q, Some(&key), b"x").await + 1);
            produced += 1;
        }
    }
    let g = group("twice");
    let consumer = Consumer::new(idem::MemoryStore::new())
        .concurrency(8)
        .lease(LEASE);
    let runs = Arc::new(Runs::default());
    let (stop, shutdown) = shutdown_switch();
    let shutdown = futures_util::FutureExt::shared(Box::pin(shutdown));
    let mut members = Vec::new();
    for _ in 0..2 {
        let source = topic.source(&g).connect().await.expect("source");
        let (consumer, handler, shutdown) = (
            consumer.clone(),
            timed_handler(&runs, Duration::from_millis(5)),
            shutdown.clone(),
        );
        members.push(tokio::spawn(async move {
            consumer.run(source, handler, shutdown).await
        }));
    }
    until(PATIENCE * 2, "every record settled", || {
        let c = consumer.counts();
        c.handled + c.replayed >= produced
    })
    .await;
    committed_to_the_end(&topic, &g, &ends).await;
    stop.notify_waiters();
    for member in members {
        member.await.expect("task").expect("run");
    }
    for i in 0..N {
        assert_eq!(runs.of(&format!("order-{i}")), 1, "order-{i} ran once");
    }
    assert_eq!(
        *lock(&runs.most_at_once),
        1,
        "never two runs of one key at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_and_leaving_mid_run_never_runs_a_key_twice() {
    let Some(broker) = tansu() else { return };
    const PARTITIONS: i32 = 4;
    const N: i32 = 80;
    let topic = Topic::new(broker, PARTITIONS).await;
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for i in 0..N {
        let p = i % 4;
        ends.insert(p, topic.produce(p, Some(&format!("k{i}")), b"x").await + 1);
    }
    let g = group("rebalance");
    let consumer = Consumer::new(idem::MemoryStore::new())
        .concurrency(4)
        .lease(LEASE)
        .backoff(Duration::from_millis(50), Duration::from_millis(500));
    let runs = Arc::new(Runs::default());
    let handler = || timed_handler(&runs, Duration::from_millis(60));
    let (stop_a, shutdown_a) = shutdown_switch();
    let a = {
        let source = topic.source(&g).connect().await.expect("source");
        let (consumer, handler) = (consumer.clone(), handler());
        tokio::spawn(async move { consumer.run(source, handler, shutdown_a).await })
    };
    until(PATIENCE, "the first member under way", || {
        consumer.counts().handled >= 8
    })
    .await;
    // A second member joins: the group takes partitions from the first mid-record.
    let (stop_b, shutdown_b) = shutdown_switch();
    let b = {
        let source = topic.source(&g).connect().await.expect("source");
        let (consumer, handler) = (consumer.clone(), handler());
        tokio::spawn(async move { consumer.run(source, handler, shutdown_b).await })
    };
    until(PATIENCE, "both members under way", || {
        consumer.counts().handled >= 30
    })
    .await;
    // And the first leaves: its partitions go back to the second.
    stop_a.notify_one();
    a.await.expect("task").expect("run");
    until(PATIENCE * 2, "every key handled", || runs.ids() >= 80).await;
    committed_to_the_end(&topic, &g, &ends).await;
    stop_b.notify_one();
    b.await.expect("task").expect("run");
    for i in 0..N {
        assert_eq!(runs.of(&format!("k{i}")), 1, "k{i} ran once");
    }
    assert_eq!(
        *lock(&runs.most_at_once),
        1,
        "never two runs of one key at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_then_dead_lettered_with_their_reason() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 2).await;
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for (p, key, payload) in [
        (0, Some("poison-1"), &b"poison"[..]),
        (0, Some("flaky-1"), b"flaky"),
        (1, Some("once-flaky"), b"once"),
        (1, None, b"anonymous"),
        (1, Some("fine-1"), b"fine"),
    ] {
        ends.insert(p, topic.produce(p, key, payload).await + 1);
    }
    let g = group("dead");
    let source = topic.source(&g).connect().await.expect("source");
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
    committed_to_the_end(&topic, &g, &ends).await;
    stop.notify_one();
    run.await.expect("task").expect("run");

    let dead = topic.dead_letters(3).await;
    let reason_of = |key: Option<&str>| {
        dead.iter()
            .find(|(k, _)| k.as_deref() == key)
            .map(|(_, h)| h[REASON_HEADER].clone())
    };
    assert_eq!(dead.len(), 3, "poison, keyless, exhausted");
    assert_eq!(reason_of(Some("poison-1")).as_deref(), Some("permanent"));
    assert_eq!(
        reason_of(Some("flaky-1")).as_deref(),
        Some("attempts_exhausted")
    );
    assert_eq!(reason_of(None).as_deref(), Some("no_key"));
    let poison = &dead
        .iter()
        .find(|(k, _)| k.as_deref() == Some("poison-1"))
        .expect("poison")
        .1;
    assert!(
        poison[DETAIL_HEADER].contains("malformed order"),
        "{poison:?}"
    );
    assert_eq!(poison[OFFSET_HEADER], "0");
    assert_eq!(runs.of("poison-1"), 1, "a permanent failure runs once");
    assert_eq!(runs.of("flaky-1"), 3, "retried up to max_attempts");
    assert_eq!(runs.of("once-flaky"), 2);
    assert_eq!(runs.of("fine-1"), 1);
}

/// A record whose store fails `op` is kept and its partition not committed past it, then
/// handled when the store is back.
async fn a_failing_store_holds_the_record(op: Op, times: usize, ran_first: u32) {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 1).await;
    topic.produce(0, Some("m1"), b"x").await;
    let g = group("store");
    let mut source = topic.source(&g).connect().await.expect("source");
    let held = async || {
        source_commit_stays(&topic, &g).await;
    };
    store_failure_requeues(&mut source, "m1", (op, times), ran_first, held).await;
    source.commit().await.expect("commit");
    assert_eq!(topic.committed(&g, 1).await[&0], Some(1), "done at last");
}

/// The group's position has not passed the first record (after the source's commit timer had
/// time to run).
async fn source_commit_stays(topic: &Topic, group: &str) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let at = topic.committed(group, 1).await[&0];
    assert!(
        at.is_none_or(|at| at == 0),
        "committed past a record not done: {at:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_cannot_take_is_not_committed() {
    a_failing_store_holds_the_record(Op::Complete, 3, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_store_cannot_take_is_not_committed() {
    a_failing_store_holds_the_record(Op::Begin, 1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_is_named_by_group_and_topic() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 1).await;
    let source = topic.source("orders-svc").connect().await.expect("source");
    assert_eq!(
        source.identity().namespace().as_str(),
        format!("kafka:orders-svc:{}", topic.name)
    );
}
