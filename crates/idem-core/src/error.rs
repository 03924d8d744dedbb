//! What the calls on a store can fail with, and the boxed future the object-safe traits
//! return: the types every other module of the crate names, so they live below all of them.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;

use crate::page::InvalidListing;

/// A failure of the store itself (not a refusal by the state machine).
///
/// Callers must fail closed on any `StoreError`: the work does not run without its record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store cannot be reached or is not accepting work now (connection refused, pool
    /// exhausted, database locked for too long). Retrying later may succeed.
    #[error("store unavailable: {message}")]
    Unavailable {
        /// What went wrong, without keys or payloads.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn StdError + Send + Sync>>,
    },
    /// The store answered with an error that retrying will not fix (a schema from a newer
    /// version, a full disk, a file that is not a database).
    #[error("store error: {message}")]
    Backend {
        /// What went wrong, without keys or payloads.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn StdError + Send + Sync>>,
    },
    /// The store holds as much as it is allowed to and none of it may be forgotten yet (a
    /// bounded in-memory store whose records are all live). Only a `begin` that would create
    /// a record gets it; nothing was stored. Transient: records expire, so a later attempt
    /// may find room. Over HTTP it is 503 with the code `store_full`.
    #[error("store full: {message}")]
    Full {
        /// Which bound was reached, without keys or payloads.
        message: String,
    },
    /// A counter would pass `i64::MAX` (what every backend can hold).
    #[error("the counter is used up")]
    CounterExhausted,
    /// A stored record could not be read back.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    /// The request itself is not one a store answers (a listing's page size or cursor); the
    /// store was not asked.
    #[error(transparent)]
    Invalid(#[from] InvalidListing),
}

impl StoreError {
    /// An [`StoreError::Unavailable`] with a source.
    pub fn unavailable(
        message: impl Into<String>,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self::Unavailable {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// A [`StoreError::Backend`] with a source.
    pub fn backend(
        message: impl Into<String>,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self::Backend {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Whether retrying the operation later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable { .. } | Self::Full { .. })
    }
}

/// The answer of `complete` and `release` when they do not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The lease is no longer the record's current lease.
    #[error(transparent)]
    Stale(#[from] StaleLease),
    /// The store failed; whether the operation took effect is unknown.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Refusal of `complete` or `release` by the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the lease is no longer current: the record was taken over, released, forgotten after its \
     retention, or already completed with a different response"
)]
pub struct StaleLease;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
