//! Publishing with `Nats-Msg-Id`.

use async_nats::HeaderMap;
use async_nats::jetstream;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use idem_core::ClientKey;

use crate::MqError;

/// What [`publish_once`] learnt from the stream's ack.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// The stream that stored the message.
    pub stream: String,
    /// Its sequence in that stream (for a duplicate, the sequence of the first copy).
    pub sequence: u64,
    /// The server had already stored a message with this `Nats-Msg-Id` within the stream's
    /// `duplicate_window`, and dropped this one.
    pub duplicate: bool,
}

/// Publishes `payload` to `subject` with `Nats-Msg-Id` set to `key`, and waits for the
/// stream's ack.
///
/// The key must be a valid idempotency key (visible ASCII, 1 to 255 bytes): it becomes the
/// message's key on the consumer side. A re-publish within the stream's `duplicate_window` is
/// dropped by the server ([`Published::duplicate`]); a later one is stored again and the
/// consumer's records catch it (see [the module docs](super#two-duplicate-filters-and-what-each-one-catches)).
///
/// ```no_run
/// # async fn example() -> Result<(), idem_mq::MqError> {
/// use idem_mq::nats::publish_once;
///
/// let client = async_nats::connect("nats://127.0.0.1:4222")
///     .await
///     .map_err(|e| idem_mq::MqError::broker("connect", e))?;
/// let js = async_nats::jetstream::new(client);
/// // The payment's id is the key: a retry of this publish is the same message.
/// let published = publish_once(&js, "ORDERS.paid", "payment-8812", "{}".into()).await?;
/// if published.duplicate {
///     // Published before within the stream's duplicate window; the server kept the first.
/// }
/// # Ok(())
/// # }
/// ```
pub async fn publish_once(
    js: &jetstream::Context,
    subject: impl Into<String>,
    key: &str,
    payload: Bytes,
) -> Result<Published, MqError> {
    publish_once_with_headers(js, subject, key, HeaderMap::new(), payload).await
}

/// [`publish_once`] with more headers (`Nats-Msg-Id` among them is replaced by `key`).
pub async fn publish_once_with_headers(
    js: &jetstream::Context,
    subject: impl Into<String>,
    key: &str,
    headers: HeaderMap,
    payload: Bytes,
) -> Result<Published, MqError> {
    let key = ClientKey::new(key)
        .map_err(|e| MqError::Config(format!("the message key is not a valid key: {e}")))?;
    let publish = PublishMessage::build()
        .headers(headers)
        .message_id(key.as_str())
        .payload(payload);
    let ack = js
        .send_publish(subject.into(), publish)
        .await
        .map_err(|e| MqError::broker("cannot publish", e))?
        .await
        .map_err(|e| MqError::broker("the stream did not acknowledge the publish", e))?;
    Ok(Published {
        stream: ack.stream,
        sequence: ack.sequence,
        duplicate: ack.duplicate,
    })
}
