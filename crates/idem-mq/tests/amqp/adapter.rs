//! The adapter alone: publishing, settling, delivery counts, dead letters, reconnection.

use super::*;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_whose_delay_queue_cannot_be_declared_gives_the_original_back() {
    let Some((url, queue, _cleanup)) = setup("undeclared", QueueType::Quorum).await else {
        return;
    };
    // A queue of the delay queue's name with other arguments: declaring it is refused.
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_declare(
        format!("{queue}.delay.100").as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .expect("declare a queue in the way");
    let _ = conn.close(200, "OK".into()).await;

    let mut source = AmqpSource::connect(&url, &queue).await.expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-undeclared", b"x", BasicProperties::default())
        .await
        .expect("publish");
    let d = next(&mut source).await;
    let err = d
        .settle(Disposition::Requeue {
            delay: Duration::from_millis(50),
        })
        .await
        .expect_err("the delay queue was refused");
    assert!(matches!(err, idem_mq::MqError::Broker { .. }), "{err}");
    // Given back at once, not left unacknowledged until the channel closes.
    let d = next(&mut source).await;
    assert_eq!(
        d.message_id(),
        Some("k-undeclared"),
        "the original came back"
    );
    assert!(d.redelivered());
    d.settle(Disposition::Ack).await.expect("ack");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_does_not_stop_later_requeues() {
    let Some((url, queue, _cleanup)) = setup("reopen", QueueType::Quorum).await else {
        return;
    };
    let mut source = AmqpSource::connect(&url, &queue).await.expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-reopen", b"x", BasicProperties::default())
        .await
        .expect("publish");
    // The dead-letter exchange deleted under the running source: publishing to it is a
    // channel error, which closes the channel the copies go out on.
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_delete(format!("{queue}.dlx").as_str().into(), Default::default())
        .await
        .expect("delete the dead-letter exchange");
    let _ = conn.close(200, "OK".into()).await;
    let d = next(&mut source).await;
    let err = d
        .settle(Disposition::DeadLetter(DeadLetter {
            reason: Reason::Permanent,
            detail: "test".into(),
        }))
        .await
        .expect_err("no exchange to dead-letter to");
    assert!(matches!(err, idem_mq::MqError::Broker { .. }), "{err}");
    // The original came back, and a requeue goes out on a channel opened again.
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("k-reopen"));
    d.settle(Disposition::Requeue {
        delay: Duration::ZERO,
    })
    .await
    .expect("a requeue after the refused dead letter");
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("k-reopen"));
    d.settle(Disposition::Ack).await.expect("ack");
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0);
}
