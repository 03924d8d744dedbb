//! A delivery, and how it is settled.

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;

use super::{
    DELIVERIES_HEADER, DETAIL_HEADER, DeadLetterTarget, MAX_DETAIL_LEN, MSG_ID_HEADER,
    REASON_HEADER, SEQUENCE_HEADER, STREAM_HEADER, SUBJECT_HEADER,
};
use crate::{DeadLetter, Delivery, Disposition, MqError};

/// What every delivery of one source shares.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) stream: String,
    pub(super) dead_letter: DeadLetterTarget,
    pub(super) confirm_acks: bool,
    pub(super) max_requeue_delay: Duration,
}

/// One JetStream message, held until it is settled.
#[derive(Debug)]
pub struct NatsDelivery {
    pub(super) message: jetstream::Message,
    pub(super) shared: Arc<Shared>,
}

impl NatsDelivery {
    /// The JetStream message (subject, headers, payload, reply subject).
    pub fn message(&self) -> &jetstream::Message {
        &self.message
    }

    /// The subject the message was published to.
    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    /// The message's sequence number in its stream, if its metadata can be read.
    pub fn stream_sequence(&self) -> Option<u64> {
        self.message.info().ok().map(|info| info.stream_sequence)
    }

    /// Sends one acknowledgement (`+ACK`, `-NAK`, `+TERM`, `+WPI`) for this message, waiting
    /// for the server's confirmation if `confirm`.
    ///
    /// A confirmed acknowledgement is what `async-nats` calls a double ack, sent as a request
    /// on the client's one shared reply subscription: its `double_ack` subscribes a fresh
    /// inbox for every ack, two more protocol messages per message.
    async fn send(&self, payload: Bytes, confirm: bool) -> Result<(), MqError> {
        let Some(reply) = self.message.reply.clone() else {
            return Err(MqError::Broker {
                message: "the message has no reply subject to acknowledge on".to_owned(),
                source: None,
            });
        };
        let client = self.message.context.client();
        if confirm {
            client
                .request(reply, payload)
                .await
                .map(|_| ())
                .map_err(|e| MqError::broker("the server did not confirm the acknowledgement", e))
        } else {
            client
                .publish(reply, payload)
                .await
                .map_err(|e| MqError::broker("cannot send the acknowledgement", e))
        }
    }

    /// Publishes the dead-lettered copy, with the reason and where the message came from.
    async fn publish_dead_letter(&self, dead: &DeadLetter) -> Result<(), MqError> {
        let subject = match &self.shared.dead_letter {
            DeadLetterTarget::Stream(s) | DeadLetterTarget::Subject(s) => s.clone(),
            DeadLetterTarget::TermOnly => return Ok(()),
        };
        let info = self.message.info().ok();
        let mut headers = HeaderMap::new();
        if let Some(original) = &self.message.headers {
            for (name, values) in original.iter() {
                let text: &str = name.as_ref();
                // JetStream's own headers would steer the copy's publish (dedupe, expected
                // sequences, TTL, rollups); the original id is kept under MSG_ID_HEADER.
                if text.starts_with("Nats-") {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        if let Some(id) = self.message_id() {
            headers.insert(MSG_ID_HEADER, HeaderValue::from(id));
        }
        headers.insert(REASON_HEADER, HeaderValue::from(dead.reason.code()));
        headers.insert(DETAIL_HEADER, HeaderValue::from(header_text(&dead.detail)));
        headers.insert(
            STREAM_HEADER,
            HeaderValue::from(self.shared.stream.as_str()),
        );
        headers.insert(SUBJECT_HEADER, HeaderValue::from(self.subject()));
        if let Some(info) = &info {
            headers.insert(SEQUENCE_HEADER, HeaderValue::from(info.stream_sequence));
            headers.insert(DELIVERIES_HEADER, HeaderValue::from(info.delivered));
        }
        let client = self.message.context.client();
        match &self.shared.dead_letter {
            DeadLetterTarget::Stream(_) => {
                if let Some(info) = &info {
                    let id = format!("{}:{}", info.stream, info.stream_sequence);
                    headers.insert(NATS_MESSAGE_ID, HeaderValue::from(id));
                }
                let publish = PublishMessage::build()
                    .headers(headers)
                    .payload(self.message.payload.clone());
                self.message
                    .context
                    .send_publish(subject, publish)
                    .await
                    .map_err(|e| MqError::broker("cannot publish to the dead letter", e))?
                    .await
                    .map_err(|e| MqError::broker("the dead letter did not store the copy", e))?;
            }
            DeadLetterTarget::Subject(_) => {
                client
                    .publish_with_headers(subject, headers, self.message.payload.clone())
                    .await
                    .map_err(|e| MqError::broker("cannot publish to the dead letter", e))?;
            }
            DeadLetterTarget::TermOnly => {}
        }
        Ok(())
    }
}

impl Delivery for NatsDelivery {
    fn message_id(&self) -> Option<&str> {
        self.message
            .headers
            .as_ref()?
            .get(NATS_MESSAGE_ID)
            .map(HeaderValue::as_str)
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        // A name the client cannot represent is in no message.
        let name = HeaderName::from_str(name).ok()?;
        self.message
            .headers
            .as_ref()?
            .get(name)
            .map(|v| Cow::Borrowed(v.as_str()))
    }

    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn delivery_count(&self) -> Option<u32> {
        let delivered = self.message.info().ok()?.delivered;
        u32::try_from(delivered).ok()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        // Fire and forget: progress is repeated at a third of ack_wait, so one lost `+WPI` is
        // made up by the next.
        self.send(AckKind::Progress.into(), false).await
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        let confirm = self.shared.confirm_acks;
        match how {
            Disposition::Ack => self.send(AckKind::Ack.into(), confirm).await,
            Disposition::Requeue { delay } => {
                let delay = delay.min(self.shared.max_requeue_delay);
                let nak = if delay.is_zero() {
                    AckKind::Nak(None)
                } else {
                    AckKind::Nak(Some(delay))
                };
                self.send(nak.into(), confirm).await
            }
            Disposition::DeadLetter(dead) => {
                // The copy first: if it cannot be stored the message is not terminated, and
                // comes back after ack_wait to be dead-lettered again.
                self.publish_dead_letter(&dead).await?;
                let client = self.message.context.client();
                // Servers before 2.11 compare the whole payload with `+TERM` and ignore one
                // with a reason, which would leave the message to be redelivered.
                let term = if client.is_server_compatible(2, 11, 0) {
                    Bytes::from(format!("+TERM {}", dead.reason.code()))
                } else {
                    AckKind::Term.into()
                };
                self.send(term, confirm).await
            }
        }
    }
}

/// `text` made fit for a header value: control characters become spaces, and it is cut to
/// [`MAX_DETAIL_LEN`] bytes at a character boundary.
fn header_text(text: &str) -> String {
    crate::text::one_line(text, MAX_DETAIL_LEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_text_has_no_line_breaks_and_a_bound() {
        assert_eq!(header_text("a\r\nb"), "a  b");
        let long = "é".repeat(MAX_DETAIL_LEN);
        let cut = header_text(&long);
        assert!(cut.len() <= MAX_DETAIL_LEN);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
