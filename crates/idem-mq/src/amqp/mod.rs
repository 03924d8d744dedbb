//! RabbitMQ and other AMQP 0-9-1 brokers, over [`lapin`].
//!
//! [`AmqpSource`] consumes one queue and implements [`Source`](crate::Source); its deliveries
//! ([`AmqpDelivery`]) implement [`Delivery`](crate::Delivery). [`AmqpPublisher`] and [`publish_once`] publish
//! with the message id taken from an idempotency key, persistent, and wait for the broker's
//! publisher confirm.
//!
//! # Topology
//!
//! By default the source declares, idempotently, what it needs (all durable):
//!
//! | name | what |
//! | --- | --- |
//! | `<queue>` | the work queue; a quorum queue by default (`x-queue-type=quorum`), so the broker counts deliveries (`x-delivery-count`); its `x-dead-letter-exchange` is the exchange below |
//! | `<queue>.dlx` | the dead-letter exchange (fanout) |
//! | `<queue>.dead` | the dead-letter queue, bound to it |
//! | `<queue>.delay.<ms>` | one delay queue per delay bucket, declared on first use, of the work queue's type: `x-message-ttl=<ms>`, dead-lettering to the work queue (at least once, for quorum queues) |
//!
//! A declaration with other arguments than an existing queue's is refused by the broker
//! (`PRECONDITION_FAILED`): turn declarations off ([`AmqpSourceBuilder::declare`]) to consume
//! a queue managed elsewhere. The delay queues are declared either way: they are idem's own.
//!
//! # Settling
//!
//! * [`Disposition::Ack`](crate::Disposition::Ack) is a `basic.ack`.
//! * [`Disposition::Requeue`](crate::Disposition::Requeue) publishes a copy of the message (same properties and headers,
//!   persistent, with the attempt header `x-idem-attempt` set to the deliveries so far) to the
//!   delay queue of the smallest bucket at least as long as the delay (to the work queue itself
//!   for a zero delay), waits for the publisher confirm, and only then acks the original. One
//!   delay queue per bucket, rather than one queue with a per-message `expiration`, because
//!   RabbitMQ only expires messages at the head of a queue: a long delay would hold back the
//!   short ones queued behind it. A crash (or a lost connection) between the confirm and the
//!   ack leaves two copies, the original redelivered and the delayed one: a duplicate, which
//!   the idempotency record absorbs like any other. If the copy is not made (its delay queue
//!   cannot be declared, or the copy is not confirmed: a nack, no queue for it, no confirm
//!   within 30 s), the original is given back to the queue at once (`basic.nack` with requeue)
//!   and the settle fails. The copies go out on a channel of their own in confirm mode; a
//!   publish the broker refuses with a channel error (to an exchange that was deleted) closes
//!   it, and the next copy opens another.
//! * [`Disposition::DeadLetter`](crate::Disposition::DeadLetter) publishes a copy to the dead-letter exchange with the headers
//!   `x-idem-reason` ([`Reason::code`](crate::Reason::code)) and `x-idem-detail`, waits for the
//!   confirm, then acks the original. A plain `basic.reject` would dead-letter through the
//!   queue's `x-dead-letter-exchange` too, but cannot add headers, and the reason would be lost.
//!   The same crash window gives, at worst, the message both dead-lettered and redelivered;
//!   the redelivery finds its stored outcome and is dead-lettered again (the dead-letter queue
//!   may then hold two copies).
//!
//! # Delivery count
//!
//! [`Delivery::delivery_count`](crate::Delivery::delivery_count) adds the attempt header of a republished copy to the broker's
//! count of the copy: a quorum queue's `x-delivery-count` plus one, or one for a copy the broker
//! has not delivered before (`redelivered` unset). A classic queue does not count redeliveries
//! after a lost connection: there a redelivered message without a quorum count answers `None`.
//! The consumer counts a message's runs by its record, not by this count (see
//! [`Consumer::max_attempts`](crate::Consumer::max_attempts)); the count matters for
//! messages without a key, which have no record: use a quorum queue so that a crash loop
//! among those is counted too.
//!
//! # Timers
//!
//! AMQP has no progress ack: [`Delivery::in_progress`](crate::Delivery::in_progress) is a no-op. RabbitMQ closes a channel
//! whose delivery stays unacknowledged longer than its `consumer_timeout` (30 minutes by
//! default) and redelivers everything the channel held: a handler must finish well within it.
//! The timeout is a broker setting (`consumer_timeout` in `rabbitmq.conf`); RabbitMQ 3.12 and
//! later also take it per queue from the `x-consumer-timeout` argument
//! ([`AmqpSourceBuilder::consumer_timeout`]).
//!
//! # Redelivery horizon
//!
//! An AMQP queue keeps a message until it is acked, however long no consumer takes it; a
//! delivery limit (`x-delivery-limit` on a quorum queue) bounds how many times it is delivered,
//! not when. So the horizon is [`Horizon::Unbounded`](crate::Horizon::Unbounded): a record whose TTL has passed no longer
//! guards a message that comes back later. An operator who bounds it (a queue
//! `x-message-ttl`, and a bounded number of requeues each with a bounded delay) states the bound
//! with [`AmqpSourceBuilder::redelivery_horizon`].
//!
//! # Reconnection
//!
//! [`Source::next`](crate::Source::next) reconnects by itself after the connection or the channel is lost (a
//! broker restart, a connection closed by an operator), waiting 100 ms, doubling to 5 s between
//! failed attempts, then declares the topology and consumes again. Deliveries handed out on the
//! lost channel cannot be settled any more: their [`Delivery::settle`](crate::Delivery::settle) fails with
//! [`MqError::Broker`], and the broker delivers the messages again.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use lapin::{Channel, Connection};

use crate::MqError;

mod delivery;
mod link;
mod publish;
mod source;
mod topology;

pub use delivery::AmqpDelivery;
pub use lapin;
pub use lapin::BasicProperties;
pub use publish::{AmqpPublisher, publish_once};
pub use source::{AmqpSource, AmqpSourceBuilder};

/// The header a republished copy carries: how many deliveries the message had before the copy.
pub const ATTEMPT_HEADER: &str = "x-idem-attempt";
/// The header a dead-lettered copy carries: the reason's stable code
/// ([`Reason::code`](crate::Reason::code)).
pub const REASON_HEADER: &str = "x-idem-reason";
/// The header a dead-lettered copy carries: the reason as a sentence (at most
/// 4096 bytes; longer details are cut at a character boundary).
pub const DETAIL_HEADER: &str = "x-idem-detail";
/// The longest `x-idem-detail` header, in bytes.
const MAX_DETAIL_BYTES: usize = 4096;
/// The header a quorum queue counts earlier deliveries in.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// The delay buckets, in milliseconds: a requeue waits for the smallest bucket at least as long
/// as its delay (the largest for longer delays).
const DELAY_BUCKETS_MS: &[u64] = &[
    100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000,
    1_800_000, 3_600_000,
];

const DEFAULT_PREFETCH: u16 = 64;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const PERSISTENT: u8 = 2;
/// How long a publish waits for the broker's confirm (a broker short of memory or disk blocks
/// publishers) before it fails: the message may or may not have been taken.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long any other broker operation (connecting, declaring, acking, cancelling, closing)
/// may take before it fails.
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// The kind of queue the source declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A quorum queue (`x-queue-type=quorum`): replicated, and it counts deliveries, so a
    /// message that crashes its consumer again and again is dead-lettered.
    #[default]
    Quorum,
    /// A classic queue: the broker does not count redeliveries after a lost connection.
    Classic,
}

impl QueueType {
    fn argument(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// Opens a channel on `connection`, within [`OP_TIMEOUT`].
async fn open_channel(connection: &Connection) -> Result<Channel, MqError> {
    connection
        .create_channel()
        .bounded("opening a channel")
        .await
}

/// A broker operation with a deadline: lapin can leave an operation unanswered when its
/// connection dies under it, and a consumer must not wait for it forever.
trait Bounded<T>: Future<Output = lapin::Result<T>> + Sized {
    fn bounded(self, what: &'static str) -> BoundedOp<Self> {
        BoundedOp {
            inner: Box::pin(tokio::time::timeout(OP_TIMEOUT, self)),
            what,
        }
    }
}

impl<T, F: Future<Output = lapin::Result<T>>> Bounded<T> for F {}

struct BoundedOp<F> {
    inner: Pin<Box<tokio::time::Timeout<F>>>,
    what: &'static str,
}

impl<T, F: Future<Output = lapin::Result<T>>> Future for BoundedOp<F> {
    type Output = Result<T, MqError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let what = self.what;
        self.inner.as_mut().poll(cx).map(|done| match done {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(MqError::broker(what, e)),
            Err(_) => Err(MqError::Broker {
                message: format!("{what}: no answer from the broker within {OP_TIMEOUT:?}"),
                source: None,
            }),
        })
    }
}
