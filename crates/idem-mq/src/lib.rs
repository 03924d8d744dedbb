//! Message consumers that run once.
//!
//! A broker delivers a message at least once: a consumer that did the work but whose ack was
//! lost, a connection that dropped, a redelivery timer that fired, or a publisher that retried
//! all bring it back. `idem-mq` consumes a queue (RabbitMQ, feature `amqp`), a durable
//! JetStream consumer (NATS, feature `nats`) or a Redis stream's consumer group (feature
//! `redis-streams`) so that the handler's effect happens once per
//! message key: it claims the key, runs the handler, stores its result, and only then acks; a
//! redelivery of a message whose result is stored is acked without running. See
//! [`Consumer`] for the order and what each outcome does, and the `inbox` module (features
//! `postgres`, `mysql`) for handlers whose
//! business write and record commit in one transaction.

#[cfg(feature = "amqp")]
pub mod amqp;
mod consumer;
mod error;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod inbox;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod key;
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
pub mod offsets;
#[cfg(feature = "redis-streams")]
pub mod redis_streams;
pub mod source;
#[cfg(any(
    feature = "amqp",
    feature = "nats",
    feature = "redis-streams",
    feature = "kafka"
))]
mod text;

pub use consumer::{
    Consumer, Counts, DEFAULT_SCOPE, Failure, Handler, Message, MissingKey, Outcome, RunEnd,
    Verdict, verdict,
};
#[cfg(feature = "bench")]
pub mod bench;

pub use error::MqError;
pub use key::KeyFrom;
pub use source::{DeadLetter, Delivery, Disposition, Horizon, Identity, Reason, Source};

/// Describes the consumers' metrics to the installed `metrics` recorder (help texts for
/// Prometheus). Labels: `source` (the queue or stream), `outcome` (`handled`, `replayed`,
/// `requeued`, `dead_lettered`, `unsettled`) and `reason` (a dead letter's code).
pub fn describe_metrics() {
    metrics::describe_counter!(
        "idem_mq_received_total",
        "Deliveries received from the broker."
    );
    metrics::describe_counter!(
        "idem_mq_messages_total",
        "Deliveries settled, by outcome (handled, replayed, requeued, dead_lettered, unsettled) and dead-letter reason."
    );
    metrics::describe_counter!(
        "idem_mq_source_errors_total",
        "Failures to receive from the broker (the source reconnects)."
    );
    metrics::describe_counter!(
        "idem_mq_entries_vanished_total",
        "Redis stream entries deleted or trimmed while pending, before they were acked."
    );
}
