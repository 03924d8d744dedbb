//! The source: its builder, the group membership, fetching and committing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaResult;
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use tokio::sync::{Notify, mpsc};

use super::DeadLetterTarget;
use super::delivery::{KafkaDelivery, Record};
use crate::offsets::{Book, Order, Settled, Take, Tp};
use crate::{Horizon, Identity, MqError, Source};

/// Builds a [`KafkaSource`]: the brokers, the group, the topics, and how records run.
#[derive(Debug, Clone)]
pub struct KafkaSourceBuilder {
    brokers: String,
    group: String,
    topics: Vec<String>,
    order: Order,
    max_held: usize,
    commit_interval: Duration,
    dead_letter: DeadLetterTarget,
    max_requeue_delay: Duration,
    produce_timeout: Duration,
    connect_timeout: Duration,
    config: Vec<(String, String)>,
}

impl KafkaSourceBuilder {
    /// Reads `topic` too.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// Which records of a partition may run at once (default [`Order::Partition`]).
    pub fn order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// How many fetched records one partition may hold in memory before it is paused
    /// (default 64, at least 1).
    pub fn max_held(mut self, max: usize) -> Self {
        self.max_held = max.max(1);
        self
    }

    /// How often the done prefix of each partition is committed (default 1 s). A crash
    /// redelivers at most what was done in the last interval; those records are acked from
    /// their stored results.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every.max(Duration::from_millis(10));
        self
    }

    /// Where dead-lettered records go (default [`DeadLetterTarget::TopicDead`]).
    pub fn dead_letter(mut self, target: DeadLetterTarget) -> Self {
        self.dead_letter = target;
        self
    }

    /// The longest delay a requeue may ask for (default 5 minutes); a record waiting that
    /// long holds back its partition's commit (and, in [`Order::Partition`], its partition).
    pub fn max_requeue_delay(mut self, max: Duration) -> Self {
        self.max_requeue_delay = max;
        self
    }

    /// How long the broker may take to reach, at start (default 10 s), and to take a
    /// dead-letter copy (the same).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self.produce_timeout = timeout;
        self
    }

    /// Sets a librdkafka property of the consumer and the dead-letter producer (`security.protocol`,
    /// `sasl.mechanism`, `session.timeout.ms`, `partition.assignment.strategy`…). The
    /// properties that make the offset rule (`enable.auto.commit`,
    /// `enable.auto.offset.store`) cannot be changed.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (k, v) in &self.config {
            config.set(k, v);
        }
        config
    }

    /// Joins the group and subscribes to the topics. Fails when the settings are not valid
    /// or no broker answers within the timeout.
    pub async fn connect(self) -> Result<KafkaSource, MqError> {
        if self.topics.iter().any(String::is_empty) || self.group.is_empty() {
            return Err(MqError::Config(
                "a Kafka source needs a group and topics with names".to_owned(),
            ));
        }
        let book = Arc::new(Mutex::new(Book::new(self.order, self.max_held)));
        let mut config = self.client_config();
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        for (key, value) in [
            ("auto.offset.reset", "earliest"),
            // librdkafka's prefetch queue, one for the whole consumer (its default is 64 MiB).
            ("queued.max.messages.kbytes", "16384"),
        ] {
            if !self.config.iter().any(|(k, _)| k == key) {
                config.set(key, value);
            }
        }
        let closed = Arc::new(AtomicBool::new(false));
        let context = Context {
            book: book.clone(),
            closed: closed.clone(),
        };
        let consumer: StreamConsumer<Context> = config
            .create_with_context(context)
            .map_err(|e| MqError::broker("the Kafka consumer's settings are not valid", e))?;
        let consumer = Arc::new(consumer);
        let probe = consumer.clone();
        let timeout = self.connect_timeout;
        tokio::task::spawn_blocking(move || probe.fetch_metadata(None, timeout))
            .await
            .map_err(|e| MqError::broker("the Kafka metadata request failed", e))?
            .map_err(|e| {
                MqError::broker(
                    format!("cannot reach the Kafka brokers at {}", self.brokers),
                    e,
                )
            })?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| MqError::broker("cannot subscribe to the topics", e))?;
        let producer = match self.dead_letter {
            DeadLetterTarget::CommitOnly => None,
            _ => Some(
                self.client_config()
                    .set("acks", "all")
                    .set("linger.ms", "0")
                    .create()
                    .map_err(|e| MqError::broker("cannot make the dead-letter producer", e))?,
            ),
        };
        let shared = Arc::new(Shared {
            consumer,
            book,
            wake: Notify::new(),
            producer,
            closed,
            dead_letter: self.dead_letter,
            group: self.group.clone(),
            max_requeue_delay: self.max_requeue_delay,
            produce_timeout: self.produce_timeout,
        });
        let (errors_to, errors) = mpsc::channel(16);
        let fetcher = tokio::spawn(fetch(shared.clone(), errors_to, self.commit_interval));
        Ok(KafkaSource {
            name: format!("{}.{}", self.topics.join(","), self.group),
            group: self.group,
            topics: self.topics,
            shared,
            errors,
            fetcher,
            closed: false,
        })
    }
}

/// The group's partitions of one or more topics, their records handed out under the offset
/// and order rules of the [module](super).
pub struct KafkaSource {
    name: String,
    group: String,
    topics: Vec<String>,
    shared: Arc<Shared>,
    errors: mpsc::Receiver<MqError>,
    fetcher: tokio::task::JoinHandle<()>,
    closed: bool,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group", &self.group)
            .field("topics", &self.topics)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// A source for `group` on `topic`, through the brokers `brokers` (`host:port,…`).
    pub fn builder(
        brokers: impl Into<String>,
        group: impl Into<String>,
        topic: impl Into<String>,
    ) -> KafkaSourceBuilder {
        KafkaSourceBuilder {
            brokers: brokers.into(),
            group: group.into(),
            topics: vec![topic.into()],
            order: Order::Partition,
            max_held: 64,
            commit_interval: Duration::from_secs(1),
            dead_letter: DeadLetterTarget::TopicDead,
            max_requeue_delay: Duration::from_secs(300),
            produce_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            config: Vec::new(),
        }
    }

    /// The partitions this member holds now.
    pub fn assigned(&self) -> Vec<(String, i32)> {
        self.shared
            .book()
            .assigned()
            .map(|(t, p)| (t.to_string(), *p))
            .collect()
    }

    /// Commits what is done now, and waits for the broker's answer.
    pub async fn commit(&self) -> Result<(), MqError> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.commit(CommitMode::Sync))
            .await
            .map_err(|e| MqError::broker("the commit failed", e))?
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        self.fetcher.abort();
        // The last word: what was done by now is committed before the group hears the member
        // leave (when the last delivery lets go of the consumer).
        if let Err(e) = self.shared.commit(CommitMode::Sync) {
            tracing::warn!(source = %self.name, error = %e, "the last commit failed");
        }
    }
}

impl Source for KafkaSource {
    type Delivery = KafkaDelivery;

    fn name(&self) -> &str {
        &self.name
    }

    fn identity(&self) -> Identity<'_> {
        let mut topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        topics.sort_unstable();
        topics.dedup();
        Identity::new("kafka", std::iter::once(self.group.as_str()).chain(topics))
    }

    async fn next(&mut self) -> Option<Result<KafkaDelivery, MqError>> {
        loop {
            if self.closed {
                return None;
            }
            if let Ok(e) = self.errors.try_recv() {
                return Some(Err(e));
            }
            let take = {
                let mut book = self.shared.book();
                let take = book.take(Instant::now());
                self.shared.flow(&mut book);
                take
            };
            let due = match take {
                Take::Ready(handout) => {
                    return Some(Ok(KafkaDelivery::new(handout, self.shared.clone())));
                }
                Take::Wait(due) => due,
            };
            let retry = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.shared.wake.notified() => {}
                () = retry => {}
                Some(e) = self.errors.recv() => return Some(Err(e)),
            }
        }
    }

    fn redelivery_horizon(&self) -> Horizon {
        Horizon::Unbounded
    }

    async fn close(&mut self) {
        self.closed = true;
        // Nothing more is fetched (partitions assigned from now on are paused too); what was
        // held and not handed out is left for whoever reads the partitions next (it is not
        // committed). Records still running settle and are committed until the source is
        // dropped.
        self.shared.closed.store(true, Ordering::Relaxed);
        let book = self.shared.book();
        let assigned: Vec<Tp> = book.assigned().cloned().collect();
        pause_or_resume(&self.shared.consumer, &assigned, true);
    }
}

/// What the source, its fetcher and its deliveries share.
pub(crate) struct Shared {
    consumer: Arc<StreamConsumer<Context>>,
    book: Arc<Mutex<Book<Record>>>,
    wake: Notify,
    /// Set at close: nothing more is fetched.
    closed: Arc<AtomicBool>,
    producer: Option<FutureProducer>,
    pub(super) dead_letter: DeadLetterTarget,
    pub(super) group: String,
    pub(super) max_requeue_delay: Duration,
    pub(super) produce_timeout: Duration,
}

impl Shared {
    fn book(&self) -> MutexGuard<'_, Book<Record>> {
        // The book's methods do not panic midway; a poisoned lock holds a consistent book.
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn producer(&self) -> Result<&FutureProducer, MqError> {
        self.producer
            .as_ref()
            .ok_or_else(|| MqError::Config("this source produces no dead-letter copies".to_owned()))
    }

    /// A delivery ended: into the book, and the source woken if it waits.
    pub(super) fn settle(&self, tp: &Tp, generation: u64, offset: i64, how: Settled<Record>) {
        self.book().settle(tp, generation, offset, how);
        self.wake.notify_one();
    }

    /// Pauses and resumes partitions as the book asks. Called with the book locked, so that
    /// what librdkafka is told follows the book's own order, and never lands on a later
    /// assignment of a partition (rebalances take the lock too).
    fn flow(&self, book: &mut Book<Record>) {
        let (pause, resume) = book.flow();
        pause_or_resume(&self.consumer, &pause, true);
        if !self.closed.load(Ordering::Relaxed) {
            pause_or_resume(&self.consumer, &resume, false);
        }
    }

    /// Commits each partition up to its first record not done, where that moved.
    fn commit(&self, mode: CommitMode) -> Result<(), MqError> {
        let moved = self.book().to_commit();
        if moved.is_empty() {
            return Ok(());
        }
        let tpl = positions(&moved);
        self.consumer.commit(&tpl, mode).map_err(|e| {
            let mut book = self.book();
            for (tp, at) in &moved {
                book.uncommitted(tp, *at);
            }
            MqError::broker("cannot commit the offsets", e)
        })
    }
}

/// Pauses (or resumes) fetching from `partitions`; librdkafka only queues the change.
fn pause_or_resume<C: ConsumerContext>(
    consumer: &StreamConsumer<C>,
    partitions: &[Tp],
    pause: bool,
) {
    if partitions.is_empty() {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    for (topic, partition) in partitions {
        tpl.add_partition(topic, *partition);
    }
    let done = if pause {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    };
    if let Err(e) = done {
        tracing::warn!(error = %e, pause, "cannot pause or resume partitions");
    }
}

fn positions(moved: &[(Tp, i64)]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), at) in moved {
        // The offsets come from fetched records: they are in range.
        let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(*at));
    }
    tpl
}

/// Fetches records into the book, and commits on a timer, until the source is dropped. The
/// group's rebalances run in here too (inside `recv`).
async fn fetch(shared: Arc<Shared>, errors: mpsc::Sender<MqError>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            got = shared.consumer.recv() => match got {
                Ok(message) => {
                    let tp: Tp = (Arc::from(message.topic()), message.partition());
                    let record = Record::of(&message);
                    let offset = message.offset();
                    drop(message);
                    {
                        let mut book = shared.book();
                        let key = record.key.clone();
                        book.push(&tp, offset, key, record);
                        shared.flow(&mut book);
                    }
                    shared.wake.notify_one();
                }
                Err(e) => {
                    let _ = errors.try_send(MqError::broker("cannot receive from Kafka", e));
                }
            },
            _ = tick.tick() => {
                if let Err(e) = shared.commit(CommitMode::Async) {
                    tracing::warn!(error = %e, "cannot commit the offsets; trying again");
                }
            }
        }
    }
}

/// The consumer's context: the book's side of a rebalance, and failed commits.
struct Context {
    book: Arc<Mutex<Book<Record>>>,
    closed: Arc<AtomicBool>,
}

impl Context {
    fn book(&self) -> MutexGuard<'_, Book<Record>> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let tpl = match rebalance {
            Rebalance::Revoke(tpl) => tpl,
            Rebalance::Error(e) => {
                // librdkafka gives every partition up: so does the book, committing nothing
                // (another member may own them now).
                tracing::warn!(error = %e, "the group's rebalance failed; partitions dropped");
                self.book().revoke_all();
                return;
            }
            Rebalance::Assign(_) => return,
        };
        let moved: Vec<(Tp, i64)> = {
            let mut book = self.book();
            tpl.elements()
                .into_iter()
                .filter_map(|e| {
                    let tp: Tp = (Arc::from(e.topic()), e.partition());
                    book.revoke(&tp).map(|at| (tp, at))
                })
                .collect()
        };
        if moved.is_empty() || consumer.assignment_lost() {
            return;
        }
        // Before the partitions go: the next owner starts where this one got to.
        if let Err(e) = consumer.commit(&positions(&moved), CommitMode::Sync) {
            tracing::warn!(error = %e, "cannot commit revoked partitions; their done records run again elsewhere, from their stored results");
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let mut book = self.book();
            for e in tpl.elements() {
                book.assign((Arc::from(e.topic()), e.partition()));
            }
            // A partition paused before it was revoked stays paused in librdkafka when it
            // comes back, while the book starts it afresh: resume it (or pause it, once the
            // source is closed).
            let done = if self.closed.load(Ordering::Relaxed) {
                consumer.pause(tpl)
            } else {
                consumer.resume(tpl)
            };
            if let Err(e) = done {
                tracing::warn!(error = %e, "cannot resume the assigned partitions");
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            tracing::warn!(error = %e, "a commit failed; trying again");
            let mut book = self.book();
            for elem in offsets.elements() {
                if let Offset::Offset(at) = elem.offset() {
                    book.uncommitted(&(Arc::from(elem.topic()), elem.partition()), at);
                }
            }
        }
    }
}
