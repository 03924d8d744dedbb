//! The consumer engine over RabbitMQ.

use super::*;
use idem_testkit::Op;

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
    let publish = |i: usize| {
        let (publisher, queue) = (&publisher, &queue);
        async move {
            publisher
                .publish_once(
                    "",
                    queue,
                    &format!("m-{i}"),
                    b"x",
                    BasicProperties::default(),
                )
                .await
                .expect("publish");
        }
    };
    let mut published = 0u64;
    for i in 0..N {
        let copies = if twice(i) { 2 } else { 1 };
        for _ in 0..copies {
            publish(i).await;
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
        publish(i).await;
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

/// A queue of another broker with the RabbitMQ queue's name (what the default namespace once
/// was for both) settles its messages first, on the same store, with the same ids and
/// payloads: the RabbitMQ consumer still runs every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_of_another_broker_named_alike_never_lends_its_records() {
    let Some((url, queue, _cleanup)) = setup("alike", QueueType::Quorum).await else {
        return;
    };
    const N: usize = 5;
    let store = MemoryStore::new();
    let other = idem_mq::memory::Queue::new(queue.clone());
    let source = AmqpSource::builder(&url, &queue)
        .connect()
        .await
        .expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    for i in 0..N {
        let id = format!("m-{i}");
        other.publish(Some(&id), "x");
        publisher
            .publish_once("", &queue, &id, b"x", BasicProperties::default())
            .await
            .expect("publish");
    }
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = {
        let ran = ran.clone();
        move |_: Message| {
            ran.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok::<_, Failure<String>>(()))
        }
    };
    let first = Consumer::new(store.clone());
    within(
        "the other queue drains",
        first.run(other.source(), handler.clone(), other.clone().drained()),
    )
    .await
    .expect("run");
    assert_eq!(ran.load(Ordering::SeqCst), N);

    let consumer = Consumer::new(store);
    let counts = consumer.clone();
    let timed_out = Arc::new(AtomicBool::new(false));
    let shutdown = when(
        move || {
            let c = counts.counts();
            c.handled + c.replayed >= N as u64
        },
        timed_out.clone(),
    );
    consumer.run(source, handler, shutdown).await.expect("run");
    assert!(!timed_out.load(Ordering::SeqCst), "every message settled");
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2 * N,
        "the RabbitMQ consumer ran every id"
    );
    assert_eq!(consumer.counts().replayed, 0);
}

/// One message whose store fails `op` `times` in a row: requeued, delivered again by the
/// broker, then acked, leaving nothing in the queue (see [`store_failure_requeues`]).
async fn a_store_failure_requeues(prefix: &str, op: Op, times: usize, ran_first: u32) {
    let Some((url, queue, _cleanup)) = setup(prefix, QueueType::Quorum).await else {
        return;
    };
    let mut source = AmqpSource::connect(&url, &queue).await.expect("source");
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    publisher
        .publish_once("", &queue, "k-store", b"x", BasicProperties::default())
        .await
        .expect("publish");
    store_failure_requeues(&mut source, "k-store", (op, times), ran_first, async || {}).await;
    source.shutdown().await;
    assert_eq!(depth(&url, &queue).await, 0, "acked, nothing left");
}

/// The store fails to take a handled message's result: the message is requeued, never acked;
/// once the record's lease has ended, the redelivery runs it again and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_did_not_take_is_requeued_never_acked() {
    a_store_failure_requeues("not-taken", Op::Complete, 3, 1).await;
}

/// The store fails the claim: nothing runs, the message is requeued, and its redelivery runs
/// once and is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_store_failed_runs_nothing_and_is_requeued() {
    a_store_failure_requeues("no-claim", Op::Begin, 1, 0).await;
}
