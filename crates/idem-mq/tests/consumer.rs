//! The consumer's rules, on the in-process queue and the memory store: what runs, what is
//! acked, requeued and dead-lettered, and that one key never runs twice at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::MemoryStore;
use idem_mq::memory::{Published, Queue};
use idem_mq::{
    Consumer, Failure, Horizon, KeyFrom, Message, MissingKey, MqError, Outcome, Reason, Source,
};
use idem_testkit::{Fault, FaultyStore, Op, within};

type Runs = Arc<Mutex<HashMap<String, usize>>>;

fn counting(
    runs: &Runs,
) -> impl Fn(Message) -> std::future::Ready<Result<u64, Failure<String>>> + use<> {
    let runs = runs.clone();
    move |m: Message| {
        let id = m.message_id.clone().unwrap_or_default();
        *runs.lock().expect("lock").entry(id).or_default() += 1;
        std::future::ready(Ok(m.fence().unwrap_or(0)))
    }
}

async fn consume_all<H: idem_mq::Handler>(
    consumer: &Consumer<impl idem::Store + Clone>,
    q: &Queue,
    h: H,
) {
    within(
        "the queue drains",
        consumer.run(q.source(), h, q.clone().drained()),
    )
    .await
    .expect("the consumer runs");
}

#[tokio::test]
async fn a_message_published_twice_runs_once_and_both_are_acked() {
    let q = Queue::new("orders");
    for i in 0..300 {
        let id = format!("order-{i}");
        q.publish(Some(&id), format!("{{\"n\":{i}}}"));
        if i % 10 < 3 {
            q.publish(Some(&id), format!("{{\"n\":{i}}}"));
        }
    }
    let runs = Runs::default();
    let consumer = Consumer::new(MemoryStore::new()).concurrency(16);
    consume_all(&consumer, &q, counting(&runs)).await;

    let runs = runs.lock().expect("lock");
    assert_eq!(runs.len(), 300);
    assert!(runs.values().all(|&n| n == 1), "every id ran exactly once");
    let c = consumer.counts();
    assert_eq!((c.received, c.handled, c.replayed), (390, 300, 90));
    assert_eq!(q.acked(), 390);
}

#[tokio::test]
async fn a_permanent_failure_is_stored_dead_lettered_and_replayed_to_a_redelivery() {
    let q = Queue::new("orders");
    q.publish(Some("bad-1"), b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |_m: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Err::<(), _>(Failure::Permanent("unknown sku".to_owned())) }
    };
    let consumer = Consumer::new(MemoryStore::new());
    consume_all(&consumer, &q, handler.clone()).await;
    q.publish(Some("bad-1"), b"{}".as_slice());
    consume_all(&consumer, &q, handler).await;

    assert_eq!(ran.load(Ordering::SeqCst), 1, "the redelivery did not run");
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 2);
    for (_, why) in dead {
        assert_eq!(why.reason, Reason::Permanent);
        assert_eq!(why.detail, "unknown sku");
    }
}

/// `Failure::DeadLetter` stores nothing: the message moved back from the dead letter runs
/// again (and this time succeeds), where a permanent failure would be replayed.
#[tokio::test]
async fn a_refused_message_is_dead_lettered_without_a_record_and_runs_again_when_moved_back() {
    let q = Queue::new("orders");
    q.publish(Some("wrong-target"), b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |_m: Message| {
        let first = counter.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                Err(Failure::DeadLetter("the target answered 404".to_owned()))
            } else {
                Ok(())
            }
        }
    };
    let consumer = Consumer::new(MemoryStore::new());
    consume_all(&consumer, &q, handler.clone()).await;
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, Reason::Refused);
    assert_eq!(dead[0].1.detail, "the target answered 404");
    assert_eq!(q.acked(), 0, "a refused message is not acked");

    q.publish(Some("wrong-target"), b"{}".as_slice());
    consume_all(&consumer, &q, handler).await;
    assert_eq!(ran.load(Ordering::SeqCst), 2, "moved back, it ran again");
    assert_eq!(q.acked(), 1);
    assert_eq!(q.dead_letters().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_retryable_failure_is_requeued_with_backoff_then_dead_lettered() {
    let q = Queue::new("orders");
    q.publish(Some("flaky"), b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |_m: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Err::<(), _>(Failure::Retry("database down".to_owned())) }
    };
    let consumer = Consumer::new(MemoryStore::new())
        .max_attempts(4)
        .backoff(Duration::from_secs(1), Duration::from_secs(60));
    let start = tokio::time::Instant::now();
    consume_all(&consumer, &q, handler).await;

    assert_eq!(
        ran.load(Ordering::SeqCst),
        4,
        "one run per delivery, four deliveries"
    );
    let (_, why) = &q.dead_letters()[0];
    assert_eq!(why.reason, Reason::AttemptsExhausted);
    assert!(why.detail.contains("database down"), "{}", why.detail);
    assert_eq!(consumer.counts().requeued, 3);
    // Three requeues of at least half of 1, 2 and 4 s.
    assert!(
        start.elapsed() >= Duration::from_millis(3500),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_gives_the_key_back_and_the_next_delivery_runs() {
    let q = Queue::new("orders");
    q.publish(Some("p-1"), b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |_m: Message| {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        async move {
            assert!(n > 0, "first delivery panics");
            Ok::<_, Failure<String>>("done".to_owned())
        }
    };
    let consumer = Consumer::new(MemoryStore::new());
    consume_all(&consumer, &q, handler).await;
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    let c = consumer.counts();
    assert_eq!((c.requeued, c.handled), (1, 1));
}

#[tokio::test]
async fn messages_without_a_valid_key_are_dead_lettered_or_run_unguarded_as_configured() {
    let q = Queue::new("orders");
    q.publish(None, b"{}".as_slice());
    q.publish(Some("has space"), b"{}".as_slice());
    let runs = Runs::default();
    let consumer = Consumer::new(MemoryStore::new());
    consume_all(&consumer, &q, counting(&runs)).await;
    let mut reasons: Vec<_> = q.dead_letters().iter().map(|(_, w)| w.reason).collect();
    reasons.sort_by_key(|r| r.code());
    assert_eq!(reasons, [Reason::InvalidKey, Reason::NoKey]);
    assert!(runs.lock().expect("lock").is_empty());

    let q = Queue::new("orders");
    q.publish(None, b"{}".as_slice());
    let unguarded = Consumer::new(MemoryStore::new()).missing_key(MissingKey::RunUnguarded);
    consume_all(&unguarded, &q, counting(&runs)).await;
    assert_eq!(runs.lock().expect("lock").get(""), Some(&1));
    assert_eq!(unguarded.counts().unguarded, 1);
    assert_eq!(q.acked(), 1);
}

#[tokio::test]
async fn keys_from_a_header_or_the_payload_and_a_payload_mismatch_is_dead_lettered() {
    let q = Queue::new("orders");
    let msg = |order: &str, sku: u32| Published {
        id: None,
        headers: vec![("x-order".into(), order.into())],
        payload: format!("{{\"order\":\"{order}\",\"sku\":{sku}}}").into(),
    };
    q.publish_message(msg("o-1", 7));
    q.publish_message(msg("o-1", 7));
    q.publish_message(msg("o-1", 8)); // the same key with another payload
    let runs = Runs::default();
    // Payload fingerprints are on by default.
    let consumer = Consumer::new(MemoryStore::new())
        .key(KeyFrom::Header("x-order".into()))
        .concurrency(1);
    consume_all(&consumer, &q, counting(&runs)).await;
    assert_eq!(runs.lock().expect("lock").get(""), Some(&1));
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, Reason::Mismatch);
    assert!(dead[0].0.payload.ends_with(b"8}"));

    let q = Queue::new("orders");
    q.publish_message(msg("o-2", 1));
    q.publish_message(msg("o-2", 1));
    let by_payload = Consumer::new(MemoryStore::new()).key(KeyFrom::JsonPointer("/order".into()));
    consume_all(&by_payload, &q, counting(&runs)).await;
    assert_eq!(by_payload.counts().replayed, 1);
}

/// Two queues whose consumers share one store and are given one namespace: a message of the
/// second whose key the first settled with another payload is dead-lettered `mismatch`, never
/// acked on the first's record; one with the same payload is a replay. With fingerprints off
/// the other payload is acked on the first's record, as that setting says.
#[tokio::test]
async fn a_key_settled_by_another_source_with_another_payload_is_a_mismatch_never_an_ack() {
    let store = MemoryStore::new();
    let (first, second) = (Queue::new("orders"), Queue::new("billing"));
    for i in 0..5 {
        first.publish(Some(&format!("m-{i}")), format!("order {i}"));
        second.publish(
            Some(&format!("m-{i}")),
            if i == 0 {
                "order 0".into()
            } else {
                format!("invoice {i}")
            },
        );
    }
    let runs = Runs::default();
    let shared = |store: &MemoryStore| Consumer::new(store.clone()).namespace("shared");
    consume_all(&shared(&store), &first, counting(&runs)).await;
    let consumer = shared(&store);
    consume_all(&consumer, &second, counting(&runs)).await;
    assert!(runs.lock().expect("lock").values().all(|&n| n == 1));
    let dead = second.dead_letters();
    assert_eq!(dead.len(), 4, "{dead:?}");
    assert!(dead.iter().all(|(_, why)| why.reason == Reason::Mismatch));
    let c = consumer.counts();
    assert_eq!((c.handled, c.replayed), (0, 1));

    // Consumers that both turn fingerprints off answer the second payload with the first's
    // result.
    let loose = |store: &MemoryStore| {
        Consumer::new(store.clone())
            .namespace("loose")
            .fingerprint_payload(false)
    };
    let (third, fourth) = (Queue::new("audit"), Queue::new("archive"));
    third.publish(Some("m-1"), "one thing");
    fourth.publish(Some("m-1"), "something else");
    consume_all(&loose(&store), &third, counting(&runs)).await;
    let unchecked = loose(&store);
    consume_all(&unchecked, &fourth, counting(&runs)).await;
    assert_eq!(unchecked.counts().replayed, 1);
}

#[tokio::test]
async fn a_redelivery_while_the_first_runs_never_runs_beside_it() {
    let q = Queue::new("orders");
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let (r, m, n) = (running.clone(), most.clone(), ran.clone());
    let handler = move |_m: Message| {
        let (r, m, n) = (r.clone(), m.clone(), n.clone());
        async move {
            let now = r.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now, Ordering::SeqCst);
            n.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(300)).await;
            r.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(())
        }
    };
    for _ in 0..4 {
        q.publish(Some("same"), b"{}".as_slice());
    }
    // Two consumers on one queue, and a wait for the key shorter than the handler.
    let store = MemoryStore::new();
    let a = Consumer::new(store.clone())
        .wait_in_flight(Duration::from_millis(50))
        .backoff(Duration::from_millis(20), Duration::from_millis(100));
    let b = a.clone();
    let (ra, rb) = tokio::join!(
        a.run(q.source(), handler.clone(), q.clone().drained()),
        b.run(q.source(), handler, q.clone().drained()),
    );
    ra.expect("a");
    rb.expect("b");
    assert_eq!(most.load(Ordering::SeqCst), 1, "never two at once");
    assert_eq!(ran.load(Ordering::SeqCst), 1, "and once");
    assert_eq!(q.acked(), 4);
    assert!(
        a.counts().requeued >= 1,
        "a delivery that found the key held was requeued"
    );
}

#[tokio::test]
async fn a_handler_longer_than_its_lease_keeps_the_key() {
    let q = Queue::new("orders");
    q.publish(Some("slow"), b"{}".as_slice());
    q.publish(Some("slow"), b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |_m: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Ok::<_, Failure<String>>(())
        }
    };
    let consumer = Consumer::new(MemoryStore::new())
        .lease(Duration::from_millis(400))
        .wait_in_flight(Duration::from_millis(100))
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    consume_all(&consumer, &q, handler).await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "the renewed lease kept the key"
    );
}

#[tokio::test]
async fn a_store_that_fails_runs_nothing_and_requeues() {
    let q = Queue::new("orders");
    q.publish(Some("k"), b"{}".as_slice());
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next(Op::Begin, Fault::Unavailable);
    let runs = Runs::default();
    let consumer =
        Consumer::new(store).backoff(Duration::from_millis(10), Duration::from_millis(10));
    consume_all(&consumer, &q, counting(&runs)).await;
    assert_eq!(
        runs.lock().expect("lock").get("k"),
        Some(&1),
        "ran once, after the outage"
    );
    let c = consumer.counts();
    assert_eq!((c.requeued, c.handled), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_message_that_keeps_killing_its_consumer_is_dead_lettered() {
    let q = Queue::new("orders");
    q.publish(Some("crash"), b"{}".as_slice());
    let consumer = Consumer::new(MemoryStore::new()).max_attempts(3);
    let hang = |_m: Message| async {
        std::future::pending::<()>().await;
        Ok::<(), Failure<String>>(())
    };
    let mut source = q.source();
    for _ in 0..3 {
        let d = source.next().await.expect("open").expect("delivery");
        // The consumer dies mid-handler: its delivery is dropped unsettled.
        let died =
            tokio::time::timeout(Duration::from_secs(1), consumer.process(&source, d, &hang)).await;
        assert!(died.is_err());
        // Let the dropped attempt give its key back.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let d = source.next().await.expect("open").expect("delivery");
    let outcome = tokio::time::timeout(Duration::from_secs(1), consumer.process(&source, d, &hang))
        .await
        .expect("dead-lettered without running")
        .expect("process");
    assert_eq!(outcome, Outcome::DeadLettered(Reason::AttemptsExhausted));
}

#[tokio::test]
async fn a_record_ttl_shorter_than_the_redelivery_horizon_is_refused() {
    let q = Queue::with_horizon("orders", Horizon::Bounded(Duration::from_secs(7200)));
    let consumer = Consumer::new(MemoryStore::new()).ttl(Duration::from_secs(3600));
    let err = consumer
        .run(
            q.source(),
            counting(&Runs::default()),
            std::future::ready(()),
        )
        .await
        .expect_err("refused");
    assert!(matches!(err, MqError::Config(_)), "{err}");

    // Any source name makes a valid namespace; one set by hand is checked.
    let err = Consumer::new(MemoryStore::new())
        .namespace("orders/eu")
        .run(
            Queue::new("orders/eu").source(),
            counting(&Runs::default()),
            std::future::ready(()),
        )
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("namespace"), "{err}");

    // A key source that could find no key in any message: refused before the first one.
    let q = Queue::new("orders");
    q.publish(Some("o-1"), br#"{"order":"o-1"}"#.as_slice());
    let err = Consumer::new(MemoryStore::new())
        .key(KeyFrom::JsonPointer("order".into()))
        .run(
            q.source(),
            counting(&Runs::default()),
            std::future::ready(()),
        )
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("is not a JSON pointer"), "{err}");
    assert!(
        q.dead_letters().is_empty() && q.pending() == 1,
        "nothing was taken"
    );
}

#[tokio::test]
async fn shutdown_stops_taking_messages_and_finishes_what_runs() {
    let q = Queue::new("orders");
    for i in 0..5 {
        q.publish(Some(&format!("m-{i}")), b"{}".as_slice());
    }
    let started = Arc::new(tokio::sync::Notify::new());
    let s = started.clone();
    let handler = move |_m: Message| {
        let s = s.clone();
        async move {
            s.notify_one();
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok::<_, Failure<String>>(())
        }
    };
    let consumer = Consumer::new(MemoryStore::new()).concurrency(1);
    let signal = started.clone();
    within(
        "the run",
        consumer.run(q.source(), handler, async move { signal.notified().await }),
    )
    .await
    .expect("runs");
    assert_eq!(q.acked(), 1, "the running handler finished and was acked");
    assert_eq!(q.pending(), 4, "the rest stay in the queue");
}

#[tokio::test(start_paused = true)]
async fn deliveries_that_only_waited_for_the_key_do_not_count_as_runs() {
    let q = Queue::new("orders");
    q.publish(Some("waited"), b"{}".as_slice());
    let mut source = q.source();
    // Five deliveries that each found the key held and were requeued, as a redelivery does
    // while another consumer runs the message.
    for _ in 0..5 {
        let d = source.next().await.expect("open").expect("delivery");
        idem_mq::Delivery::settle(
            d,
            idem_mq::Disposition::Requeue {
                delay: Duration::ZERO,
            },
        )
        .await
        .expect("requeue");
    }
    let runs = Runs::default();
    let consumer = Consumer::new(MemoryStore::new()).max_attempts(2);
    let d = source.next().await.expect("open").expect("delivery");
    assert_eq!(idem_mq::Delivery::delivery_count(&d), Some(6));
    let outcome = consumer
        .process(&source, d, &counting(&runs))
        .await
        .expect("process");
    assert_eq!(
        outcome,
        Outcome::Handled,
        "the first run of the key, on the sixth delivery"
    );
    assert_eq!(runs.lock().expect("lock").get("waited"), Some(&1));
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_sets_the_requeue_delay_within_the_backoff_bound() {
    let q = Queue::new("orders");
    q.publish(Some("later"), b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |_m: Message| {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                Err(Failure::RetryAfter(
                    "rate limited".to_owned(),
                    Duration::from_secs(40),
                ))
            } else {
                Ok(())
            }
        }
    };
    let consumer = Consumer::new(MemoryStore::new())
        .backoff(Duration::from_millis(10), Duration::from_secs(30));
    let start = tokio::time::Instant::now();
    // Paused time: the bound on the wait is virtual, past the 30 s requeue.
    tokio::time::timeout(
        Duration::from_secs(120),
        consumer.run(q.source(), handler, q.clone().drained()),
    )
    .await
    .expect("drains")
    .expect("runs");
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(30) && waited < Duration::from_secs(40),
        "asked for 40 s, bounded at 30 s: {waited:?}"
    );
}

#[tokio::test]
async fn a_handler_whose_lease_cannot_be_renewed_is_stopped_when_it_runs_out() {
    // The store goes away once the key is claimed: no renewal reaches it.
    stopped_when_the_lease_runs_out(|store| store.set_down(true)).await;
}

#[tokio::test]
async fn a_handler_whose_renewal_hangs_is_stopped_when_its_lease_runs_out() {
    // The first renewal never answers (a server that stalls, a half-open connection).
    stopped_when_the_lease_runs_out(|store| std::mem::forget(store.stall_next(Op::Renew))).await;
}

/// Runs a handler that takes 5 s under a 300 ms lease, `once_claimed` doing to the store
/// what keeps the lease from being renewed; checks the handler is stopped and requeued
/// before it finishes.
async fn stopped_when_the_lease_runs_out(
    once_claimed: impl Fn(&FaultyStore<MemoryStore>) + Clone + Send + Sync + 'static,
) {
    let q = Queue::new("orders");
    q.publish(Some("cut-off"), b"{}".as_slice());
    let store = FaultyStore::new(MemoryStore::new());
    let consumer = Consumer::new(store.clone()).lease(Duration::from_millis(300));
    let finished = Arc::new(AtomicUsize::new(0));
    let done = finished.clone();
    let handler = move |_m: Message| {
        let (done, store, once_claimed) = (done.clone(), store.clone(), once_claimed.clone());
        async move {
            once_claimed(&store);
            tokio::time::sleep(Duration::from_secs(5)).await;
            done.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(())
        }
    };
    let mut source = q.source();
    let d = source.next().await.expect("open").expect("delivery");
    let outcome = within("the process", consumer.process(&source, d, &handler))
        .await
        .expect("process");
    assert_eq!(outcome, Outcome::Requeued, "stopped and requeued");
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the handler never ran past its lease"
    );
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_panics_before_returning_its_future_is_caught_too() {
    let q = Queue::new("orders");
    q.publish(Some("p-1"), b"{}".as_slice());
    q.publish(None, b"{}".as_slice());
    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let handler = move |m: Message| {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        // In the call itself, as a handler that parses its payload before `async` would.
        assert!(
            n > 1,
            "the first delivery of each message panics: {:?}",
            m.key
        );
        async move { Ok::<_, Failure<String>>("done".to_owned()) }
    };
    let consumer = Consumer::new(MemoryStore::new()).missing_key(MissingKey::RunUnguarded);
    consume_all(&consumer, &q, handler).await;
    assert_eq!(ran.load(Ordering::SeqCst), 4);
    let c = consumer.counts();
    assert_eq!((c.requeued, c.handled), (2, 2));
}

/// An output whose serialization panics: a panic in the run-once engine, outside the
/// handler's future.
struct Unserializable;

impl serde::Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("cannot serialize")
    }
}

impl<'de> serde::Deserialize<'de> for Unserializable {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Ok(Self)
    }
}

#[tokio::test]
async fn a_panic_outside_the_handler_still_settles_the_delivery() {
    let q = Queue::new("orders");
    q.publish(Some("bad-output"), b"{}".as_slice());
    let consumer = Consumer::new(MemoryStore::new()).max_attempts(2);
    let handler = |_m: Message| async { Ok::<_, Failure<String>>(Unserializable) };
    let mut source = q.source();
    let d = source.next().await.expect("open").expect("delivery");
    let outcome = within("the process", consumer.process(&source, d, &handler))
        .await
        .expect("process");
    assert_eq!(outcome, Outcome::Requeued, "settled, not left hanging");
    let d = source.next().await.expect("open").expect("redelivery");
    let outcome = within("the process", consumer.process(&source, d, &handler))
        .await
        .expect("process");
    assert_eq!(
        outcome,
        Outcome::DeadLettered(Reason::AttemptsExhausted),
        "after max_attempts deliveries"
    );
}

/// A process the machine starved past its lease's end (here its clock jumps while the handler
/// runs) still asks the store before it stops the handler: a lease that ran out but that
/// nobody took over is renewed, and the handler finishes.
#[tokio::test]
async fn a_handler_starved_past_its_lease_goes_on_if_nobody_took_the_key() {
    let q = Queue::new("orders");
    q.publish(Some("starved"), b"{}".as_slice());
    let clock = idem::ManualClock::starting_now();
    let store = FaultyStore::new(MemoryStore::new());
    let engine = idem::Idempotency::new(store.clone()).with_clock(clock.clone());
    let consumer = Consumer::with_engine(engine).lease(Duration::from_millis(300));
    let handler = move |_m: Message| {
        let (clock, store) = (clock.clone(), store.clone());
        async move {
            clock.advance(Duration::from_secs(1));
            // The renewal takes a moment, as any over a network does.
            store.fail_next(Op::Renew, Fault::SlowReply(Duration::from_millis(20)));
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok::<_, Failure<String>>(())
        }
    };
    let mut source = q.source();
    let d = source.next().await.expect("open").expect("delivery");
    let outcome = within("the process", consumer.process(&source, d, &handler))
        .await
        .expect("process");
    assert_eq!(outcome, Outcome::Handled);
}
