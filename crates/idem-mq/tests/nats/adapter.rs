//! The adapter alone: settling, pulling, dead letters, timers, progress, restarts.

use super::*;

#[tokio::test]
async fn adapter_settles_ack_requeue_and_dead_letter() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let js = &streams.js;
    let subject = streams.subject();

    let first = publish_once(js, subject.clone(), "k-a", Bytes::from_static(b"a"))
        .await
        .expect("publish a");
    assert!(!first.duplicate);
    let again = publish_once(js, subject.clone(), "k-a", Bytes::from_static(b"a"))
        .await
        .expect("publish a again");
    assert!(again.duplicate, "a re-publish within the window is dropped");
    assert_eq!(again.sequence, first.sequence);
    publish_once(js, subject.clone(), "k-b", Bytes::from_static(b"b"))
        .await
        .expect("publish b");
    publish_once(js, subject.clone(), "k-c", Bytes::from_static(b"c"))
        .await
        .expect("publish c");
    js.publish(subject.clone(), Bytes::from_static(b"no key"))
        .await
        .expect("publish without key")
        .await
        .expect("ack");
    assert!(matches!(
        publish_once(js, subject.clone(), "", Bytes::new()).await,
        Err(MqError::Config(_))
    ));

    let mut source = NatsSource::builder(&streams.name, "smoke")
        .ack_wait(Duration::from_secs(30))
        .max_deliver(10)
        .max_requeue_delay(Duration::from_secs(60))
        .connect(&url)
        .await
        .expect("source");
    // Each durable consumer of a stream keeps records of its own.
    assert_eq!(source.name(), format!("{}.smoke", streams.name));
    assert_eq!(source.ack_wait(), Some(Duration::from_secs(30)));
    assert_eq!(
        source.redelivery_horizon(),
        Horizon::Bounded(Duration::from_secs(9 * 90))
    );

    let a = next(&mut source).await;
    assert_eq!(a.message_id(), Some("k-a"));
    assert_eq!(a.payload(), b"a");
    assert_eq!(a.delivery_count(), Some(1));
    assert_eq!(a.header("Nats-Msg-Id").as_deref(), Some("k-a"));
    assert_eq!(a.header("Absent"), None);
    assert_eq!(
        a.header("bad:name"),
        None,
        "an unrepresentable name is no panic"
    );
    a.in_progress().await.expect("progress");
    a.settle(Disposition::Requeue {
        delay: Duration::from_millis(300),
    })
    .await
    .expect("requeue a");

    let b = next(&mut source).await;
    assert_eq!(b.message_id(), Some("k-b"));
    b.settle(Disposition::Ack).await.expect("ack b");

    let c = next(&mut source).await;
    assert_eq!(c.message_id(), Some("k-c"));
    let c_seq = c.stream_sequence().expect("sequence");
    c.settle(Disposition::DeadLetter(DeadLetter {
        reason: Reason::Permanent,
        detail: "out of stock\r\nsecond line".to_owned(),
    }))
    .await
    .expect("dead-letter c");

    let none = next(&mut source).await;
    assert_eq!(none.message_id(), None);
    none.settle(Disposition::DeadLetter(DeadLetter {
        reason: Reason::NoKey,
        detail: "no Nats-Msg-Id".to_owned(),
    }))
    .await
    .expect("dead-letter the keyless message");

    let a = next(&mut source).await;
    assert_eq!(
        a.message_id(),
        Some("k-a"),
        "the requeued message comes back"
    );
    assert_eq!(a.delivery_count(), Some(2), "the server counts deliveries");
    a.settle(Disposition::Ack).await.expect("ack a");

    let dead = streams.dead_letters().await;
    assert_eq!(dead.len(), 2);
    assert_eq!(header(&dead[0], REASON_HEADER), Some("permanent"));
    assert_eq!(
        header(&dead[0], DETAIL_HEADER),
        Some("out of stock  second line")
    );
    assert_eq!(header(&dead[0], MSG_ID_HEADER), Some("k-c"));
    assert_eq!(header(&dead[0], STREAM_HEADER), Some(streams.name.as_str()));
    assert_eq!(header(&dead[0], SUBJECT_HEADER), Some(subject.as_str()));
    assert_eq!(
        header(&dead[0], SEQUENCE_HEADER),
        Some(c_seq.to_string().as_str())
    );
    assert_eq!(header(&dead[0], DELIVERIES_HEADER), Some("1"));
    assert_eq!(dead[0].payload.as_ref(), b"c");
    assert_eq!(header(&dead[1], REASON_HEADER), Some("no_key"));
    assert_eq!(header(&dead[1], MSG_ID_HEADER), None);
    assert_eq!(dead[1].payload.as_ref(), b"no key");

    // Everything settled: nothing pending, nothing waiting for an ack.
    let info = streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .consumer_info("smoke")
        .await
        .expect("consumer info");
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_pending, 0);

    source.close().await;
    assert!(source.next().await.is_none(), "a closed source ends");
}

#[tokio::test]
async fn pulling_resumes_after_the_consumer_is_deleted() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let subject = streams.subject();
    let mut source = NatsSource::builder(&streams.name, "resume")
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .connect(&url)
        .await
        .expect("source");
    publish_once(&streams.js, subject.clone(), "one", Bytes::new())
        .await
        .expect("publish");
    next(&mut source)
        .await
        .settle(Disposition::Ack)
        .await
        .expect("ack");

    streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .delete_consumer("resume")
        .await
        .expect("delete the consumer");
    publish_once(&streams.js, subject.clone(), "two", Bytes::new())
        .await
        .expect("publish");
    // The source notices, creates the consumer again (from the start of the stream: "one"
    // comes back, which is what the records are for), and goes on.
    let mut seen = Vec::new();
    while !seen.iter().any(|k| k == "two") {
        let d = next(&mut source).await;
        seen.push(d.message_id().expect("key").to_owned());
        d.settle(Disposition::Ack).await.expect("ack");
    }
    assert!(seen.contains(&"two".to_owned()));
}

#[tokio::test]
async fn a_dead_letter_subject_read_back_or_not_stored_is_refused() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |c| {
        c.subjects.push(format!("{}.other.>", c.name));
    })
    .await;
    let own = format!("{}.other.dead", streams.name);
    let err = NatsSource::builder(&streams.name, "dl")
        .dead_letter_subject(own.clone())
        .connect(&url)
        .await
        .expect_err("read back");
    assert!(matches!(err, MqError::Config(_)), "{err}");
    // Filtered away from the consumer, it is fine (stored in the same stream).
    NatsSource::builder(&streams.name, "dl-filtered")
        .filter_subject(streams.subject())
        .dead_letter_subject(own)
        .connect(&url)
        .await
        .expect("a filtered consumer does not read its dead letters");
    // The durable consumer exists with that filter: a builder that names no filter uses it
    // as it is, and so is not refused.
    NatsSource::builder(&streams.name, "dl-filtered")
        .dead_letter_subject(format!("{}.other.dead", streams.name))
        .connect(&url)
        .await
        .expect("an existing filtered consumer is checked as it is");
    let err = NatsSource::builder(&streams.name, "dl2")
        .dead_letter_subject(format!("{}.nowhere", streams.name))
        .connect(&url)
        .await
        .expect_err("not stored");
    assert!(matches!(err, MqError::Config(_)), "{err}");
    NatsSource::builder(&streams.name, "dl3")
        .dead_letter(DeadLetterTarget::TermOnly)
        .connect(&url)
        .await
        .expect("term only needs no stream");
}

#[tokio::test]
async fn a_core_dead_letter_subject_gets_the_copy_and_term_only_gets_none() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let core = format!("{}.core-dead", streams.name);
    let mut watcher = streams
        .js
        .client()
        .subscribe(core.clone())
        .await
        .expect("subscribe");
    streams.js.client().flush().await.expect("flush");
    for key in ["to-core", "term-only"] {
        streams.publish(key, Bytes::from_static(b"x")).await;
    }
    let dead = |reason| {
        Disposition::DeadLetter(DeadLetter {
            reason,
            detail: "gave up".to_owned(),
        })
    };
    let mut to_core = NatsSource::builder(&streams.name, "shared-dl")
        .dead_letter(DeadLetterTarget::Subject(core))
        .connect(&url)
        .await
        .expect("source");
    let d = next(&mut to_core).await;
    assert_eq!(d.message_id(), Some("to-core"));
    d.settle(dead(Reason::Mismatch)).await.expect("dead-letter");
    let copy = within("the copy", futures_util::StreamExt::next(&mut watcher))
        .await
        .expect("a message");
    let headers = copy.headers.expect("headers");
    assert_eq!(
        headers.get(REASON_HEADER).map(|v| v.as_str()),
        Some("mismatch")
    );
    assert_eq!(
        headers.get(MSG_ID_HEADER).map(|v| v.as_str()),
        Some("to-core")
    );
    to_core.close().await;

    let mut term_only = NatsSource::builder(&streams.name, "shared-dl")
        .dead_letter(DeadLetterTarget::TermOnly)
        .connect(&url)
        .await
        .expect("source");
    let d = next(&mut term_only).await;
    assert_eq!(d.message_id(), Some("term-only"));
    d.settle(dead(Reason::Permanent)).await.expect("term");
    assert!(streams.dead_letters().await.is_empty(), "nothing stored");
    assert_all_settled(&streams, "shared-dl").await;
}

#[tokio::test]
async fn a_bound_source_reports_the_consumer_s_own_timers() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let err = NatsSource::builder(&streams.name, "existing")
        .bind()
        .connect(&url)
        .await
        .expect_err("nothing to bind to");
    assert!(matches!(err, MqError::Broker { .. }), "{err}");
    streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("existing".to_owned()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(7),
            max_deliver: 3,
            backoff: vec![Duration::from_secs(1), Duration::from_secs(10)],
            ..Default::default()
        })
        .await
        .expect("create the consumer");
    let source = NatsSource::builder(&streams.name, "existing")
        .bind()
        // Ignored when binding: the consumer's own settings apply.
        .ack_wait(Duration::from_secs(3))
        .max_deliver(-1)
        .max_requeue_delay(Duration::from_secs(20))
        .connect(&url)
        .await
        .expect("bind");
    assert_eq!(source.consumer_name(), "existing");
    // With a backoff the server's ack wait is its first step.
    assert_eq!(source.ack_wait(), Some(Duration::from_secs(1)));
    // Two redeliveries at most, each after at most the longest backoff step plus the longest
    // requeue delay.
    assert_eq!(
        source.redelivery_horizon(),
        Horizon::Bounded(Duration::from_secs(2 * (10 + 20)))
    );
}

#[tokio::test]
async fn progress_holds_a_message_and_its_absence_lets_it_go() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let ack_wait = Duration::from_secs(2);
    let open = || async {
        NatsSource::builder(&streams.name, "shared")
            .ack_wait(ack_wait)
            .connect(&url)
            .await
            .expect("source")
    };
    let mut first = open().await;
    let mut second = open().await;
    streams.publish("slow", Bytes::new()).await;
    let held = next(&mut first).await;
    assert_eq!(held.delivery_count(), Some(1));

    // Three ack waits with progress every tenth of one: the second instance gets nothing.
    let progress = async {
        for _ in 0..30 {
            held.in_progress().await.expect("progress");
            tokio::time::sleep(ack_wait / 10).await;
        }
    };
    let stolen = tokio::time::timeout(ack_wait * 3, next(&mut second));
    let ((), stolen) = tokio::join!(progress, stolen);
    assert!(
        stolen.is_err(),
        "a message with progress reported is not redelivered"
    );

    // No more progress: after ack_wait the server gives it to whoever pulls.
    let again = next(&mut second).await;
    assert_eq!(again.message_id(), Some("slow"));
    // At least the second delivery: the first instance's pull may have taken a redelivery
    // into its buffer (unread there, it timed out again).
    assert!(
        again.delivery_count() >= Some(2),
        "{:?}",
        again.delivery_count()
    );
    again.settle(Disposition::Ack).await.expect("ack");
    // The stale delivery's ack is harmless.
    held.settle(Disposition::Ack).await.expect("late ack");
}

#[tokio::test]
async fn pulling_goes_on_after_the_server_restarts() {
    let Some(mut server) = OwnServer::start() else {
        return;
    };
    let url = server.url();
    let client = async_nats::connect(&url).await.expect("connect");
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: "RESTART".to_owned(),
        subjects: vec!["RESTART.in".to_owned()],
        ..Default::default()
    })
    .await
    .expect("stream");
    let mut source = NatsSource::builder("RESTART", "survivor")
        .dead_letter(DeadLetterTarget::TermOnly)
        .retry_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .connect(&url)
        .await
        .expect("source");
    publish_once(&js, "RESTART.in", "before", Bytes::new())
        .await
        .expect("publish");
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("before"));
    d.settle(Disposition::Ack).await.expect("ack");

    server.restart();

    // The publisher's client reconnects too; retry its publish until the server is back.
    within("publish after the restart", async {
        while publish_once(&js, "RESTART.in", "after", Bytes::new())
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("after"));
    d.settle(Disposition::Ack)
        .await
        .expect("ack after the restart");
}

#[tokio::test]
async fn close_hands_back_what_was_prefetched() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    for i in 0..100 {
        streams.publish(&format!("c-{i}"), Bytes::new()).await;
    }
    // An ack wait far beyond the test's bound: a message left in the closed source's buffer
    // would not come back in time.
    let open = || async {
        NatsSource::builder(&streams.name, "closing")
            .ack_wait(Duration::from_secs(600))
            .batch(10)
            .max_ack_pending(1000)
            .connect(&url)
            .await
            .expect("source")
    };
    let mut first = open().await;
    next(&mut first)
        .await
        .settle(Disposition::Ack)
        .await
        .expect("ack");
    // Let the prefetch arrive.
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.close().await;
    assert!(first.next().await.is_none());

    let mut second = open().await;
    let mut handed_back = 0;
    for _ in 1..100 {
        let d = next(&mut second).await;
        if d.delivery_count() == Some(2) {
            handed_back += 1;
        }
        d.settle(Disposition::Ack).await.expect("ack");
    }
    assert!(handed_back > 0, "the prefetched messages were handed back");
    assert_all_settled(&streams, "closing").await;
}
