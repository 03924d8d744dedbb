//! A delivery, and how it is settled: ack, a confirmed copy then ack, or a copy to the
//! dead-letter exchange.

use std::borrow::Cow;
use std::sync::Arc;

use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::link::Link;
use super::publish::publish_confirmed;
use super::topology::bucket_for;
use super::{
    ATTEMPT_HEADER, Bounded, DELIVERY_COUNT_HEADER, DETAIL_HEADER, MAX_DETAIL_BYTES, PERSISTENT,
    REASON_HEADER,
};
use crate::MqError;
use crate::source::{DeadLetter, Delivery, Disposition};
use crate::text::cut;
use lapin::BasicProperties;

/// A message delivered by an [`AmqpSource`](super::AmqpSource).
pub struct AmqpDelivery {
    pub(super) inner: lapin::message::Delivery,
    pub(super) link: Arc<Link>,
}

impl std::fmt::Debug for AmqpDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpDelivery")
            .field("delivery_tag", &self.inner.delivery_tag)
            .field("redelivered", &self.inner.redelivered)
            .finish_non_exhaustive()
    }
}

impl AmqpDelivery {
    /// The message's AMQP properties (headers included).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// Whether the broker marked the delivery as a redelivery.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    fn header_value(&self, name: &str) -> Option<&AMQPValue> {
        self.inner
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
    }

    fn header_u64(&self, name: &str) -> Option<u64> {
        self.header_value(name).and_then(value_u64)
    }

    /// Gives the delivery back to its queue (`basic.nack` with requeue), at once: for when the
    /// copy that was to replace it could not be made. A delivery left unacknowledged would
    /// hold its place in the prefetch window until the channel closes.
    async fn give_back(&self) {
        let _ = self
            .inner
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .bounded("giving a delivery back")
            .await;
    }

    /// Publishes a copy of the message (confirmed), then acks the original.
    async fn republish_then_ack(
        self,
        exchange: &str,
        routing_key: &str,
        headers: FieldTable,
    ) -> Result<(), MqError> {
        let props = self
            .inner
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(PERSISTENT);
        let published = async {
            let channel = self.link.publish_channel().await?;
            publish_confirmed(
                &channel,
                exchange,
                routing_key,
                &self.inner.data,
                props,
                true,
            )
            .await
        }
        .await;
        if let Err(e) = published {
            // The copy may not exist: give the original back to the queue now rather than
            // leave it unacknowledged until the channel closes. (If the broker did take the
            // copy, both come back: a duplicate the record absorbs.)
            self.give_back().await;
            return Err(e);
        }
        // Between the confirm above and this ack a crash leaves both copies: a duplicate, which
        // the idempotency record absorbs.
        ack(&self.inner, &self.link).await
    }

    fn copied_headers(&self) -> FieldTable {
        let mut headers = FieldTable::default();
        if let Some(h) = self.inner.properties.headers() {
            for (k, v) in h.inner() {
                if k.as_str() != DELIVERY_COUNT_HEADER {
                    headers.insert(k.clone(), v.clone());
                }
            }
        }
        headers
    }
}

async fn ack(delivery: &lapin::message::Delivery, link: &Link) -> Result<(), MqError> {
    let closed = || MqError::Broker {
        message: "delivery cannot be acked: its channel is closed (the broker redelivers it)"
            .into(),
        source: None,
    };
    if !link.consume.status().connected() {
        return Err(closed());
    }
    match delivery
        .acker
        .ack(BasicAckOptions::default())
        .bounded("acking a delivery")
        .await?
    {
        true => Ok(()),
        false => Err(closed()),
    }
}

fn value_u64(v: &AMQPValue) -> Option<u64> {
    match v {
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::Timestamp(n) => Some(*n),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        _ => None,
    }
}

impl Delivery for AmqpDelivery {
    fn message_id(&self) -> Option<&str> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        match self.header_value(name)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(Cow::Borrowed),
            AMQPValue::ShortString(s) => Some(Cow::Borrowed(s.as_str())),
            AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).ok().map(Cow::Borrowed),
            AMQPValue::Boolean(b) => Some(Cow::Owned(b.to_string())),
            AMQPValue::Float(x) => Some(Cow::Owned(x.to_string())),
            AMQPValue::Double(x) => Some(Cow::Owned(x.to_string())),
            AMQPValue::ShortShortInt(n) => Some(Cow::Owned(n.to_string())),
            AMQPValue::ShortInt(n) => Some(Cow::Owned(n.to_string())),
            AMQPValue::LongInt(n) => Some(Cow::Owned(n.to_string())),
            AMQPValue::LongLongInt(n) => Some(Cow::Owned(n.to_string())),
            v => value_u64(v).map(|n| Cow::Owned(n.to_string())),
        }
    }

    fn payload(&self) -> &[u8] {
        &self.inner.data
    }

    fn delivery_count(&self) -> Option<u32> {
        let earlier = self.header_u64(ATTEMPT_HEADER).unwrap_or(0);
        let this_copy = match self.header_u64(DELIVERY_COUNT_HEADER) {
            Some(returned) => returned.saturating_add(1),
            None if !self.inner.redelivered => 1,
            // Redelivered by a classic queue: it does not say how often.
            None => return None,
        };
        u32::try_from(earlier.saturating_add(this_copy)).ok()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        Ok(())
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        match how {
            Disposition::Ack => ack(&self.inner, &self.link).await,
            Disposition::Requeue { delay } => {
                let attempts = self.delivery_count().map(u64::from).unwrap_or_else(|| {
                    // A publisher's header may say anything.
                    self.header_u64(ATTEMPT_HEADER)
                        .unwrap_or(0)
                        .saturating_add(1)
                });
                let mut headers = self.copied_headers();
                headers.insert(
                    ATTEMPT_HEADER.into(),
                    AMQPValue::LongLongInt(i64::try_from(attempts).unwrap_or(i64::MAX)),
                );
                let routing_key = match bucket_for(delay) {
                    Some(bucket) => match self.link.ensure_delay_queue(bucket).await {
                        Ok(queue) => queue,
                        Err(e) => {
                            // No delay queue (refused, or declared before with other
                            // arguments): give the message back to its queue now, without the
                            // delay, rather than leave it unacknowledged.
                            self.give_back().await;
                            return Err(e);
                        }
                    },
                    None => self.link.topology.queue.clone(),
                };
                self.republish_then_ack("", &routing_key, headers).await
            }
            Disposition::DeadLetter(DeadLetter { reason, detail }) => {
                let mut headers = self.copied_headers();
                headers.insert(
                    REASON_HEADER.into(),
                    AMQPValue::LongString(reason.code().into()),
                );
                headers.insert(
                    DETAIL_HEADER.into(),
                    AMQPValue::LongString(cut(&detail, MAX_DETAIL_BYTES).into()),
                );
                let exchange = self.link.topology.dead_letter_exchange.clone();
                let routing_key = self.link.topology.queue.clone();
                self.republish_then_ack(&exchange, &routing_key, headers)
                    .await
            }
        }
    }
}
