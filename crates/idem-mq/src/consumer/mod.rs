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
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem::Idempotency;
use idem_core::{Key, Lease, SystemClock};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::source::Reason;

mod counts;
mod decide;
mod keep_alive;
mod run;
mod settings;
mod verdict;

use counts::Counters;
pub use counts::Counts;
pub use settings::DEFAULT_SCOPE;
use settings::Settings;
pub use verdict::{RunEnd, Verdict, verdict};

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
    /// Dead-letter the message now (reason `refused`) without storing the failure: the key is
    /// given back, so the message, moved back to the queue once the cause is mended (a
    /// misconfigured downstream, an outcome someone had to look at), runs again. For failures
    /// that say the effect did not happen here, and that a person must look at.
    DeadLetter(E),
}

impl<E: Display> Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Permanent(e) => write!(f, "permanent: {e}"),
            Failure::Retry(e) | Failure::RetryAfter(e, _) => write!(f, "retryable: {e}"),
            Failure::DeadLetter(e) => write!(f, "refused: {e}"),
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
