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
use idem_core::{
    Bytes, Counts, DynStore, Key, Listed, RecordAdmin, RecordFilter, Status, StoreError, Timestamp,
};

use crate::stored::{self, Stored};

/// The first bytes of every stored unknown outcome: the
/// [`RecordFilter::response_prefix`] that lists them.
pub const UNKNOWN_PREFIX: &[u8] = &stored::UNKNOWN_PREFIX;

/// Whether a stored answer is an unknown outcome (the upstream timed out after the request
/// was sent): what an operator looks into and reopens.
pub fn is_unknown_outcome(stored: &[u8]) -> bool {
    stored.starts_with(UNKNOWN_PREFIX)
}

/// What a live HTTP record holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An attempt holds the key.
    InProgress {
        /// When its lease runs out.
        lease_expires_at: Timestamp,
    },
    /// An attempt held the key, but its lease ran out: it is gone or stalled, and a retry of
    /// the same request takes over.
    Stuck {
        /// When its lease ran out.
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
    /// No longer live, not yet purged (listings only).
    Expired,
}

impl RecordState {
    /// A stable lower-case name: `in_progress`, `stuck`, `stored`, `too_large`, `unknown`,
    /// `released`, `foreign`, `expired`.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::InProgress { .. } => "in_progress",
            Self::Stuck { .. } => "stuck",
            Self::Expired => "expired",
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
        (Status::InProgress, _) if record.lease_expires_at <= now => RecordState::Stuck {
            lease_expires_at: record.lease_expires_at,
        },
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

/// An HTTP answer as a record stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    /// Its status.
    pub status: StatusCode,
    /// Its headers, as replayed.
    pub headers: http::HeaderMap,
    /// Its body.
    pub body: Bytes,
    /// Its trailers (a gRPC answer's status is there); empty if it had none.
    pub trailers: http::HeaderMap,
}

/// The answer a completed record replays, if it holds an HTTP answer (not an unknown outcome,
/// an answer too large to keep, or another program's value).
pub fn stored_answer(record: &idem_core::Record) -> Option<StoredAnswer> {
    match Stored::decode(record.response.clone()?) {
        Ok(Stored::Response {
            status,
            headers,
            body,
            trailers,
        }) => Some(StoredAnswer {
            status,
            headers,
            body,
            trailers,
        }),
        _ => None,
    }
}

/// What a listed record holds, in HTTP terms (told from the head of its stored answer).
pub fn listed_state(listed: &Listed) -> RecordState {
    use idem_core::RecordState as S;
    let lease_expires_at = listed.lease_expires_at;
    match listed.state {
        S::InProgress => RecordState::InProgress { lease_expires_at },
        S::Stuck => RecordState::Stuck { lease_expires_at },
        S::Released => RecordState::Released,
        S::Expired => RecordState::Expired,
        S::Completed => match stored::kind_of_head(&listed.response_head) {
            Some(Stored::Response { status, .. }) => RecordState::Stored { status },
            Some(Stored::TooLarge { status }) => RecordState::TooLarge { status },
            Some(Stored::Unknown { until }) => RecordState::Unknown { until },
            None => RecordState::Foreign,
        },
    }
}

/// Records by state, with the unknown outcomes among the completed ones counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HttpCounts {
    /// Every record passing the filter, by store state.
    pub records: Counts,
    /// The completed records that hold an unknown outcome.
    pub unknown: u64,
}

/// Counts the records passing `filter` by state, and the unknown outcomes among them.
pub async fn counts(
    admin: &dyn RecordAdmin,
    filter: &RecordFilter,
    now: Timestamp,
) -> Result<HttpCounts, StoreError> {
    let records = admin.count(filter, now).await?;
    let unknown = RecordFilter {
        response_prefix: Some(Bytes::from_static(UNKNOWN_PREFIX)),
        ..filter.clone()
    };
    let unknown = admin.count(&unknown, now).await?.completed;
    Ok(HttpCounts { records, unknown })
}
