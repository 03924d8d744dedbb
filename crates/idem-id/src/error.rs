//! Why no id was issued: one error for every generator in the crate (Snowflake, leased
//! worker ids, segments).

use std::time::Duration;

use crate::layout::LayoutError;

/// Why no id was issued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The layout or a value for it is wrong.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Ids are being asked for faster than the layout allows for longer than the borrowing
    /// bound: try again after `retry_after`.
    #[error("ids are asked for faster than the layout allows; try again in {retry_after:?}")]
    Exhausted {
        /// When the clock will have caught up enough.
        retry_after: Duration,
    },
    /// The timestamp no longer fits the layout: its epoch is too far back.
    #[error("the layout's timestamp bits are used up; a new layout (epoch) is needed")]
    LayoutExhausted,
    /// The generator's worker id is no longer its own (its lease was lost): it issues nothing.
    #[error("the worker id's lease was lost; this generator issues no more ids")]
    WorkerLost,
    /// The worker id's lease has run out here and its renewal has not come through yet (the
    /// store may be unreachable): no id is issued past the lease, where another process could
    /// hold the worker id.
    #[error("the worker id's lease ran out before it could be renewed; try again shortly")]
    LeaseExpired,
    /// The worker id was just claimed, and its first ids wait until an earlier holder of it
    /// that may still be issuing has stopped (see [`crate::WorkerPool::claim`]): try again
    /// after `retry_after`.
    #[error(
        "the worker id was just claimed; its ids begin once any earlier holder of it has \
         stopped, in {retry_after:?}"
    )]
    Starting {
        /// When the first id may be issued.
        retry_after: Duration,
    },
    /// A [`crate::ManagedSnowflake`] holds no worker id at the moment: its last one was lost,
    /// or none could be claimed yet, and it is claiming one (see [`crate::WorkerStatus`]).
    #[error("no worker id is held at the moment ({reason}); try again in {retry_after:?}")]
    NoWorker {
        /// Why there is none.
        reason: String,
        /// When the next claim is tried (at least a second).
        retry_after: Duration,
    },
    /// Every worker id is held by a live process or waiting out its quarantine.
    #[error("no worker id is free: all are held or in quarantine")]
    NoWorkerFree,
    /// A segment tag that cannot name a counter (1 to 255 visible ASCII characters).
    #[error("invalid tag: {0}")]
    Tag(String),
    /// An id space name that cannot name the store's records (see [`crate::WorkerPool::new`]).
    #[error("invalid id space: {0}")]
    Space(String),
    /// The store failed (claiming or renewing a worker id, fetching a segment).
    #[error("the store failed: {0}")]
    Store(String),
}

impl From<idem_core::StoreError> for IdError {
    fn from(e: idem_core::StoreError) -> Self {
        IdError::Store(e.to_string())
    }
}
