//! Through the consumer: duplicates, redeliveries to a second instance, poison messages, a
//! server restart.

use super::*;
use idem_testkit::Op;

/// A [`NatsSource`] that counts each message id's deliveries and, with `progress` off, hides
/// the broker's ack timer from the consumer and swallows its progress reports (so the server
/// redelivers a message whose handler outlives `ack_wait`).
struct Observed {
    inner: NatsSource,
    deliveries: Arc<Mutex<HashMap<String, u32>>>,
    progress: bool,
}

impl Observed {
    fn new(inner: NatsSource, deliveries: &Arc<Mutex<HashMap<String, u32>>>) -> Self {
        Self {
            inner,
            deliveries: Arc::clone(deliveries),
            progress: true,
        }
    }

    fn without_progress(mut self) -> Self {
        self.progress = false;
        self
    }
}

struct ObservedDelivery {
    inner: NatsDelivery,
    progress: bool,
}

impl Source for Observed {
    type Delivery = ObservedDelivery;

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn identity(&self) -> idem_mq::Identity<'_> {
        self.inner.identity()
    }

    async fn next(&mut self) -> Option<Result<ObservedDelivery, MqError>> {
        let next = self.inner.next().await?;
        Some(next.map(|inner| {
            if let Some(id) = inner.message_id() {
                *lock(&self.deliveries).entry(id.to_owned()).or_default() += 1;
            }
            ObservedDelivery {
                inner,
                progress: self.progress,
            }
        }))
    }

    fn ack_wait(&self) -> Option<Duration> {
        if self.progress {
            self.inner.ack_wait()
        } else {
            None
        }
    }

    fn redelivery_horizon(&self) -> Horizon {
        self.inner.redelivery_horizon()
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

impl Delivery for ObservedDelivery {
    fn message_id(&self) -> Option<&str> {
        self.inner.message_id()
    }

    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        self.inner.header(name)
    }

    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }

    fn delivery_count(&self) -> Option<u32> {
        self.inner.delivery_count()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        if self.progress {
            self.inner.in_progress().await
        } else {
            Ok(())
        }
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        self.inner.settle(how).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_twice_run_once_per_id() {
    let Some(url) = nats_url() else { return };
    // A window this short lets the second publish of an id through to the consumer, which is
    // what a re-publish after a real two-minute window looks like.
    let streams = Streams::new(&url, |c| c.duplicate_window = Duration::from_millis(100)).await;
    const N: usize = 300;
    let twice: Vec<usize> = (0..N).filter(|i| i % 10 < 3).collect();
    for i in 0..N {
        streams
            .publish(&format!("order-{i}"), Bytes::from(i.to_string()))
            .await;
    }
    for &i in &twice {
        let key = format!("order-{i}");
        within("the duplicate window passes", async {
            // Until the server's window for this id has passed.
            while publish_once(
                &streams.js,
                streams.subject(),
                &key,
                Bytes::from(i.to_string()),
            )
            .await
            .expect("publish again")
            .duplicate
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }

    let deliveries = Arc::default();
    let source = NatsSource::builder(&streams.name, "once")
        .batch(32)
        .max_deliver(20)
        .connect(&url)
        .await
        .expect("source");
    let source = Observed::new(source, &deliveries);
    let consumer = Consumer::new(idem::MemoryStore::new()).concurrency(32);
    let runs = Arc::new(Runs::default());
    let handler = timed_handler(&runs, Duration::from_millis(2));
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(PATIENCE * 2, "every delivery settled", || {
        let c = consumer.counts();
        c.handled + c.replayed >= (N + twice.len()) as u64
    })
    .await;
    stop.notify_one();
    run.await.expect("task").expect("run");

    let deliveries = lock(&deliveries).clone();
    for i in 0..N {
        let id = format!("order-{i}");
        let expected = if twice.contains(&i) { 2 } else { 1 };
        assert!(
            deliveries.get(&id).copied().unwrap_or(0) >= expected,
            "{id} was delivered {:?} times, published {expected}",
            deliveries.get(&id)
        );
        assert_eq!(runs.of(&id), 1, "{id} ran once");
    }
    assert_eq!(runs.ids(), N);
    let c = consumer.counts();
    assert_eq!(c.handled, N as u64);
    assert!(c.replayed >= twice.len() as u64, "{c:?}");
    assert_eq!(*lock(&runs.most_at_once), 1);
    assert_all_settled(&streams, "once").await;
}

/// Each durable consumer of a stream sees every message: two of them (inventory and billing)
/// on one record store each run every id, rather than the second taking the first's records
/// for its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_durable_consumers_of_one_stream_each_run_every_message() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    const N: usize = 20;
    for i in 0..N {
        publish_once(
            &streams.js,
            streams.subject(),
            &format!("order-{i}"),
            "{}".into(),
        )
        .await
        .expect("publish");
    }
    let store = idem::MemoryStore::new();
    for name in ["inventory", "billing"] {
        let source = NatsSource::builder(&streams.name, name)
            .connect(&url)
            .await
            .expect("source");
        let consumer = Consumer::new(store.clone());
        let runs = run_until_settled(&consumer, source, N).await;
        assert_eq!(runs.ids(), N, "{name} ran every id");
        assert_eq!(
            consumer.counts().replayed,
            0,
            "{name} took no other consumer's record"
        );
    }
}

/// A queue of another broker whose name is the stream's and the consumer's joined by a dot
/// (what the default namespace once was for both) settles its messages first, on the same
/// store, with the same ids and payloads: the JetStream consumer still runs every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_of_another_broker_named_alike_never_lends_its_records() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    const N: usize = 5;
    let store = idem::MemoryStore::new();
    let other = idem_mq::memory::Queue::new(format!("{}.billing", streams.name));
    for i in 0..N {
        let id = format!("order-{i}");
        other.publish(Some(&id), "{}");
        publish_once(&streams.js, streams.subject(), &id, "{}".into())
            .await
            .expect("publish");
    }
    let first = Consumer::new(store.clone());
    let runs = Arc::new(Runs::default());
    within(
        "the other queue drains",
        first.run(
            other.source(),
            timed_handler(&runs, Duration::ZERO),
            other.clone().drained(),
        ),
    )
    .await
    .expect("run");
    assert_eq!(first.counts().handled, N as u64);

    let source = NatsSource::builder(&streams.name, "billing")
        .connect(&url)
        .await
        .expect("source");
    let consumer = Consumer::new(store);
    let runs = run_until_settled(&consumer, source, N).await;
    assert_eq!(runs.ids(), N, "the JetStream consumer ran every id");
    assert_eq!(consumer.counts().replayed, 0);
}

/// Two instances on one durable consumer, handlers three times longer than `ack_wait`.
async fn slow_handlers_on_two_instances(progress: bool) {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let name = if progress { "progress" } else { "silent" };
    const N: usize = 4;
    for i in 0..N {
        streams.publish(&format!("slow-{i}"), Bytes::new()).await;
    }
    // Progress goes out every third of it: a stall of over a second and a half would be needed
    // for a redelivery with progress on.
    let ack_wait = Duration::from_secs(2);
    let store = idem::MemoryStore::new();
    let deliveries = Arc::default();
    let runs = Arc::new(Runs::default());
    let mut instances = Vec::new();
    for _ in 0..2 {
        let source = NatsSource::builder(&streams.name, name)
            .ack_wait(ack_wait)
            .batch(N)
            .max_deliver(50)
            .max_requeue_delay(Duration::from_millis(500))
            .connect(&url)
            .await
            .expect("source");
        let mut source = Observed::new(source, &deliveries);
        if !progress {
            source = source.without_progress();
        }
        let consumer = Consumer::new(store.clone())
            .concurrency(N)
            .max_attempts(50)
            .wait_in_flight(Duration::from_millis(300))
            .backoff(Duration::from_millis(100), Duration::from_millis(500));
        let handler = {
            let runs = Arc::clone(&runs);
            move |msg: Message| {
                let runs = Arc::clone(&runs);
                async move {
                    let _run = runs.start(msg.message_id.as_deref().unwrap_or(""));
                    tokio::time::sleep(ack_wait * 3).await;
                    Ok::<_, Failure<String>>(())
                }
            }
        };
        let (stop, shutdown) = shutdown_switch();
        let run = tokio::spawn({
            let consumer = consumer.clone();
            async move { consumer.run(source, handler, shutdown).await }
        });
        instances.push((consumer, stop, run));
    }
    until(PATIENCE * 2, "every message handled", || {
        let handled: u64 = instances.iter().map(|(c, _, _)| c.counts().handled).sum();
        handled >= N as u64
    })
    .await;
    if !progress {
        // The redeliveries settle too (each replayed once the first run stored its result).
        until(PATIENCE * 2, "the redeliveries replayed", || {
            let replayed: u64 = instances.iter().map(|(c, _, _)| c.counts().replayed).sum();
            replayed >= 1
        })
        .await;
    }
    for (_, stop, run) in instances {
        stop.notify_one();
        run.await.expect("task").expect("run");
    }

    let deliveries = lock(&deliveries).clone();
    for i in 0..N {
        let id = format!("slow-{i}");
        assert_eq!(runs.of(&id), 1, "{id} ran once");
        let n = deliveries.get(&id).copied().unwrap_or(0);
        if progress {
            assert_eq!(n, 1, "{id}: with progress reported it is not redelivered");
        } else {
            assert!(n >= 2, "{id}: without progress it is redelivered ({n})");
        }
    }
    assert_eq!(
        *lock(&runs.most_at_once),
        1,
        "never two runs of one id at once"
    );
    assert_all_settled(&streams, name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_progress_a_slow_message_is_not_redelivered() {
    slow_handlers_on_two_instances(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_to_a_second_instance_never_runs_concurrently() {
    slow_handlers_on_two_instances(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_keyless_and_exhausted_messages_reach_the_dead_letter() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let js = &streams.js;
    publish_once(
        js,
        streams.subject(),
        "poison-1",
        Bytes::from_static(b"poison"),
    )
    .await
    .expect("publish");
    publish_once(
        js,
        streams.subject(),
        "flaky-1",
        Bytes::from_static(b"flaky"),
    )
    .await
    .expect("publish");
    publish_once(js, streams.subject(), "fine-1", Bytes::from_static(b"fine"))
        .await
        .expect("publish");
    js.publish(streams.subject(), Bytes::from_static(b"anonymous"))
        .await
        .expect("publish")
        .await
        .expect("ack");

    let source = NatsSource::builder(&streams.name, "dl")
        .max_deliver(10)
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
    until(PATIENCE * 2, "three dead letters and one handled", || {
        let c = consumer.counts();
        c.dead_lettered >= 3 && c.handled >= 1
    })
    .await;
    stop.notify_one();
    run.await.expect("task").expect("run");

    let dead = streams.dead_letters().await;
    let by_reason = |code: &str| -> Vec<&jetstream::message::StreamMessage> {
        dead.iter()
            .filter(|m| header(m, REASON_HEADER) == Some(code))
            .collect()
    };
    assert_eq!(dead.len(), 3, "poison, keyless, exhausted");
    let poison = by_reason("permanent");
    assert_eq!(poison.len(), 1);
    assert_eq!(header(poison[0], MSG_ID_HEADER), Some("poison-1"));
    assert!(header(poison[0], DETAIL_HEADER).is_some_and(|d| d.contains("malformed order")));
    let keyless = by_reason("no_key");
    assert_eq!(keyless.len(), 1);
    assert_eq!(keyless[0].payload.as_ref(), b"anonymous");
    let exhausted = by_reason("attempts_exhausted");
    assert_eq!(exhausted.len(), 1);
    assert_eq!(header(exhausted[0], MSG_ID_HEADER), Some("flaky-1"));
    assert_eq!(
        header(exhausted[0], DELIVERIES_HEADER),
        Some("3"),
        "the server's count"
    );
    assert_eq!(runs.of("poison-1"), 1);
    assert_eq!(
        runs.of("flaky-1"),
        3,
        "one run per delivery, up to max_attempts"
    );
    assert_eq!(runs.of("fine-1"), 1);
    assert_eq!(runs.of(""), 0, "a keyless message does not run");
    assert_all_settled(&streams, "dl").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_runs_each_id_once_across_a_server_restart() {
    let Some(mut server) = OwnServer::start() else {
        return;
    };
    let url = server.url();
    let js = jetstream::new(async_nats::connect(&url).await.expect("connect"));
    js.create_stream(stream::Config {
        name: "RESTARTED".to_owned(),
        subjects: vec!["RESTARTED.in".to_owned()],
        ..Default::default()
    })
    .await
    .expect("stream");
    const BEFORE: usize = 200;
    const AFTER: usize = 100;
    for i in 0..BEFORE {
        publish_once(&js, "RESTARTED.in", &format!("r-{i}"), Bytes::new())
            .await
            .expect("publish");
    }
    let source = NatsSource::builder("RESTARTED", "through")
        .dead_letter(DeadLetterTarget::TermOnly)
        .ack_wait(Duration::from_secs(2))
        .max_deliver(100)
        .batch(4)
        .retry_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .connect(&url)
        .await
        .expect("source");
    let consumer = Consumer::new(idem::MemoryStore::new())
        .concurrency(4)
        .max_attempts(50)
        .backoff(Duration::from_millis(50), Duration::from_millis(500));
    let runs = Arc::new(Runs::default());
    let handler = timed_handler(&runs, Duration::from_millis(30));
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(PATIENCE, "some handled before the restart", || {
        consumer.counts().handled >= 40
    })
    .await;

    let at_restart = consumer.counts().handled;
    server.restart();

    tokio::time::timeout(PATIENCE * 2, async {
        for i in 0..AFTER {
            let key = format!("r-{}", BEFORE + i);
            while publish_once(&js, "RESTARTED.in", &key, Bytes::new())
                .await
                .is_err()
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    })
    .await
    .expect("publish after the restart");
    until(PATIENCE * 2, "every id ran", || {
        runs.ids() == BEFORE + AFTER
    })
    .await;
    let settled = || async {
        let info = js
            .get_stream("RESTARTED")
            .await
            .ok()?
            .consumer_info("through")
            .await
            .ok()?;
        Some(info.num_pending == 0 && info.num_ack_pending == 0)
    };
    tokio::time::timeout(PATIENCE * 2, async {
        while settled().await != Some(true) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("every message settled after the restart");
    stop.notify_one();
    run.await.expect("task").expect("run");

    for i in 0..BEFORE + AFTER {
        assert_eq!(runs.of(&format!("r-{i}")), 1, "r-{i} ran once");
    }
    assert_eq!(*lock(&runs.most_at_once), 1);
    assert!(
        at_restart < BEFORE as u64,
        "the restart came in the middle of the run ({at_restart} handled)"
    );
}

/// One message whose store fails `op` `times` in a row: requeued, delivered again by the
/// server, then acked, leaving nothing pending (see [`store_failure_requeues`]).
async fn a_store_failure_requeues(op: Op, times: usize, ran_first: u32) {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    streams.publish("order-1", Bytes::from_static(b"{}")).await;
    let mut source = NatsSource::builder(&streams.name, "faulty")
        .connect(&url)
        .await
        .expect("source");
    store_failure_requeues(&mut source, "order-1", (op, times), ran_first, async || {}).await;
    assert_all_settled(&streams, "faulty").await;
}

/// The store fails to take a handled message's result: the message is requeued, never acked;
/// once the record's lease has ended, the redelivery runs it again and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_did_not_take_is_requeued_never_acked() {
    a_store_failure_requeues(Op::Complete, 3, 1).await;
}

/// The store fails the claim: nothing runs, the message is requeued, and its redelivery runs
/// once and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_store_failed_runs_nothing_and_is_requeued() {
    a_store_failure_requeues(Op::Begin, 1, 0).await;
}
