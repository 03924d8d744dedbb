//! Operator tools: what an HTTP record holds, and running an unknown outcome again.
//!
//! When the work behind a request timed out or its connection broke after the request was
//! sent, nobody knows whether it took effect, and the record is held as *unknown*: retries get
//! 409 `outcome_unknown` instead of running the work a second time. Under
//! [`OnUnknown::Hold`](crate::OnUnknown::Hold) it stays so until someone who can find out (an
//! operator looking at the upstream's data, or a reconciliation job) decides. If the work did
//! not happen, [`reopen_unknown`] lets the next retry run it; if it did, the record is left
//! alone and expires with its TTL.

use http::StatusCode;
use idem_core::{DynStore, Key, Status, StoreError, Timestamp};

use crate::stored::Stored;

/// What a live HTTP record holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An attempt holds the key.
    InProgress {
        /// When its lease runs out.
        lease_expires_at: Timestamp,
    },
    /// An answer is stored and replayed to every retry.
    Stored {
        /// The stored status.
        status: StatusCode,
    },
    /// The answer was delivered once and was too large to keep; retries get 409.
    TooLarge {
        /// The delivered status.
        status: StatusCode,
    },
    /// The outcome is unknown; retries get 409 `outcome_unknown`.
    Unknown {
        /// When a retry may run it again by itself (`None`: only after [`reopen_unknown`]).
        until: Option<Timestamp>,
    },
    /// The key was given back; the next request with it runs.
    Released,
    /// The stored value is not an HTTP answer (another program wrote the record).
    Foreign,
}

impl RecordState {
    /// A stable lower-case name: `in_progress`, `stored`, `too_large`, `unknown`, `released`,
    /// `foreign`.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::InProgress { .. } => "in_progress",
            Self::Stored { .. } => "stored",
            Self::TooLarge { .. } => "too_large",
            Self::Unknown { .. } => "unknown",
            Self::Released => "released",
            Self::Foreign => "foreign",
        }
    }
}

/// A live record as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordView {
    /// What it holds.
    pub state: RecordState,
    /// The fence of its latest lease.
    pub fence: u64,
    /// When the latest lease was acquired.
    pub created_at: Timestamp,
    /// When it may be forgotten.
    pub expires_at: Timestamp,
}

/// The live record under `key`, or `None`.
pub async fn inspect(
    store: &dyn DynStore,
    key: &Key,
    now: Timestamp,
) -> Result<Option<RecordView>, StoreError> {
    let Some(record) = store.get(key, now).await? else {
        return Ok(None);
    };
    let state = match (record.status, record.response) {
        (Status::InProgress, _) => RecordState::InProgress {
            lease_expires_at: record.lease_expires_at,
        },
        (Status::Released, _) => RecordState::Released,
        (Status::Completed, None) => RecordState::Foreign,
        (Status::Completed, Some(bytes)) => match Stored::decode(bytes) {
            Ok(Stored::Response { status, .. }) => RecordState::Stored { status },
            Ok(Stored::TooLarge { status }) => RecordState::TooLarge { status },
            Ok(Stored::Unknown { until }) => RecordState::Unknown { until },
            Err(_) => RecordState::Foreign,
        },
    };
    Ok(Some(RecordView {
        state,
        fence: record.fence,
        created_at: record.created_at,
        expires_at: record.expires_at,
    }))
}

/// What [`reopen_unknown`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reopened {
    /// The record was unknown and is now released: the next request with its key runs.
    Reopened {
        /// The fence of the attempt whose outcome was unknown.
        fence: u64,
    },
    /// There is no live record under the key.
    NotFound,
    /// The record does not hold an unknown outcome, so it was left as it is.
    NotUnknown(RecordView),
}

/// Releases the record under `key` if, and only if, it holds an unknown outcome, so that the
/// next request with the key runs the work again. Call it only once you know the earlier
/// attempt did not take effect.
///
/// Safe against races: the store reopens only the completion it was shown (by its fence), so a
/// record that a retry reopened and answered meanwhile is left alone (`NotUnknown`).
pub async fn reopen_unknown(
    store: &dyn DynStore,
    key: &Key,
    now: Timestamp,
) -> Result<Reopened, StoreError> {
    let Some(view) = inspect(store, key, now).await? else {
        return Ok(Reopened::NotFound);
    };
    if !matches!(view.state, RecordState::Unknown { .. }) {
        return Ok(Reopened::NotUnknown(view));
    }
    if store.reopen(key, view.fence, now).await? {
        return Ok(Reopened::Reopened { fence: view.fence });
    }
    // It changed between the read and the reopen: report what it is now.
    Ok(match inspect(store, key, now).await? {
        Some(view) => Reopened::NotUnknown(view),
        None => Reopened::NotFound,
    })
}
