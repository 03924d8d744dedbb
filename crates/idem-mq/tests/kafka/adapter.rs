//! The source alone: offsets, order, retries, restarts, bad settings.

use std::time::Duration;

use idem_mq::kafka::Order;
use idem_mq::{Delivery, Disposition, Source};

use super::*;
use crate::runs::next;

fn ack() -> Disposition {
    Disposition::Ack
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_stops_at_the_first_record_not_done() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 1).await;
    for key in ["a", "b", "c"] {
        topic.produce(0, Some(key), key.as_bytes()).await;
    }
    let g = group("prefix");
    let mut source = topic
        .source(&g)
        .order(Order::Key)
        .connect()
        .await
        .expect("source");
    let a = next(&mut source).await;
    let b = next(&mut source).await;
    let c = next(&mut source).await;
    assert_eq!(
        [a.message_id(), b.message_id(), c.message_id()],
        [Some("a"), Some("b"), Some("c")]
    );
    b.settle(ack()).await.expect("ack");
    c.settle(ack()).await.expect("ack");
    source.commit().await.expect("commit");
    let committed = topic.committed(&g, 1).await[&0];
    assert!(
        committed.is_none_or(|at| at == 0),
        "a still runs: the commit must not pass it, got {committed:?}"
    );
    a.settle(ack()).await.expect("ack");
    source.commit().await.expect("commit");
    assert_eq!(topic.committed(&g, 1).await[&0], Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_holds_its_partition_and_lets_the_others_run() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 2).await;
    topic.produce(0, Some("p0-first"), b"x").await;
    topic.produce(0, Some("p0-second"), b"x").await;
    topic.produce(1, Some("p1-first"), b"x").await;
    topic.produce(1, Some("p1-second"), b"x").await;
    let mut source = topic
        .source(&group("retry"))
        .connect()
        .await
        .expect("source");
    let mut firsts = vec![next(&mut source).await, next(&mut source).await];
    firsts.sort_by_key(|d| d.partition());
    let [p0, p1] = <[_; 2]>::try_from(firsts).expect("two");
    assert_eq!(
        (p0.message_id(), p1.message_id()),
        (Some("p0-first"), Some("p1-first")),
        "one record of each partition at a time"
    );
    p0.settle(Disposition::Requeue {
        delay: Duration::from_secs(2),
    })
    .await
    .expect("requeue");
    p1.settle(ack()).await.expect("ack");
    let d = next(&mut source).await;
    assert_eq!(
        d.message_id(),
        Some("p1-second"),
        "the other partition goes on"
    );
    d.settle(ack()).await.expect("ack");
    let waiting = tokio::time::timeout(Duration::from_millis(700), source.next()).await;
    assert!(
        waiting.is_err(),
        "p0-second waits behind the retried p0-first"
    );
    let again = next(&mut source).await;
    assert_eq!(again.message_id(), Some("p0-first"));
    assert_eq!(again.delivery_count(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_member_resumes_at_the_committed_offset() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 1).await;
    for i in 0..6 {
        topic.produce(0, Some(&format!("r{i}")), b"x").await;
    }
    let g = group("resume");
    {
        let mut first = topic.source(&g).connect().await.expect("source");
        for i in 0..3 {
            let d = next(&mut first).await;
            assert_eq!(d.message_id(), Some(format!("r{i}").as_str()));
            d.settle(ack()).await.expect("ack");
        }
        first.close().await;
        // Dropped: the last commit, then the group hears the member leave.
    }
    assert_eq!(topic.committed(&g, 1).await[&0], Some(3));
    let mut second = topic.source(&g).connect().await.expect("source");
    let d = next(&mut second).await;
    assert_eq!(
        d.message_id(),
        Some("r3"),
        "resumed where the first left off"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_dropped_unsettled_is_handed_out_again() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 1).await;
    topic.produce(0, Some("only"), b"x").await;
    let mut source = topic
        .source(&group("drop"))
        .connect()
        .await
        .expect("source");
    let d = next(&mut source).await;
    drop(d);
    let again = next(&mut source).await;
    assert_eq!(
        (again.message_id(), again.delivery_count()),
        (Some("only"), Some(2))
    );
}

#[tokio::test]
async fn an_unreachable_broker_is_a_clear_error_at_start() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        l.local_addr().expect("addr").port()
    };
    let err = KafkaSource::builder(format!("127.0.0.1:{port}"), "g", "t")
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect_err("nothing listens there");
    assert!(
        err.to_string().contains("cannot reach the Kafka brokers"),
        "{err}"
    );
    let err = KafkaSource::builder("127.0.0.1:1", "", "t")
        .connect()
        .await
        .expect_err("no group");
    assert!(err.to_string().contains("needs a group"), "{err}");
}

/// A partition paused because it held too much, then revoked and given back in a rebalance,
/// is fetched again: librdkafka keeps a pause across an assignment, the book does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_paused_then_given_back_in_a_rebalance_is_fetched_again() {
    let Some(broker) = tansu() else { return };
    let topic = Topic::new(broker, 2).await;
    for i in 0..6 {
        for p in 0..2 {
            topic.produce(p, Some(&format!("p{p}-{i}")), b"x").await;
        }
    }
    let g = group("paused");
    let mut first = topic
        .source(&g)
        .max_held(2)
        .connect()
        .await
        .expect("source");
    // The first record of each partition, then nothing more taken: both partitions fill up
    // and are paused.
    let held = vec![next(&mut first).await, next(&mut first).await];
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A second member joins: the group revokes both partitions and gives one back.
    let mut second = topic.source(&g).connect().await.expect("source");
    let joined = tokio::spawn(async move {
        let d = next(&mut second).await;
        (d.partition(), second)
    });
    let (theirs, _second) = joined.await.expect("task");
    drop(held);
    let mine = 1 - theirs;
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 6 {
        let d = next(&mut first).await;
        assert_eq!(d.partition(), mine, "only the partition given back");
        seen.insert(d.message_id().map(str::to_owned));
        d.settle(ack()).await.expect("ack");
    }
}
