//! Errors of the consumers and the broker adapters.

use std::error::Error as StdError;

use idem_core::StoreError;

/// Why a consumer, a source or a publisher failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MqError {
    /// The broker could not be reached, or refused or lost an operation (connection closed,
    /// channel error, no publisher confirm). Usually transient: sources reconnect.
    #[error("broker: {message}")]
    Broker {
        /// What went wrong, without keys or payloads.
        message: String,
        /// The client library's error.
        #[source]
        source: Option<Box<dyn StdError + Send + Sync>>,
    },
    /// The consumer's settings cannot work (a record TTL shorter than the broker's redelivery
    /// horizon, a queue name that is not a valid namespace); it refuses to start.
    #[error("configuration: {0}")]
    Config(String),
    /// The record store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl MqError {
    /// An [`MqError::Broker`] with its cause.
    pub fn broker(
        message: impl Into<String>,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self::Broker {
            message: message.into(),
            source: Some(source.into()),
        }
    }
}
