//! A record handed out, and how it is settled.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::FutureRecord;

use super::source::Shared;
use super::{
    DELIVERIES_HEADER, DETAIL_HEADER, DeadLetterTarget, GROUP_HEADER, MAX_DETAIL_LEN,
    OFFSET_HEADER, PARTITION_HEADER, REASON_HEADER, TOPIC_HEADER,
};
use crate::offsets::{Handout, Settled, Tp};
use crate::{DeadLetter, Delivery, Disposition, MqError};

/// What a source keeps of a fetched record.
pub(crate) struct Record {
    pub(crate) key: Option<Bytes>,
    pub(crate) payload: Bytes,
    pub(crate) headers: Vec<(String, Bytes)>,
}

impl Record {
    /// What `message` holds, copied out of librdkafka's buffer.
    pub(crate) fn of(message: &impl rdkafka::Message) -> Self {
        let headers = message
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            h.value.map(Bytes::copy_from_slice).unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            key: message.key().map(Bytes::copy_from_slice),
            payload: message
                .payload()
                .map(Bytes::copy_from_slice)
                .unwrap_or_default(),
            headers,
        }
    }
}

/// How long a record whose settling failed (its dead-letter copy was not taken) waits before
/// it is handed out again.
const AFTER_FAILED_SETTLE: Duration = Duration::from_secs(1);

/// One record of a partition, held until it is settled. Dropped unsettled (the consumer's task
/// was stopped), it is handed out again at once.
pub struct KafkaDelivery {
    tp: Tp,
    generation: u64,
    offset: i64,
    handed: u32,
    /// `None` once settled.
    record: Option<Record>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key, the headers or the value: they may hold personal data.
        f.debug_struct("KafkaDelivery")
            .field("topic", &self.tp.0)
            .field("partition", &self.tp.1)
            .field("offset", &self.offset)
            .field("handed", &self.handed)
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    pub(super) fn new(handout: Handout<Record>, shared: Arc<Shared>) -> Self {
        Self {
            tp: handout.tp,
            generation: handout.generation,
            offset: handout.offset,
            handed: handout.handed,
            record: Some(handout.record),
            shared,
        }
    }

    /// The topic the record was read from.
    pub fn topic(&self) -> &str {
        &self.tp.0
    }

    /// Its partition.
    pub fn partition(&self) -> i32 {
        self.tp.1
    }

    /// Its offset in the partition.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// The record's Kafka key, as bytes.
    pub fn key(&self) -> Option<&[u8]> {
        self.record.as_ref()?.key.as_deref()
    }

    fn record(&self) -> &Record {
        self.record
            .as_ref()
            .expect("a delivery holds its record until settled")
    }

    /// Gives the record back to the source's book: done, or to be retried once `due`.
    fn give_back(&mut self, done: bool, due: Instant) {
        let Some(record) = self.record.take() else {
            return;
        };
        let how = if done {
            Settled::Done
        } else {
            Settled::Retry { record, due }
        };
        self.shared
            .settle(&self.tp, self.generation, self.offset, how);
    }

    async fn dead_letter(&self, dead: &DeadLetter) -> Result<(), MqError> {
        let to = match &self.shared.dead_letter {
            DeadLetterTarget::CommitOnly => {
                tracing::warn!(
                    topic = %self.tp.0,
                    partition = self.tp.1,
                    offset = self.offset,
                    reason = dead.reason.code(),
                    "a record is dead-lettered (committed without a copy)"
                );
                return Ok(());
            }
            DeadLetterTarget::Topic(to) => to.clone(),
            DeadLetterTarget::TopicDead => format!("{}.dead", self.tp.0),
        };
        let record = self.record();
        let mut headers = OwnedHeaders::new_with_capacity(record.headers.len() + 7);
        for (name, value) in &record.headers {
            // A copy of a copy: the newest reason only.
            if !name.starts_with("idem-") {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(&value[..]),
                });
            }
        }
        let why = [
            (REASON_HEADER, dead.reason.code().to_owned()),
            (
                DETAIL_HEADER,
                crate::text::one_line(&dead.detail, MAX_DETAIL_LEN),
            ),
            (TOPIC_HEADER, self.tp.0.to_string()),
            (PARTITION_HEADER, self.tp.1.to_string()),
            (OFFSET_HEADER, self.offset.to_string()),
            (GROUP_HEADER, self.shared.group.clone()),
            (DELIVERIES_HEADER, self.handed.to_string()),
        ];
        for (name, value) in &why {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut copy = FutureRecord::<[u8], [u8]>::to(&to)
            .payload(&record.payload[..])
            .headers(headers);
        if let Some(key) = &record.key {
            copy = copy.key(&key[..]);
        }
        self.shared
            .producer()?
            .send(copy, self.shared.produce_timeout)
            .await
            .map(|_| ())
            .map_err(|(e, _)| MqError::broker("cannot produce the dead-letter copy", e))
    }
}

impl Drop for KafkaDelivery {
    fn drop(&mut self) {
        // Unsettled: back to the book, to run again.
        self.give_back(false, Instant::now());
    }
}

impl Delivery for KafkaDelivery {
    fn message_id(&self) -> Option<&str> {
        std::str::from_utf8(self.record().key.as_deref()?).ok()
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let (_, value) = self.record().headers.iter().find(|(n, _)| n == name)?;
        std::str::from_utf8(value).ok().map(Cow::Borrowed)
    }

    fn payload(&self) -> &[u8] {
        &self.record().payload
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.handed)
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        // Kafka has no redelivery timer: the record is the source's until it is settled or
        // its partition is revoked.
        Ok(())
    }

    async fn settle(mut self, how: Disposition) -> Result<(), MqError> {
        match how {
            Disposition::Ack => {
                self.give_back(true, Instant::now());
                Ok(())
            }
            Disposition::Requeue { delay } => {
                let delay = delay.min(self.shared.max_requeue_delay);
                self.give_back(false, Instant::now() + delay);
                Ok(())
            }
            Disposition::DeadLetter(dead) => match self.dead_letter(&dead).await {
                Ok(()) => {
                    self.give_back(true, Instant::now());
                    Ok(())
                }
                Err(e) => {
                    self.give_back(false, Instant::now() + AFTER_FAILED_SETTLE);
                    Err(e)
                }
            },
        }
    }
}
