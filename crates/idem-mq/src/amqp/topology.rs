//! The queues and exchanges a source declares, and the delay buckets.

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

use super::{Bounded, DELAY_BUCKETS_MS, QueueType};
use crate::MqError;

/// The names and arguments of the queues and exchanges a source uses.
#[derive(Debug, Clone)]
pub(super) struct Topology {
    pub(super) queue: String,
    pub(super) queue_type: QueueType,
    pub(super) dead_letter_exchange: String,
    pub(super) dead_letter_queue: String,
    pub(super) delivery_limit: Option<u32>,
    pub(super) consumer_timeout: Option<Duration>,
    pub(super) declare: bool,
}

impl Topology {
    pub(super) fn delay_queue(&self, bucket_ms: u64) -> String {
        format!("{}.delay.{bucket_ms}", self.queue)
    }

    pub(super) fn work_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.argument().into()),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dead_letter_exchange.as_str().into()),
        );
        if let Some(limit) = self.delivery_limit {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(limit)),
            );
        }
        if let Some(timeout) = self.consumer_timeout {
            args.insert(
                "x-consumer-timeout".into(),
                AMQPValue::LongLongInt(millis_i64(timeout)),
            );
        }
        args
    }

    pub(super) fn dead_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.argument().into()),
        );
        args
    }

    pub(super) fn delay_queue_arguments(&self, bucket_ms: u64) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.argument().into()),
        );
        if self.queue_type == QueueType::Quorum {
            // A quorum queue moves an expired message to its dead-letter target only once the
            // target confirmed it (RabbitMQ 3.10 and later): a delayed copy survives a node
            // failure. The strategy requires `reject-publish` overflow.
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(i64::try_from(bucket_ms).unwrap_or(i64::MAX)),
        );
        // The default exchange routes by queue name: expired copies go back to the work queue.
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.queue.as_str().into()),
        );
        args
    }

    /// Declares the work queue, the dead-letter exchange and queue (if declarations are on).
    pub(super) async fn declare(&self, channel: &Channel) -> Result<(), MqError> {
        if !self.declare {
            return Ok(());
        }
        channel
            .exchange_declare(
                short(&self.dead_letter_exchange)?,
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .bounded("declaring the dead-letter exchange")
            .await?;
        channel
            .queue_declare(
                short(&self.dead_letter_queue)?,
                durable(),
                self.dead_queue_arguments(),
            )
            .bounded("declaring the dead-letter queue")
            .await?;
        channel
            .queue_bind(
                short(&self.dead_letter_queue)?,
                short(&self.dead_letter_exchange)?,
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .bounded("binding the dead-letter queue")
            .await?;
        channel
            .queue_declare(short(&self.queue)?, durable(), self.work_queue_arguments())
            .bounded("declaring the work queue")
            .await?;
        Ok(())
    }
}

pub(super) fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

pub(super) fn millis_i64(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(super) fn short(s: &str) -> Result<ShortString, MqError> {
    ShortString::try_new(s)
        .map_err(|_| MqError::Config(format!("AMQP name longer than 255 bytes: {s:.40}…")))
}

pub(super) fn bucket_for(delay: Duration) -> Option<u64> {
    if delay.is_zero() {
        return None;
    }
    let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    DELAY_BUCKETS_MS
        .iter()
        .copied()
        .find(|b| *b >= ms)
        .or(DELAY_BUCKETS_MS.last().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_a_bucket() {
        assert_eq!(bucket_for(Duration::ZERO), None);
        assert_eq!(bucket_for(Duration::from_millis(1)), Some(100));
        assert_eq!(bucket_for(Duration::from_millis(100)), Some(100));
        assert_eq!(bucket_for(Duration::from_millis(101)), Some(250));
        assert_eq!(bucket_for(Duration::from_secs(7)), Some(10_000));
        assert_eq!(bucket_for(Duration::from_secs(86_400)), Some(3_600_000));
    }
}
