//! What a broker adapter provides: a [`Source`] of [`Delivery`]s, and for each delivery a way
//! to tell the broker what became of it ([`Disposition`]).
//!
//! The consumer ([`crate::Consumer`]) is written once against these traits; the AMQP and NATS
//! adapters, and the in-process [`crate::memory`] queue used in tests, implement them.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::MqError;

/// One delivery of a message, held until it is settled.
///
/// A delivery is settled exactly once, by [`Delivery::settle`]; an adapter whose delivery is
/// dropped unsettled (the consumer's task was cancelled) leaves it to the broker, which
/// redelivers it when the channel closes or its ack timer fires.
pub trait Delivery: Send + Sync + 'static {
    /// The message id the publisher set (AMQP `message_id`; the `Nats-Msg-Id` header).
    fn message_id(&self) -> Option<&str>;

    /// The value of header `name`, as text (`None` if absent or not representable as text).
    fn header(&self, name: &str) -> Option<Cow<'_, str>>;

    /// The message body.
    fn payload(&self) -> &[u8];

    /// How many times the broker has delivered this message, this delivery included (1 on the
    /// first), when the broker counts (JetStream's `num_delivered`; a quorum queue's
    /// `x-delivery-count` plus one; an adapter's own attempt header). `None` when it does not:
    /// then only the consumer's own requeues are counted.
    fn delivery_count(&self) -> Option<u32>;

    /// Tells the broker the message is still being worked on, so that its redelivery timer
    /// starts again (JetStream `+WPI`). A no-op where the broker has no such timer.
    fn in_progress(&self) -> impl Future<Output = Result<(), MqError>> + Send;

    /// Settles the delivery: ack it, requeue it after a delay, or dead-letter it.
    fn settle(self, how: Disposition) -> impl Future<Output = Result<(), MqError>> + Send;
}

/// Where deliveries come from: a queue, or a durable JetStream consumer.
pub trait Source: Send + 'static {
    /// The deliveries this source hands out.
    type Delivery: Delivery;

    /// The source's name, the default namespace of the records: what competing consumers
    /// share and nobody else (a queue's name; `<stream>.<consumer>` on JetStream, where each
    /// durable consumer sees every message).
    fn name(&self) -> &str;

    /// The next delivery; `None` once the source is closed for good. A source reconnects by
    /// itself after the broker restarts; an `Err` is reported (logged and counted) and the
    /// consumer asks again.
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Delivery, MqError>>> + Send;

    /// How long the broker waits for an ack before it redelivers, if it has such a timer
    /// (JetStream's `ack_wait`). The consumer reports progress at a third of it while a
    /// handler runs.
    fn ack_wait(&self) -> Option<Duration> {
        None
    }

    /// How long after its first delivery the broker may still deliver a message again. A
    /// record must be kept at least this long, or a late redelivery would run its work again;
    /// the consumer refuses to start with a shorter TTL.
    fn redelivery_horizon(&self) -> Horizon {
        Horizon::Unknown
    }

    /// Stops taking new messages (graceful shutdown). Deliveries already handed out can still
    /// be settled.
    fn close(&mut self) -> impl Future<Output = ()> + Send;
}

/// How long a broker may redeliver a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Horizon {
    /// At most this long after the first delivery.
    Bounded(Duration),
    /// Without a bound (unlimited redeliveries): records are then kept for their TTL, and a
    /// message redelivered after that runs again. Logged at start.
    Unbounded,
    /// The adapter cannot tell.
    Unknown,
}

/// What becomes of a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Done with: the broker forgets the message.
    Ack,
    /// Deliver it again, not before `delay` (AMQP: a delay queue or a timed requeue; NATS:
    /// `nak` with a delay).
    Requeue {
        /// How long to wait before the next delivery.
        delay: Duration,
    },
    /// Give up on it: to the dead letter (AMQP: the queue's dead-letter exchange; NATS:
    /// `term`), with the reason.
    DeadLetter(DeadLetter),
}

/// Why a message went to the dead letter, with a stable code for machines and a sentence for
/// people. Neither holds the key or the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Why.
    pub reason: Reason,
    /// The sentence: for [`Reason::Permanent`] and [`Reason::Refused`] the handler's error as
    /// text, else a description of the reason.
    pub detail: String,
}

/// The reasons a message is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// It carries no key where the consumer looks for one.
    NoKey,
    /// Its key is not a valid key (empty, too long, characters outside visible ASCII).
    InvalidKey,
    /// Its key was used before with another payload (payload fingerprints on).
    Mismatch,
    /// The handler failed permanently (now, or in an earlier delivery whose failure is stored).
    Permanent,
    /// The handler dead-lettered it without storing a failure ([`Failure::DeadLetter`]):
    /// moved back to the queue, it runs again.
    ///
    /// [`Failure::DeadLetter`]: crate::Failure::DeadLetter
    Refused,
    /// It failed in a retryable way as many times as allowed.
    AttemptsExhausted,
    /// Its stored result cannot be read back, or its result could not be stored.
    Undecodable,
}

impl Reason {
    /// The stable code (`no_key`, `invalid_key`, `mismatch`, `permanent`, `refused`,
    /// `attempts_exhausted`, `undecodable`): the AMQP header and the NATS term reason carry it.
    pub fn code(self) -> &'static str {
        match self {
            Reason::NoKey => "no_key",
            Reason::InvalidKey => "invalid_key",
            Reason::Mismatch => "mismatch",
            Reason::Permanent => "permanent",
            Reason::Refused => "refused",
            Reason::AttemptsExhausted => "attempts_exhausted",
            Reason::Undecodable => "undecodable",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

impl fmt::Display for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}
