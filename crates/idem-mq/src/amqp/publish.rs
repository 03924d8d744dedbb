//! Publishing with publisher confirms.

use std::sync::Arc;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};

use super::topology::short;
use super::{Bounded, CONFIRM_TIMEOUT, PERSISTENT, open_channel};
use crate::MqError;
use lapin::BasicProperties;

/// Publishes and waits for the broker's confirm; a nack, or (when `mandatory`) a message no
/// queue took, is an error.
pub(super) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    props: BasicProperties,
    mandatory: bool,
) -> Result<(), MqError> {
    let confirm = channel
        .basic_publish(
            short(exchange)?,
            short(routing_key)?,
            BasicPublishOptions {
                mandatory,
                immediate: false,
            },
            payload,
            props,
        )
        .bounded("publishing")
        .await?;
    let confirm = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| MqError::Broker {
            message: format!("no publisher confirm within {CONFIRM_TIMEOUT:?}"),
            source: None,
        })?
        .map_err(|e| MqError::broker("waiting for the publisher confirm", e))?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(MqError::Broker {
            message: "the broker returned the message: no queue is bound for its routing key"
                .into(),
            source: None,
        }),
        Confirmation::Nack(_) => Err(MqError::Broker {
            message: "the broker refused the message (publisher nack)".into(),
            source: None,
        }),
        Confirmation::NotRequested => Err(MqError::Broker {
            message: "the channel is not in confirm mode (call confirm_select first)".into(),
            source: None,
        }),
    }
}

/// Publishes `payload` once per idempotency `key`: the message id is the key, the message
/// persistent, and the call returns when the broker confirmed it.
///
/// `channel` must be in confirm mode (`confirm_select`); without a confirm within
/// 30 s the call fails. The publish is mandatory: a message no
/// queue takes is returned by the broker and reported as an error. A publisher that retries
/// after an error may publish twice; the consumer's records absorb the duplicate, since both
/// copies carry the same message id.
pub async fn publish_once(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    key: &str,
    payload: &[u8],
    props: BasicProperties,
) -> Result<(), MqError> {
    idem_core::ClientKey::new(key)
        .map_err(|e| MqError::Config(format!("not a valid idempotency key: {e}")))?;
    let props = props
        .with_message_id(short(key)?)
        .with_delivery_mode(PERSISTENT);
    publish_confirmed(channel, exchange, routing_key, payload, props, true).await
}

/// A connection and a channel in confirm mode, for [`publish_once`].
pub struct AmqpPublisher {
    connection: Option<Arc<Connection>>,
    channel: Channel,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// Connects to `url` and opens a channel in confirm mode. The connection closes when the
    /// publisher is dropped.
    pub async fn connect(url: &str) -> Result<Self, MqError> {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .bounded("connecting to the AMQP broker")
            .await?;
        let channel = open_channel(&connection).await?;
        let mut publisher = Self::on_channel(channel).await?;
        publisher.connection = Some(Arc::new(connection));
        Ok(publisher)
    }

    /// Uses `channel` (of a connection the caller keeps open), putting it in confirm mode.
    pub async fn on_channel(channel: Channel) -> Result<Self, MqError> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .bounded("enabling publisher confirms")
            .await?;
        Ok(Self {
            connection: None,
            channel,
        })
    }

    /// The channel, in confirm mode.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// [`publish_once`] on this publisher's channel.
    pub async fn publish_once(
        &self,
        exchange: &str,
        routing_key: &str,
        key: &str,
        payload: &[u8],
        props: BasicProperties,
    ) -> Result<(), MqError> {
        publish_once(&self.channel, exchange, routing_key, key, payload, props).await
    }

    /// Closes the connection (if this publisher opened it).
    pub async fn close(self) {
        if let Some(connection) = &self.connection {
            let _ = connection.close(200, "OK".into()).bounded("closing").await;
        }
    }
}
