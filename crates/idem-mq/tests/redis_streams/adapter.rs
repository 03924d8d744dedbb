//! The source and its deliveries, one behaviour at a time.

use super::*;
use idem_mq::redis_streams::{
    DELIVERIES_FIELD, DETAIL_FIELD, DeadLetterTarget, ENTRY_FIELD, GROUP_FIELD, MessageIdFrom,
    REASON_FIELD, STREAM_FIELD, StartAt, publish_with_fields,
};
use idem_mq::{DeadLetter, Disposition, Horizon, MqError, Reason};
use tokio::time::Instant;

#[tokio::test]
async fn a_new_group_reads_the_backlog_with_fields_as_headers() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"one").await;
    publish_with_fields(
        &mut stream.conn.clone(),
        &stream.name,
        "m-2",
        b"two",
        &[
            ("order", b"o-7".as_slice()),
            ("bin", [0xff, 0xfe].as_slice()),
        ],
    )
    .await
    .expect("publish");

    let mut source = stream.source("g").await;
    assert_eq!(source.name(), format!("{}.g", stream.name));
    assert_eq!(source.redelivery_horizon(), Horizon::Unbounded);
    let first = next(&mut source).await;
    assert_eq!(first.message_id(), Some("m-1"));
    assert_eq!(first.payload(), b"one");
    assert_eq!(first.delivery_count(), Some(1));
    let second = next(&mut source).await;
    assert_eq!(second.message_id(), Some("m-2"));
    assert_eq!(second.payload(), b"two");
    assert_eq!(second.header("order").as_deref(), Some("o-7"));
    assert_eq!(
        second.header("bin"),
        None,
        "a field that is not text is no header"
    );
    assert_eq!(second.header("payload"), None, "the body is not a header");
    assert_eq!(stream.pending("g").await, 2);
    first.settle(Disposition::Ack).await.expect("ack");
    second.settle(Disposition::Ack).await.expect("ack");
    assert_eq!(
        stream.pending("g").await,
        0,
        "acked entries leave the pending list"
    );
}

#[tokio::test]
async fn a_group_made_at_the_end_skips_the_backlog() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("old", b"").await;
    let mut source = stream
        .builder("g")
        .start_at(StartAt::End)
        .connect(&url)
        .await
        .expect("source");
    stream.publish("new", b"").await;
    assert_eq!(id_of(&next(&mut source).await), "new");
}

#[tokio::test]
async fn the_body_field_and_the_message_id_are_configurable() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    let entry = publish_with_fields(
        &mut stream.conn.clone(),
        &stream.name,
        "m-1",
        b"ignored",
        &[("body", b"the body".as_slice())],
    )
    .await
    .expect("publish");
    let mut source = stream
        .builder("g")
        .payload_field("body")
        .message_id(MessageIdFrom::EntryId)
        .connect(&url)
        .await
        .expect("source");
    let d = next(&mut source).await;
    assert_eq!(d.payload(), b"the body");
    assert_eq!(d.message_id(), Some(entry.as_str()));
    assert_eq!(d.entry_id(), entry);
    assert_eq!(d.header("payload").as_deref(), Some("ignored"));
}

#[tokio::test]
async fn a_requeued_entry_comes_back_after_its_delay_counted_once_more() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"").await;
    let mut source = stream
        .builder("g")
        .claim_idle(Duration::from_secs(10))
        .claim_every(Duration::from_millis(50))
        .connect(&url)
        .await
        .expect("source");
    let first = next(&mut source).await;
    let entry = first.entry_id().to_owned();
    let delay = Duration::from_millis(400);
    let requeued_at = Instant::now();
    first
        .settle(Disposition::Requeue { delay })
        .await
        .expect("requeue");
    let again = next(&mut source).await;
    assert!(
        requeued_at.elapsed() >= delay - Duration::from_millis(20),
        "back after {:?}, before its delay",
        requeued_at.elapsed()
    );
    assert_eq!(again.entry_id(), entry);
    assert_eq!(again.delivery_count(), Some(2));
    assert_eq!(stream.pending("g").await, 1);
}

#[tokio::test]
async fn the_entries_of_a_consumer_that_stopped_are_claimed_after_the_idle_time() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"").await;
    let idle = Duration::from_millis(600);
    let mut dead = stream.builder("g").batch(1).connect(&url).await.expect("a");
    let taken = next(&mut dead).await;
    let read_at = Instant::now();
    // Its consumer dies: the delivery is never settled.
    drop(taken);
    drop(dead);
    let mut other = stream
        .builder("g")
        .claim_idle(idle)
        .claim_every(Duration::from_millis(50))
        .connect(&url)
        .await
        .expect("b");
    let claimed = next(&mut other).await;
    assert!(read_at.elapsed() >= idle, "claimed before the idle time");
    assert_eq!(id_of(&claimed), "m-1");
    assert_eq!(claimed.delivery_count(), Some(2));
    claimed.settle(Disposition::Ack).await.expect("ack");
    assert_eq!(stream.pending("g").await, 0);
}

/// Entries deleted or trimmed while pending are never delivered again: each is reported (and
/// counted) by the source that finds it gone, and the rest are still claimed.
#[tokio::test]
async fn entries_deleted_or_trimmed_while_pending_are_reported() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(stream.publish(&format!("m-{i}"), b"").await);
    }
    let mut dead = stream.builder("g").batch(3).connect(&url).await.expect("a");
    for _ in 0..3 {
        drop(next(&mut dead).await);
    }
    drop(dead);
    let mut conn = stream.conn.clone();
    let _: i64 = redis::cmd("XDEL")
        .arg(&stream.name)
        .arg(&ids[1])
        .query_async(&mut conn)
        .await
        .expect("XDEL");
    let _: i64 = redis::cmd("XTRIM")
        .arg(&stream.name)
        .arg("MINID")
        .arg(&ids[1])
        .query_async(&mut conn)
        .await
        .expect("XTRIM");
    let mut other = stream
        .builder("g")
        .claim_idle(Duration::from_millis(100))
        .claim_every(Duration::from_millis(50))
        .connect(&url)
        .await
        .expect("b");
    let claimed = next(&mut other).await;
    assert_eq!(id_of(&claimed), "m-2");
    claimed.settle(Disposition::Ack).await.expect("ack");
    assert_eq!(other.vanished(), 2, "the deleted and the trimmed entry");
    assert!(
        next_within(&mut other, Duration::from_millis(500))
            .await
            .is_none()
    );
    assert_eq!(stream.pending("g").await, 0);
}

#[tokio::test]
async fn progress_keeps_a_running_entry_from_being_claimed() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"").await;
    let idle = Duration::from_millis(500);
    let mut holder = stream
        .builder("g")
        .claim_idle(idle)
        .connect(&url)
        .await
        .expect("a");
    assert_eq!(
        holder.ack_wait(),
        Some(idle),
        "progress is reported within the idle time"
    );
    let running = next(&mut holder).await;
    let mut other = stream
        .builder("g")
        .claim_idle(idle)
        .claim_every(Duration::from_millis(50))
        .connect(&url)
        .await
        .expect("b");
    let watch = async {
        // Four idle times, with progress at a third of it.
        for _ in 0..12 {
            tokio::time::sleep(idle / 3).await;
            running.in_progress().await.expect("progress");
        }
    };
    let (stolen, ()) = tokio::join!(next_within(&mut other, idle * 4), watch);
    assert!(stolen.is_none(), "an entry in progress was claimed");
    // Without progress it is claimed, and counted.
    let claimed = next(&mut other).await;
    assert_eq!(claimed.delivery_count(), Some(2));
    // The first holder's late ack still settles it.
    running.settle(Disposition::Ack).await.expect("ack");
    assert_eq!(stream.pending("g").await, 0);
}

#[tokio::test]
async fn a_dead_letter_copies_the_fields_with_the_reason_then_acks() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    let entry = publish_with_fields(
        &mut stream.conn.clone(),
        &stream.name,
        "m-1",
        b"body",
        &[("order", b"o-7".as_slice())],
    )
    .await
    .expect("publish");
    let mut source = stream.source("g").await;
    assert_eq!(
        source.dead_letter_target(),
        &DeadLetterTarget::Stream(stream.dead())
    );
    let d = next(&mut source).await;
    d.settle(Disposition::DeadLetter(DeadLetter {
        reason: Reason::Permanent,
        detail: "no such\r\naccount".into(),
    }))
    .await
    .expect("dead-letter");
    assert_eq!(stream.pending("g").await, 0, "acked");
    let dead = stream.entries(&stream.dead()).await;
    assert_eq!(dead.len(), 1);
    let f = &dead[0].1;
    assert_eq!(f["message_id"], "m-1");
    assert_eq!(f["payload"], "body");
    assert_eq!(f["order"], "o-7");
    assert_eq!(f[REASON_FIELD], "permanent");
    assert_eq!(f[DETAIL_FIELD], "no such  account");
    assert_eq!(f[STREAM_FIELD], stream.name);
    assert_eq!(f[GROUP_FIELD], "g");
    assert_eq!(f[ENTRY_FIELD], entry);
    assert_eq!(f[DELIVERIES_FIELD], "1");
}

#[tokio::test]
async fn an_entry_delivered_too_often_is_dead_lettered_by_the_source() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("poison", b"").await;
    stream.publish("fine", b"").await;
    let claiming = || {
        stream
            .builder("g")
            .batch(1)
            .max_deliveries(2)
            .claim_idle(Duration::from_millis(100))
            .claim_every(Duration::from_millis(20))
    };
    // Two consumers that die holding it: delivered twice.
    for i in 0..2 {
        if i > 0 {
            // Until it is claimable.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let mut source = claiming().connect(&url).await.expect("source");
        let d = next(&mut source).await;
        assert_eq!(id_of(&d), "poison");
    }
    // The third delivery is past the limit: dead-lettered, and the next entry handed out.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut source = claiming().connect(&url).await.expect("source");
    let d = next(&mut source).await;
    assert_eq!(id_of(&d), "fine");
    let dead = stream.entries(&stream.dead()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1["message_id"], "poison");
    assert_eq!(dead[0].1[REASON_FIELD], "attempts_exhausted");
    assert_eq!(dead[0].1[DELIVERIES_FIELD], "3");
    d.settle(Disposition::Ack).await.expect("ack");
    assert_eq!(stream.pending("g").await, 0);
}

#[tokio::test]
async fn a_stream_deleted_under_the_source_is_made_again() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    let mut source = stream
        .builder("g")
        .claim_every(Duration::from_millis(50))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .connect(&url)
        .await
        .expect("source");
    stream.publish("before", b"").await;
    next(&mut source)
        .await
        .settle(Disposition::Ack)
        .await
        .expect("ack");
    let _: () = redis::cmd("DEL")
        .arg(&stream.name)
        .query_async(&mut stream.conn.clone())
        .await
        .expect("DEL");
    // Another stream under the name, without the group, and one entry.
    stream.publish("after", b"").await;
    // The source fails once (no group), makes the group from the beginning, and reads it.
    assert_eq!(id_of(&next(&mut source).await), "after");
}

#[tokio::test]
async fn close_hands_back_what_was_read_but_not_handed_out() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    for i in 0..5 {
        stream.publish(&format!("m-{i}"), b"").await;
    }
    let mut first = stream
        .builder("g")
        .batch(10)
        .connect(&url)
        .await
        .expect("a");
    let held = next(&mut first).await;
    first.close().await;
    assert!(
        first.next().await.is_none(),
        "a closed source hands out nothing"
    );
    // The four left in its buffer are claimable at once, though the idle time is long.
    let mut second = stream
        .builder("g")
        .claim_idle(Duration::from_secs(300))
        .claim_every(Duration::from_millis(20))
        .connect(&url)
        .await
        .expect("b");
    let mut ids = Vec::new();
    for _ in 0..4 {
        let d = next(&mut second).await;
        ids.push(id_of(&d));
        d.settle(Disposition::Ack).await.expect("ack");
    }
    ids.sort();
    assert_eq!(ids, ["m-1", "m-2", "m-3", "m-4"]);
    // A delivery handed out before the close can still be settled.
    held.settle(Disposition::Ack).await.expect("ack");
    assert_eq!(stream.pending("g").await, 0);
}

#[tokio::test]
async fn a_key_that_is_not_a_stream_or_a_dead_letter_into_itself_is_refused() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    let _: () = redis::cmd("SET")
        .arg(&stream.name)
        .arg("x")
        .query_async(&mut stream.conn.clone())
        .await
        .expect("SET");
    let err = stream
        .builder("g")
        .connect(&url)
        .await
        .expect_err("refused");
    assert!(
        matches!(&err, MqError::Config(m) if m.contains("not a stream")),
        "{err}"
    );
    let _: () = redis::cmd("DEL")
        .arg(&stream.name)
        .query_async(&mut stream.conn.clone())
        .await
        .expect("DEL");
    let err = stream
        .builder("g")
        .dead_letter(DeadLetterTarget::Stream(stream.name.clone()))
        .connect(&url)
        .await
        .expect_err("refused");
    assert!(
        matches!(&err, MqError::Config(m) if m.contains("itself")),
        "{err}"
    );
    let _: () = redis::cmd("SET")
        .arg(stream.dead())
        .arg("x")
        .query_async(&mut stream.conn.clone())
        .await
        .expect("SET");
    let err = stream
        .builder("g")
        .connect(&url)
        .await
        .expect_err("refused");
    assert!(
        matches!(&err, MqError::Config(m) if m.contains("not a stream")),
        "{err}"
    );
}

#[tokio::test]
async fn a_dead_letter_that_cannot_be_stored_leaves_the_entry_pending() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"").await;
    let mut source = stream.source("g").await;
    let d = next(&mut source).await;
    // The dead-letter key turns into something else than a stream after the start.
    let _: () = redis::cmd("SET")
        .arg(stream.dead())
        .arg("x")
        .query_async(&mut stream.conn.clone())
        .await
        .expect("SET");
    let dead = DeadLetter {
        reason: Reason::Permanent,
        detail: "no".into(),
    };
    d.settle(Disposition::DeadLetter(dead))
        .await
        .expect_err("the copy cannot be stored");
    assert_eq!(stream.pending("g").await, 1, "not acked without its copy");
}

#[tokio::test]
async fn a_read_cut_off_at_shutdown_is_handed_back_at_close() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    let mut first = stream
        .builder("g")
        .claim_every(Duration::from_secs(3))
        .connect(&url)
        .await
        .expect("a");
    // A read blocks for the entry; the consumer stops waiting for it (shutdown).
    assert!(
        next_within(&mut first, Duration::from_millis(300))
            .await
            .is_none()
    );
    // The read, still blocked at the server, gets the entry.
    stream.publish("late", b"").await;
    first.close().await;
    let mut second = stream
        .builder("g")
        .claim_idle(Duration::from_secs(300))
        .claim_every(Duration::from_millis(20))
        .connect(&url)
        .await
        .expect("b");
    let d = next(&mut second).await;
    assert_eq!(
        id_of(&d),
        "late",
        "claimable at once, not after the claim idle time"
    );
    assert_eq!(d.delivery_count(), Some(2));
}

#[tokio::test]
async fn progress_never_takes_back_an_entry_another_source_claimed() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"").await;
    let idle = Duration::from_millis(200);
    let mut slow = stream
        .builder("g")
        .claim_idle(idle)
        .connect(&url)
        .await
        .expect("a");
    let stalled = next(&mut slow).await;
    let mut other = stream
        .builder("g")
        .consumer("other")
        .claim_idle(idle)
        .claim_every(Duration::from_millis(20))
        .connect(&url)
        .await
        .expect("b");
    let claimed = next(&mut other).await;
    // The stalled holder wakes and reports progress, then requeues: neither moves the entry.
    stalled.in_progress().await.expect("progress");
    stalled
        .settle(Disposition::Requeue {
            delay: Duration::ZERO,
        })
        .await
        .expect("requeue");
    let owner: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(&stream.name)
        .arg("g")
        .arg("-")
        .arg("+")
        .arg(10)
        .query_async(&mut stream.conn.clone())
        .await
        .expect("XPENDING");
    assert_eq!(owner.len(), 1);
    assert_eq!(owner[0].1, "other", "still the claimer's: {owner:?}");
    claimed.settle(Disposition::Ack).await.expect("ack");
}

#[tokio::test]
async fn long_idle_consumers_with_nothing_pending_are_forgotten_at_start() {
    let Some(url) = redis_url() else { return };
    let stream = Stream::new(&url).await;
    stream.publish("m-1", b"").await;
    let mut busy = stream
        .builder("g")
        .consumer("busy")
        .connect(&url)
        .await
        .expect("busy");
    let _held = next(&mut busy).await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg(&stream.name)
        .arg("g")
        .arg("gone")
        .query_async(&mut stream.conn.clone())
        .await
        .expect("CREATECONSUMER");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fresh = stream
        .builder("g")
        .forget_consumers_after(Some(Duration::from_millis(200)))
        .connect(&url)
        .await
        .expect("fresh");
    let names = consumer_names(&stream).await;
    assert!(!names.contains(&"gone".to_owned()), "{names:?}");
    assert!(
        names.contains(&"busy".to_owned()),
        "a consumer with a pending entry is kept: {names:?}"
    );
    drop(fresh);
}

async fn consumer_names(stream: &Stream) -> Vec<String> {
    let listed: Vec<HashMap<String, Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(&stream.name)
        .arg("g")
        .query_async(&mut stream.conn.clone())
        .await
        .expect("XINFO CONSUMERS");
    listed
        .into_iter()
        .filter_map(|c| match c.get("name") {
            Some(Value::BulkString(b)) => String::from_utf8(b.clone()).ok(),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn on_a_cluster_entries_are_read_claimed_and_dead_lettered() {
    let Some(cluster) = idem_testkit::services::RedisCluster::shared() else {
        return;
    };
    let nodes: Vec<String> = cluster
        .urls()
        .iter()
        .map(|u| u.trim_start_matches("redis://").to_owned())
        .collect();
    let url = format!("redis+cluster://{}", nodes.join(","));
    let name = format!("idemt:{:016x}", rand::random::<u64>());
    let client = redis::cluster::ClusterClient::new(cluster.urls()).expect("cluster client");
    let mut conn = client.get_async_connection().await.expect("connect");
    idem_mq::redis_streams::publish(&mut conn, &name, "m-1", b"x")
        .await
        .expect("publish");
    idem_mq::redis_streams::publish(&mut conn, &name, "m-2", b"y")
        .await
        .expect("publish");
    let builder = || {
        RedisStreamSource::builder(&name, "g")
            .batch(1)
            .claim_idle(Duration::from_millis(200))
            .claim_every(Duration::from_millis(20))
    };
    let mut source = builder().connect(&url).await.expect("source");
    let first = next(&mut source).await;
    assert_eq!(id_of(&first), "m-1");
    first
        .settle(Disposition::DeadLetter(DeadLetter {
            reason: Reason::Mismatch,
            detail: "another payload".into(),
        }))
        .await
        .expect("dead-letter across slots");
    // The second is read by a consumer that dies, then claimed by another.
    drop(next(&mut source).await);
    drop(source);
    let mut other = builder().connect(&url).await.expect("source");
    let claimed = next(&mut other).await;
    assert_eq!(id_of(&claimed), "m-2");
    assert_eq!(claimed.delivery_count(), Some(2));
    claimed.in_progress().await.expect("progress");
    claimed.settle(Disposition::Ack).await.expect("ack");

    let dead: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(format!("{name}:dead"))
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .expect("XRANGE");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1[REASON_FIELD], "mismatch");
    let pending: Value = redis::cmd("XPENDING")
        .arg(&name)
        .arg("g")
        .query_async(&mut conn)
        .await
        .expect("XPENDING");
    assert!(
        matches!(&pending, Value::Array(a) if a.first() == Some(&Value::Int(0))),
        "{pending:?}"
    );
    let _: () = redis::cmd("DEL")
        .arg(&name)
        .query_async(&mut conn)
        .await
        .expect("DEL");
    let _: () = redis::cmd("DEL")
        .arg(format!("{name}:dead"))
        .query_async(&mut conn)
        .await
        .expect("DEL");
}
