//! The consumer: for each delivery, claim its key, run the handler, store the result, then
//! settle the delivery with the broker.
//!
//! The order is what makes a redelivery harmless (docs/design.md, "Message consumers"):
//!
//! 1. **Claim** the key (`begin`). A stored result means the message was handled before and
//!    only its ack was lost: it is acked (or dead-lettered again, for a stored permanent
//!    failure) without running. A key held by a running attempt (a redelivery that reached a
//!    second consumer) is waited for a bounded time, then requeued with a delay.
//! 2. **Run** the handler, renewing the record's lease and telling the broker the message is in
//!    progress, so that neither the record nor the broker's timer gives it to someone else.
//! 3. **Store** the result (a success, or a permanent failure) in the record.
//! 4. **Settle**: ack, or dead-letter a permanent failure. A retryable failure or a panic gives
//!    the key back and requeues the message with backoff; after `max_attempts` runs it is
//!    dead-lettered.

use std::fmt::{self, Display};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use idem::{Idempotency, InFlight, RunError};
use idem_core::{
    ClientKey, Clock, DEFAULT_LEASE, DEFAULT_TTL, Fingerprint, Key, Lease, LeaseError, Namespace,
    Scope, Store, SystemClock,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::MqError;
use crate::key::KeyFrom;
use crate::source::{DeadLetter, Delivery, Disposition, Horizon, Reason, Source};

/// A message as the handler sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The record key it runs under (`None` for a message without a key that is run
    /// unguarded, see [`MissingKey::RunUnguarded`]).
    pub key: Option<Key>,
    /// The lease of this attempt. Its `fence` grows with every attempt that takes the key, so
    /// a downstream write can refuse an attempt that is no longer the holder (`idem-guard`).
    pub lease: Option<Lease>,
    /// The body.
    pub payload: Bytes,
    /// The publisher's message id.
    pub message_id: Option<String>,
    /// Which run of its key this is (1 on the first): the attempts that took the key before
    /// failed in a retryable way or died while running. For a message run without a key, the
    /// broker's delivery count (1 if it does not count).
    pub attempt: u32,
}

impl Message {
    /// The fence of this attempt's lease, if the message runs under a key.
    pub fn fence(&self) -> Option<u64> {
        self.lease.map(|l| l.fence)
    }
}

/// How a handler failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure<E> {
    /// Retrying will not help (a malformed order, an unknown account): the failure is stored
    /// as the message's result, every redelivery gets it without running, and the message is
    /// dead-lettered.
    Permanent(E),
    /// Retrying may help (a database outage): the key is given back and the message requeued
    /// with backoff, up to the consumer's `max_attempts`.
    Retry(E),
    /// Like [`Failure::Retry`], not before this long (a downstream's `Retry-After`); the
    /// delay is bounded by the consumer's backoff maximum.
    RetryAfter(E, Duration),
}

impl<E: Display> Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Permanent(e) => write!(f, "permanent: {e}"),
            Failure::Retry(e) | Failure::RetryAfter(e, _) => write!(f, "retryable: {e}"),
        }
    }
}

/// What handles a message. Implemented by every `Fn(Message) -> impl Future<Output =
/// Result<T, Failure<E>>>`; the value and a permanent error are stored, so they are
/// serialisable.
pub trait Handler: Send + Sync + 'static {
    /// The result stored for the message.
    type Output: Serialize + DeserializeOwned + Send + 'static;
    /// The error; a permanent one is stored.
    type Error: Serialize + DeserializeOwned + Display + Send + 'static;

    /// Handles one message.
    fn handle(
        &self,
        message: Message,
    ) -> impl Future<Output = Result<Self::Output, Failure<Self::Error>>> + Send;
}

impl<F, Fut, T, E> Handler for F
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, Failure<E>>> + Send,
    T: Serialize + DeserializeOwned + Send + 'static,
    E: Serialize + DeserializeOwned + Display + Send + 'static,
{
    type Output = T;
    type Error = E;

    fn handle(&self, message: Message) -> impl Future<Output = Result<T, Failure<E>>> + Send {
        self(message)
    }
}

/// What to do with a message that carries no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Dead-letter it with the reason `no_key` (the default): without a key, a redelivery
    /// cannot be told from a new message.
    #[default]
    DeadLetter,
    /// Run it without a record, at least once (counted as `unguarded`).
    RunUnguarded,
}

/// What became of one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and succeeded; the message was acked.
    Handled,
    /// The result was stored before: the message was acked without running.
    Replayed,
    /// The message was requeued (a retryable failure, a key held by a running attempt, a
    /// store that failed).
    Requeued,
    /// The message went to the dead letter.
    DeadLettered(Reason),
    /// The broker refused the ack, requeue or dead-letter (a lost connection): the broker
    /// delivers the message again, and its record decides what that delivery does.
    Unsettled,
}

impl Outcome {
    /// The metric label: `handled`, `replayed`, `requeued`, `dead_lettered`, `unsettled`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Handled => "handled",
            Outcome::Replayed => "replayed",
            Outcome::Requeued => "requeued",
            Outcome::DeadLettered(_) => "dead_lettered",
            Outcome::Unsettled => "unsettled",
        }
    }
}

/// Counts of outcomes since the consumer was built (shared by its clones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Deliveries received.
    pub received: u64,
    /// Handled and acked.
    pub handled: u64,
    /// Acked without running.
    pub replayed: u64,
    /// Requeued.
    pub requeued: u64,
    /// Dead-lettered.
    pub dead_lettered: u64,
    /// Run without a record (no key, [`MissingKey::RunUnguarded`]).
    pub unguarded: u64,
    /// Not settled with the broker.
    pub unsettled: u64,
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    handled: AtomicU64,
    replayed: AtomicU64,
    requeued: AtomicU64,
    dead_lettered: AtomicU64,
    unguarded: AtomicU64,
    unsettled: AtomicU64,
}

#[derive(Debug, Clone)]
struct Settings {
    key: KeyFrom,
    scope: String,
    namespace: Option<String>,
    fingerprint: bool,
    missing_key: MissingKey,
    max_attempts: u32,
    backoff_first: Duration,
    backoff_max: Duration,
    lease: Duration,
    ttl: Duration,
    wait_in_flight: Duration,
    concurrency: usize,
    drain: Duration,
}

/// A message consumer that runs each message's handler once per key.
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_mq::{Consumer, Failure, Message, memory::Queue};
///
/// let queue = Queue::new("orders");
/// queue.publish(Some("order-1"), b"{\"sku\":7}".as_slice());
/// queue.publish(Some("order-1"), b"{\"sku\":7}".as_slice()); // published twice
///
/// let consumer = Consumer::new(idem::MemoryStore::new());
/// let handler = |msg: Message| async move {
///     // deduct stock for msg.payload ...
///     Ok::<_, Failure<String>>(msg.payload.len())
/// };
/// consumer.run(queue.source(), handler, queue.drained()).await?;
/// let counts = consumer.counts();
/// assert_eq!((counts.handled, counts.replayed), (1, 1));
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone)]
pub struct Consumer<S, C = SystemClock> {
    idem: Idempotency<S, C>,
    settings: Arc<Settings>,
    counters: Arc<Counters>,
}

impl<S: Store + Clone> Consumer<S> {
    /// A consumer keeping its records in `store`, with the defaults: the key is the message
    /// id, the namespace the source's name (the queue, or `<stream>.<consumer>`), the scope `mq`; payloads are not
    /// fingerprinted; a message without a key is dead-lettered; five deliveries at most;
    /// backoff from 1 s doubling to 5 min; a 60 s lease, renewed while the handler runs; a
    /// 24 h TTL; a key held by another attempt waited for 5 s; 64 handlers at once; 30 s to
    /// finish running handlers at shutdown.
    pub fn new(store: S) -> Self {
        Self::with_engine(Idempotency::new(store))
    }
}

impl<S: Store + Clone, C: Clock + Clone> Consumer<S, C> {
    /// A consumer over an existing engine (and its clock).
    pub fn with_engine(idem: Idempotency<S, C>) -> Self {
        Self {
            idem,
            settings: Arc::new(Settings {
                key: KeyFrom::MessageId,
                scope: "mq".into(),
                namespace: None,
                fingerprint: false,
                missing_key: MissingKey::DeadLetter,
                max_attempts: 5,
                backoff_first: Duration::from_secs(1),
                backoff_max: Duration::from_secs(300),
                lease: DEFAULT_LEASE,
                ttl: DEFAULT_TTL,
                wait_in_flight: Duration::from_secs(5),
                concurrency: 64,
                drain: Duration::from_secs(30),
            }),
            counters: Arc::default(),
        }
    }

    fn set(mut self, f: impl FnOnce(&mut Settings)) -> Self {
        f(Arc::make_mut(&mut self.settings));
        self
    }

    /// Where each message's key comes from (default: the message id).
    pub fn key(self, from: KeyFrom) -> Self {
        self.set(|s| s.key = from)
    }

    /// The records' scope (default `mq`): keys of one scope never meet another's.
    pub fn scope(self, scope: impl Into<String>) -> Self {
        self.set(|s| s.scope = scope.into())
    }

    /// The records' namespace (default: the source's name: the queue, or
    /// `<stream>.<consumer>` on JetStream).
    pub fn namespace(self, namespace: impl Into<String>) -> Self {
        self.set(|s| s.namespace = Some(namespace.into()))
    }

    /// Fingerprint payloads: a message whose key was used with another payload is reported
    /// and dead-lettered (`mismatch`), never given the other payload's result.
    pub fn fingerprint_payload(self, on: bool) -> Self {
        self.set(|s| s.fingerprint = on)
    }

    /// What to do with a message without a key.
    pub fn missing_key(self, what: MissingKey) -> Self {
        self.set(|s| s.missing_key = what)
    }

    /// How many times a message's handler may run before it is dead-lettered
    /// (`attempts_exhausted`); at least 1. Runs are counted by the record (each attempt that
    /// takes the key raises its fence), so a run whose consumer died counts (a message that
    /// crashes its consumer every time ends in the dead letter too), while a redelivery that
    /// only waited for a running attempt, or sat unstarted in a dead consumer's prefetch
    /// buffer, does not. Messages without a key are counted by the broker's deliveries.
    pub fn max_attempts(self, n: u32) -> Self {
        self.set(|s| s.max_attempts = n.max(1))
    }

    /// The requeue delay after the first retryable failure, doubling up to `max`, with
    /// jitter (each delay is drawn between half and all of it).
    pub fn backoff(self, first: Duration, max: Duration) -> Self {
        self.set(|s| {
            s.backoff_first = first;
            s.backoff_max = max.max(first);
        })
    }

    /// The record's lease (default 60 s), renewed at a third of its length while the handler
    /// runs: if the consumer dies, another may take the key over this long after.
    pub fn lease(self, lease: Duration) -> Self {
        self.set(|s| s.lease = lease.max(Duration::from_millis(30)))
    }

    /// How long a result is kept (default 24 h). It must outlive the broker's redelivery
    /// horizon ([`Source::redelivery_horizon`]), or the consumer refuses to start.
    pub fn ttl(self, ttl: Duration) -> Self {
        self.set(|s| s.ttl = ttl)
    }

    /// How long a delivery whose key another attempt holds waits for it (default 5 s) before
    /// it is requeued.
    pub fn wait_in_flight(self, wait: Duration) -> Self {
        self.set(|s| s.wait_in_flight = wait)
    }

    /// How many handlers run at once (default 64; match the source's prefetch).
    pub fn concurrency(self, n: usize) -> Self {
        self.set(|s| s.concurrency = n.max(1))
    }

    /// How long [`Consumer::run`] waits at shutdown for running handlers (default 30 s);
    /// a handler still running then is dropped, its key given back, its message left to the
    /// broker.
    pub fn drain(self, drain: Duration) -> Self {
        self.set(|s| s.drain = drain)
    }

    /// Counts of outcomes so far.
    pub fn counts(&self) -> Counts {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            received: get(&c.received),
            handled: get(&c.handled),
            replayed: get(&c.replayed),
            requeued: get(&c.requeued),
            dead_lettered: get(&c.dead_lettered),
            unguarded: get(&c.unguarded),
            unsettled: get(&c.unsettled),
        }
    }

    /// The namespace records of `source_name` go under, checked.
    fn namespace_for(&self, source_name: &str) -> Result<Namespace, MqError> {
        let name = self.settings.namespace.as_deref().unwrap_or(source_name);
        Namespace::new(name).map_err(|e| {
            MqError::Config(format!(
                "the namespace {name:?} (from {}) is not valid: {e}; set one with `namespace`",
                if self.settings.namespace.is_some() {
                    "the settings"
                } else {
                    "the source's name"
                }
            ))
        })
    }

    /// Checks the settings against the source: a valid scope and namespace, and a record TTL
    /// that outlives the broker's redelivery horizon. [`Consumer::run`] checks this at start
    /// (and warns of a broker that may redeliver without a bound), [`Consumer::process`] on
    /// every call.
    pub fn check<Src: Source>(&self, source: &Src) -> Result<(), MqError> {
        self.context(source).map(|_| ())
    }

    /// Consumes `source` until `shutdown` completes or the source closes: up to
    /// `concurrency` handlers at once. At shutdown it stops taking messages, waits up to the
    /// drain time for running handlers to finish and settle, and returns.
    pub async fn run<Src, H>(
        &self,
        mut source: Src,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), MqError>
    where
        Src: Source,
        H: Handler,
        S: Clone,
    {
        let ctx = Arc::new(self.context(&source)?);
        if source.redelivery_horizon() == Horizon::Unbounded {
            tracing::warn!(
                source = source.name(),
                ttl = ?self.settings.ttl,
                "the broker may redeliver a message at any time: one redelivered after its \
                 record expired runs again; bound how long messages live in the broker, or \
                 raise the record TTL"
            );
        }
        let label = &*ctx.source;
        let handler = Arc::new(handler);
        let slots = Arc::new(tokio::sync::Semaphore::new(self.settings.concurrency));
        let mut running = tokio::task::JoinSet::new();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let slot = tokio::select! {
                biased;
                () = &mut shutdown => break,
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
            };
            let next = tokio::select! {
                biased;
                () = &mut shutdown => break,
                next = source.next() => next,
            };
            match next {
                None => break,
                Some(Err(e)) => {
                    metrics::counter!("idem_mq_source_errors_total", "source" => label.to_owned())
                        .increment(1);
                    tracing::warn!(source = label, error = %e, "cannot receive a message");
                    // Sources reconnect by themselves; this only keeps a source that fails
                    // at once from spinning.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Some(Ok(delivery)) => {
                    let (this, handler, ctx) = (self.clone(), handler.clone(), ctx.clone());
                    running.spawn(async move {
                        let _slot = slot;
                        this.process_in(&ctx, delivery, &*handler).await
                    });
                }
            }
            while running.try_join_next().is_some() {}
        }
        source.close().await;
        let drained = tokio::time::timeout(self.settings.drain, async {
            while let Some(done) = running.join_next().await {
                if let Err(e) = done {
                    tracing::error!(source = label, error = %e, "a consumer task failed");
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                source = label,
                left = running.len(),
                "handlers still running at the end of the drain time are stopped; their \
                 messages are left to the broker"
            );
            running.shutdown().await;
        }
        Ok(())
    }

    /// Handles one delivery of `source` and settles it, for a receive loop of one's own
    /// ([`Consumer::run`] does this for each delivery, several at once).
    pub async fn process<Src: Source, H: Handler>(
        &self,
        source: &Src,
        delivery: Src::Delivery,
        handler: &H,
    ) -> Result<Outcome, MqError> {
        let ctx = self.context(source)?;
        Ok(self.process_in(&ctx, delivery, handler).await)
    }

    /// What every delivery of `source` shares, once the settings are checked against it (see
    /// [`Consumer::check`]).
    fn context<Src: Source>(&self, source: &Src) -> Result<Ctx, MqError> {
        let scope = Scope::new(self.settings.scope.clone())
            .map_err(|e| MqError::Config(format!("the scope is not valid: {e}")))?;
        let namespace = self.namespace_for(source.name())?;
        let ttl = self.settings.ttl;
        if let Horizon::Bounded(h) = source.redelivery_horizon()
            && h > ttl
        {
            return Err(MqError::Config(format!(
                "the record TTL ({ttl:?}) is shorter than the broker's redelivery horizon \
                 ({h:?}): a message redelivered after its record expired would run again; \
                 raise the TTL or lower the broker's redelivery limit"
            )));
        }
        Ok(Ctx {
            source: Arc::from(source.name()),
            scope,
            namespace,
            ack_wait: source.ack_wait(),
        })
    }

    async fn process_in<D: Delivery, H: Handler>(
        &self,
        ctx: &Ctx,
        delivery: D,
        handler: &H,
    ) -> Outcome {
        let source = &*ctx.source;
        self.counters.received.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("idem_mq_received_total", "source" => ctx.source.clone()).increment(1);
        let (disposition, outcome) = self.decide(ctx, &delivery, handler).await;
        let outcome = match delivery.settle(disposition).await {
            Ok(()) => outcome,
            Err(e) => {
                tracing::warn!(source, error = %e, "the broker did not take the settlement; it will redeliver");
                Outcome::Unsettled
            }
        };
        let counter = match outcome {
            Outcome::Handled => &self.counters.handled,
            Outcome::Replayed => &self.counters.replayed,
            Outcome::Requeued => &self.counters.requeued,
            Outcome::DeadLettered(_) => &self.counters.dead_lettered,
            Outcome::Unsettled => &self.counters.unsettled,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let reason = match outcome {
            Outcome::DeadLettered(r) => r.code(),
            _ => "",
        };
        metrics::counter!("idem_mq_messages_total", "source" => ctx.source.clone(),
            "outcome" => outcome.label(), "reason" => reason)
        .increment(1);
        outcome
    }

    /// Decides a delivery's fate, running its handler if it is the one to run.
    async fn decide<D: Delivery, H: Handler>(
        &self,
        ctx: &Ctx,
        delivery: &D,
        handler: &H,
    ) -> (Disposition, Outcome) {
        let s = &*self.settings;
        let attempt = delivery.delivery_count().unwrap_or(1).max(1);
        let Some(found) = s.key.find(delivery) else {
            return match s.missing_key {
                MissingKey::DeadLetter => dead(Reason::NoKey, "the message carries no key"),
                MissingKey::RunUnguarded => self.unguarded(delivery, handler, attempt).await,
            };
        };
        let key = match ClientKey::new(found) {
            Ok(client_key) => Key::new(ctx.scope.clone(), ctx.namespace.clone(), client_key),
            Err(e) => return dead(Reason::InvalidKey, e.to_string()),
        };
        let fingerprint = if s.fingerprint {
            Fingerprint::of_bytes(delivery.payload())
        } else {
            Fingerprint::of_bytes(b"")
        };
        let message = Message {
            key: Some(key.clone()),
            lease: None,
            payload: Bytes::copy_from_slice(delivery.payload()),
            message_id: delivery.message_id().map(str::to_owned),
            attempt,
        };
        let key = &key;
        let result = self
            .idem
            .once(key)
            .fingerprint(fingerprint)
            .lease(s.lease)
            .ttl(s.ttl)
            .in_flight(InFlight::Wait(s.wait_in_flight))
            .permanent_if(|f: &Fault<H::Error>| matches!(f, Fault::Permanent(_)))
            .run(|lease| async move {
                // The fence counts the attempts that took this key: runs that failed in a
                // retryable way, and runs whose consumer died (a crash loop), but not
                // deliveries that only waited for the key or sat in a dead consumer's buffer.
                let run = u32::try_from(lease.fence).unwrap_or(u32::MAX);
                if run > s.max_attempts {
                    return Err(Fault::Exhausted(run - 1));
                }
                let message = Message {
                    lease: Some(lease),
                    attempt: run,
                    ..message
                };
                let renew = self.keep_alive(key, lease, delivery, ctx.ack_wait);
                tokio::select! {
                    done = guarded(run, handler.handle(message)) => done,
                    () = renew => Err(Fault::LeaseLost(run)),
                }
            })
            .await;
        match result {
            Ok(done) if done.replayed => (Disposition::Ack, Outcome::Replayed),
            Ok(_) => (Disposition::Ack, Outcome::Handled),
            Err(RunError::Failed { error, .. }) => self.after_failure(error),
            Err(RunError::InProgress { retry_after }) => {
                requeue(retry_after.clamp(s.backoff_first, s.backoff_max))
            }
            Err(RunError::Mismatch) => dead(
                Reason::Mismatch,
                "the key was used before with another payload",
            ),
            Err(RunError::Codec(e)) => dead(Reason::Undecodable, e.to_string()),
            // The record stays in progress until its lease runs out; a redelivery before then
            // waits, one after it runs the handler again (at least once).
            Err(RunError::NotRecorded(e)) => {
                tracing::warn!(error = %e, "a handled message's result could not be stored");
                requeue(s.lease)
            }
            Err(e) => {
                // The store failed before the claim (nothing ran), or the lease was taken
                // over (another attempt owns the key and settles its own delivery).
                tracing::warn!(error = %e, "a message was not handled; requeued");
                requeue(self.delay_after(attempt))
            }
        }
    }

    /// What follows a run that did not succeed: a permanent failure is dead-lettered; a
    /// retryable one (or a panic) is requeued with backoff until the `max_attempts`-th run.
    fn after_failure<E: Display>(&self, fault: Fault<E>) -> (Disposition, Outcome) {
        let max = self.settings.max_attempts;
        let (detail, run, after) = match fault {
            Fault::Permanent(e) => return dead(Reason::Permanent, e.to_string()),
            Fault::Exhausted(runs) => {
                return dead(
                    Reason::AttemptsExhausted,
                    format!(
                        "its key was taken {runs} times without a result (failures, or \
                         consumers that died while running it); at most {max} are allowed"
                    ),
                );
            }
            Fault::Retry(e, run, after) => (e.to_string(), run, after),
            Fault::Panicked(why, run) => (format!("the handler panicked: {why}"), run, None),
            Fault::LeaseLost(run) => (
                "the lease was lost while the handler ran; it was stopped".to_owned(),
                run,
                None,
            ),
        };
        if run >= max {
            dead(
                Reason::AttemptsExhausted,
                format!("failed {run} times, the last: {detail}"),
            )
        } else {
            let backoff = self.delay_after(run);
            requeue(after.map_or(backoff, |a| a.min(self.settings.backoff_max)))
        }
    }

    /// Runs a message without a key: at least once, no record.
    async fn unguarded<D: Delivery, H: Handler>(
        &self,
        delivery: &D,
        handler: &H,
        attempt: u32,
    ) -> (Disposition, Outcome) {
        self.counters.unguarded.fetch_add(1, Ordering::Relaxed);
        let message = Message {
            key: None,
            lease: None,
            payload: Bytes::copy_from_slice(delivery.payload()),
            message_id: delivery.message_id().map(str::to_owned),
            attempt,
        };
        match guarded(attempt, handler.handle(message)).await {
            Ok(_) => (Disposition::Ack, Outcome::Handled),
            Err(fault) => self.after_failure(fault),
        }
    }

    /// Renews the lease, and tells the broker the message is in progress, while the handler
    /// runs; dropped when the handler finishes. Ends only when the lease is lost: another
    /// attempt took the key over, or the lease ran out while the store could not renew it.
    /// Then the handler is stopped, so that it never runs beside an attempt that may have
    /// taken the key.
    async fn keep_alive<D: Delivery>(
        &self,
        key: &Key,
        lease: Lease,
        delivery: &D,
        ack_wait: Option<Duration>,
    ) {
        let s = &*self.settings;
        let mut every = s.lease / 3;
        if let Some(ack_wait) = ack_wait {
            every = every.min(ack_wait / 3);
        }
        let every = every.max(Duration::from_millis(10));
        let clock = self.idem.clock();
        let mut held_until = lease.expires_at;
        loop {
            let left = held_until.saturating_since(clock.now());
            if left.is_zero() {
                tracing::warn!(
                    "a running message's lease ran out unrenewed; its handler is stopped"
                );
                return;
            }
            tokio::time::sleep(every.min(left)).await;
            // The two heartbeats at once: a slow store does not hold back the broker's.
            let (renewed, progress) = tokio::join!(
                self.idem.store().renew(key, &lease, s.lease, clock.now()),
                delivery.in_progress()
            );
            match renewed {
                Ok(renewed) => held_until = renewed.expires_at,
                Err(LeaseError::Stale(_)) => {
                    tracing::warn!(
                        "a running message's key was taken over; its handler is stopped"
                    );
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "cannot renew a running message's lease"),
            }
            if let Err(e) = progress {
                tracing::debug!(error = %e, "cannot tell the broker a message is in progress");
            }
        }
    }

    /// The requeue delay after the `attempt`-th delivery failed: doubling from the first,
    /// bounded, drawn between half and all of it so that requeued messages spread out.
    fn delay_after(&self, attempt: u32) -> Duration {
        let s = &*self.settings;
        let doubled = s
            .backoff_first
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let full = doubled.min(s.backoff_max);
        let half = full / 2;
        half + full.mul_f64(rand::random::<f64>() * 0.5)
    }
}

/// What every delivery of one source shares.
#[derive(Clone)]
struct Ctx {
    source: Arc<str>,
    scope: Scope,
    namespace: Namespace,
    ack_wait: Option<Duration>,
}

/// Why a run did not succeed, as the run-once engine stores it: only a permanent failure is
/// ever stored (and read back); the other variants give the key back. The numbers say which
/// run it was, or how many runs came before.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Fault<E> {
    Permanent(E),
    #[serde(skip)]
    Retry(E, u32, Option<Duration>),
    #[serde(skip)]
    Panicked(String, u32),
    #[serde(skip)]
    Exhausted(u32),
    #[serde(skip)]
    LeaseLost(u32),
}

/// Runs a handler's future (the `run`-th run of its key), turning a panic into a retryable
/// fault.
async fn guarded<T, E>(
    run: u32,
    work: impl Future<Output = Result<T, Failure<E>>>,
) -> Result<T, Fault<E>> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(Failure::Permanent(e))) => Err(Fault::Permanent(e)),
        Ok(Err(Failure::Retry(e))) => Err(Fault::Retry(e, run, None)),
        Ok(Err(Failure::RetryAfter(e, after))) => Err(Fault::Retry(e, run, Some(after))),
        Err(panic) => Err(Fault::Panicked(
            panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into()),
            run,
        )),
    }
}

fn dead(reason: Reason, detail: impl Into<String>) -> (Disposition, Outcome) {
    (
        Disposition::DeadLetter(DeadLetter {
            reason,
            detail: detail.into(),
        }),
        Outcome::DeadLettered(reason),
    )
}

fn requeue(delay: Duration) -> (Disposition, Outcome) {
    (Disposition::Requeue { delay }, Outcome::Requeued)
}
