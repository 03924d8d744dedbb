//! Message consumers that run once.
//!
//! A broker delivers a message at least once: a consumer that did the work but whose ack was
//! lost, a connection that dropped, a redelivery timer that fired, or a publisher that retried
//! all bring it back. `idem-mq` consumes a queue (RabbitMQ) or a durable JetStream consumer
//! (NATS) so that the handler's effect happens once per message key: it claims the key,
//! runs the handler, stores its result, and only then acks; a redelivery of a message whose
//! result is stored is acked without running.

mod error;
#[cfg(feature = "nats")]
pub mod nats;
pub mod source;

pub use error::MqError;
pub use source::{DeadLetter, Delivery, Disposition, Horizon, Reason, Source};
