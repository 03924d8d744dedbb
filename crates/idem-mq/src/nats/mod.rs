//! NATS JetStream: a durable pull consumer as a [`Source`](crate::Source), and publishing with `Nats-Msg-Id`.
//!
//! [`NatsSource`] pulls from a durable consumer with explicit acks. A message's id (the
//! consumer's default key) is its `Nats-Msg-Id` header; its delivery count is JetStream's own
//! `num_delivered`, so a consumer that crashes in a loop on one message still sees the count
//! rise and dead-letters it.
//!
//! | disposition | what the broker is told |
//! | --- | --- |
//! | [`Disposition::Ack`](crate::Disposition::Ack) | `+ACK`, confirmed by the server when [`NatsSourceBuilder::confirm_acks`] is on (the default) |
//! | [`Disposition::Requeue`](crate::Disposition::Requeue) | `-NAK {"delay": …}`: redelivered after the delay |
//! | [`Disposition::DeadLetter`](crate::Disposition::DeadLetter) | a copy published to the dead-letter subject with the reason, then `+TERM` |
//!
//! # Two duplicate filters, and what each one catches
//!
//! JetStream drops a publish whose `Nats-Msg-Id` it has seen on the same stream within the
//! stream's `duplicate_window` (two minutes unless configured). [`publish_once`] sets that
//! header from the idempotency key, so a publisher that retries after a lost publish ack does
//! not store the message twice. The window is short by design: the server keeps every id of
//! the window in memory.
//!
//! idem's records sit on the consumer side and live for hours or days (their TTL). They catch
//! what the window cannot: every redelivery of one stored message (a lost ack, an ack timer
//! that fired, a consumer that crashed mid-handler), and a re-publish of the same key after
//! the window closed (a publisher replaying its outbox the next morning). Use both: the window
//! keeps the stream small, the records make the handler's effect happen once.
//!
//! # Redelivery horizon
//!
//! [`Source::redelivery_horizon`](crate::Source::redelivery_horizon) is how long after a delivery JetStream may still deliver the
//! same message again; the consumer refuses to run with a record TTL shorter than it. With a
//! finite `max_deliver` the adapter reports
//! `(max_deliver - 1) × (longest ack wait + longest requeue delay)`, where the longest ack
//! wait is the larger of `ack_wait` and the consumer's `backoff` steps and the longest requeue
//! delay is [`NatsSourceBuilder::max_requeue_delay`] (requeue delays are clamped to it, so the
//! bound holds). It counts from the moment a delivery ends (settled or timed out): the time a
//! handler runs while reporting progress is not in it, and neither is time during which no
//! instance pulls from the consumer (a message waits for a puller, then comes back). With
//! `max_deliver` unlimited (`-1`, JetStream's default) the horizon is
//! [`Horizon::Unbounded`](crate::Horizon::Unbounded).

use std::time::Duration;

mod delivery;
mod publish;
mod source;

pub use delivery::NatsDelivery;
pub use publish::{Published, publish_once, publish_once_with_headers};
pub use source::{NatsSource, NatsSourceBuilder};

/// Header carrying [`crate::Reason::code`] on a dead-lettered copy.
pub const REASON_HEADER: &str = "Idem-Reason";
/// Header carrying the sentence of a [`DeadLetter`](crate::DeadLetter) on a dead-lettered copy.
pub const DETAIL_HEADER: &str = "Idem-Detail";
/// Header carrying the stream the dead-lettered message came from.
pub const STREAM_HEADER: &str = "Idem-Stream";
/// Header carrying the subject the dead-lettered message was published to.
pub const SUBJECT_HEADER: &str = "Idem-Subject";
/// Header carrying the stream sequence of the dead-lettered message.
pub const SEQUENCE_HEADER: &str = "Idem-Sequence";
/// Header carrying how many times the dead-lettered message was delivered.
pub const DELIVERIES_HEADER: &str = "Idem-Deliveries";
/// Header carrying the original `Nats-Msg-Id` of a dead-lettered message. The copy's own
/// `Nats-Msg-Id` is `<stream>:<sequence>`, so that dead-lettering one message twice (a crash
/// between the copy and the `+TERM`, then a redelivery) stores one copy, within the
/// dead-letter stream's duplicate window.
pub const MSG_ID_HEADER: &str = "Idem-Msg-Id";

/// Longest `Idem-Detail` value, in bytes; longer sentences are cut at a character boundary.
const MAX_DETAIL_LEN: usize = 1024;
/// How long a pull request stays open at the server.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
/// Idle heartbeat of a pull request: two missed ones end the pull and it is made again.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// Where a dead-lettered message goes before it is terminated (`+TERM`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterTarget {
    /// Publish a copy through JetStream to this subject and wait for the stream's ack; the
    /// message is terminated only once the copy is stored. A stream must capture the subject
    /// (checked when the source is built). The default, on `<stream>.dead`.
    Stream(String),
    /// Publish a copy on core NATS to this subject (no stream needed; whoever subscribes at
    /// that moment gets it, nobody stores it).
    Subject(String),
    /// Publish nothing: only `+TERM` (with the reason code on servers from 2.11), which the
    /// server announces as a `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED` advisory.
    TermOnly,
}
