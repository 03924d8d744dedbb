//! Kafka: a consumer group's partitions as a [`Source`](crate::Source), and publishing a
//! record with its key.
//!
//! [`KafkaSource`] joins a consumer group on one or more topics. A record's key, as text, is
//! its message id (the consumer's default key); a header or a JSON pointer into the value can
//! be the key instead ([`KeyFrom`](crate::KeyFrom)).
//!
//! | disposition | what happens |
//! | --- | --- |
//! | [`Disposition::Ack`](crate::Disposition::Ack) | the record is done: the commit may pass it |
//! | [`Disposition::Requeue`](crate::Disposition::Requeue) | the source keeps the record and hands it out again after the delay; it holds back its partition's commit meanwhile |
//! | [`Disposition::DeadLetter`](crate::Disposition::DeadLetter) | a copy is produced to `<topic>.dead`, reason in headers, and once the broker has it, the record is done |
//!
//! # Offsets
//!
//! Kafka remembers a group's place in a partition as one offset, so a record is never marked
//! done alone. The source commits, once a second (and when a partition is revoked, and when it
//! closes), each partition up to its first record not yet done. A record still running, or
//! waiting to be retried, holds the commit back however many records after it are done; it is
//! never skipped. A crash redelivers from that point, and the records past it that were done
//! are acked from their stored results without running.
//!
//! # Order
//!
//! By default ([`Order::Partition`]) a partition's records run one at a time, in offset order;
//! the partitions run side by side, up to the consumer's concurrency, and a record waiting for
//! a retry holds back its own partition only. [`Order::Key`] runs the records of one Kafka key
//! one at a time and the others side by side.
//!
//! # Rebalance
//!
//! When the group takes a partition away, the source commits it up to its first record not
//! done and drops what it held of it. A record still running keeps its claim: the member the
//! partition went to fetches it again, finds the claim held, and waits (requeues it to
//! itself) until the first run's result is stored, then acks it without running. The two never
//! run one key at once; the record's lease bounds how long the wait can last if the first
//! member died.
//!
//! # Backpressure
//!
//! A partition whose records wait in memory past [`KafkaSourceBuilder::max_held`] (default
//! 64) is paused, and resumed when half of them have been handed out. librdkafka's own fetch
//! queue is bounded too (`queued.max.messages.kbytes`, 16 MiB here unless set).
//!
//! # Delivery counts
//!
//! Kafka does not count deliveries. A record's count is how many times this source has handed
//! it out; after a rebalance or a restart it starts again at 1. The consumer counts runs by
//! its record ([`Consumer::max_attempts`](crate::Consumer::max_attempts)), so a crash loop
//! still ends in the dead letter.
//!
//! # Redelivery horizon
//!
//! A record can be read again as long as the topic keeps it, and a group's offsets can be
//! reset: [`Horizon::Unbounded`](crate::Horizon::Unbounded). Keep records at least as long as
//! the topic's retention if offsets may be reset.
//!
//! # Records' namespace
//!
//! `kafka:<group>:<topic>…`, each name escaped ([`Identity::namespace`](crate::Identity::namespace)):
//! every group reads every record, so each keeps records of its own.
//!
//! # The client
//!
//! librdkafka through `rdkafka`, built from source and linked statically: the librdkafka of
//! stable distributions (Debian 12's 2.0) is older than any `rdkafka` release that links to a
//! system library, and a static build gives every user the same client.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::MqError;

mod delivery;
mod source;

pub use crate::offsets::Order;
pub use delivery::KafkaDelivery;
pub use source::{KafkaSource, KafkaSourceBuilder};

/// Header of a dead-lettered copy: [`crate::Reason::code`].
pub const REASON_HEADER: &str = "idem-reason";
/// Header of a dead-lettered copy: the sentence of its [`DeadLetter`](crate::DeadLetter).
pub const DETAIL_HEADER: &str = "idem-detail";
/// Header of a dead-lettered copy: the topic it came from.
pub const TOPIC_HEADER: &str = "idem-topic";
/// Header of a dead-lettered copy: its partition there.
pub const PARTITION_HEADER: &str = "idem-partition";
/// Header of a dead-lettered copy: its offset there.
pub const OFFSET_HEADER: &str = "idem-offset";
/// Header of a dead-lettered copy: the consumer group that gave up on it.
pub const GROUP_HEADER: &str = "idem-group";
/// Header of a dead-lettered copy: how many times this source handed it out.
pub const DELIVERIES_HEADER: &str = "idem-deliveries";

/// Longest `idem-detail` value, in bytes; longer sentences are cut at a character boundary.
const MAX_DETAIL_LEN: usize = 1024;

/// Where a dead-lettered record goes before it counts as done.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeadLetterTarget {
    /// A copy to `<topic>.dead`, for each record's own topic. The default.
    #[default]
    TopicDead,
    /// A copy to this topic, whatever topic the record came from.
    Topic(String),
    /// No copy: the record is done, and the reason logged.
    CommitOnly,
}

/// Produces a record to `topic` with its `key` (the consumer's default idempotency key) and
/// `headers`, and waits until the broker has it (at most `timeout`). A producer that retries
/// after an error may write it twice; consumers keyed by the record key run it once.
pub async fn publish(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: &[(&str, &[u8])],
    timeout: Duration,
) -> Result<(i32, i64), MqError> {
    let mut hs = OwnedHeaders::new_with_capacity(headers.len());
    for (name, value) in headers {
        hs = hs.insert(Header {
            key: name,
            value: Some(*value),
        });
    }
    let record = FutureRecord::to(topic)
        .key(key)
        .payload(payload)
        .headers(hs);
    producer
        .send(record, timeout)
        .await
        .map(|done| (done.partition, done.offset))
        .map_err(|(e, _)| MqError::broker("cannot produce the record", e))
}
