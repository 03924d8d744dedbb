//! What operators need of a store: list records a page at a time, count them by state, and
//! repair one record, fenced, so a repair never lands on a record that moved on after it was
//! shown.
//!
//! A store offers these through [`Store::admin`](crate::Store::admin). The listing never loads
//! a whole table or keyspace: it pages by a cursor (the last key of the page in key order for
//! tables, Redis's `SCAN` cursor for a keyspace), never by an offset, so the thousandth page
//! costs what the first does.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use bytes::Bytes;

use crate::error::{BoxFuture, StoreError};
use crate::key::{Namespace, Scope};
pub use crate::page::{Cursor, InvalidListing, MAX_PAGE, RESPONSE_HEAD};
use crate::record::{Record, Status};
use crate::{Key, Timestamp};

/// Where a record is, as an operator sees it at a given instant. Every record is in exactly
/// one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecordState {
    /// An attempt holds the key and its lease is running.
    InProgress,
    /// In progress, but the lease ran out: the attempt is gone or stalled, and the next `begin`
    /// with the same request takes over.
    Stuck,
    /// Completed: its answer is replayed.
    Completed,
    /// Given back: the next `begin` runs the work.
    Released,
    /// No longer live (absent to `begin` and `get`), but not yet purged.
    Expired,
}

impl RecordState {
    /// Every state, in lifecycle order.
    pub const ALL: [Self; 5] = [
        Self::InProgress,
        Self::Stuck,
        Self::Completed,
        Self::Released,
        Self::Expired,
    ];

    /// The state of `record` at `now`.
    pub fn of(record: &Record, now: Timestamp) -> Self {
        if !record.is_live(now) {
            return Self::Expired;
        }
        match record.status {
            Status::InProgress if record.lease_expires_at > now => Self::InProgress,
            Status::InProgress => Self::Stuck,
            Status::Completed => Self::Completed,
            Status::Released => Self::Released,
        }
    }

    /// A stable lower-case name: `in_progress`, `stuck`, `completed`, `released`, `expired`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Stuck => "stuck",
            Self::Completed => "completed",
            Self::Released => "released",
            Self::Expired => "expired",
        }
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state name that is not one of [`RecordState`]'s.
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown record state {0:?}: expected in_progress, stuck, completed, released or expired")]
pub struct UnknownState(String);

impl FromStr for RecordState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownState(s.chars().take(40).collect()))
    }
}

/// Which records a listing or a count covers. Every field narrows it; the default covers
/// every record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordFilter {
    /// Only this scope's records.
    pub scope: Option<Scope>,
    /// Only this namespace's records.
    pub namespace: Option<Namespace>,
    /// Only records in this state (ignored by [`RecordAdmin::count`], which counts every
    /// state).
    pub state: Option<RecordState>,
    /// Only records whose latest lease was acquired at or before this instant (at least so
    /// old).
    pub created_before: Option<Timestamp>,
    /// Only completed records whose stored response starts with these bytes (at most
    /// [`RESPONSE_HEAD`]): how a layer above finds its own kinds of answer, such as the HTTP
    /// layer's unknown outcomes.
    pub response_prefix: Option<Bytes>,
}

impl RecordFilter {
    /// Whether `record` passes the filter at `now`.
    pub fn matches(&self, record: &Record, now: Timestamp) -> bool {
        self.matches_ignoring_state(record)
            && self.state.is_none_or(|s| s == RecordState::of(record, now))
    }

    /// Whether `record` passes every part of the filter but the state.
    pub fn matches_ignoring_state(&self, record: &Record) -> bool {
        self.scope.as_ref().is_none_or(|s| s == record.key.scope())
            && self
                .namespace
                .as_ref()
                .is_none_or(|n| n == record.key.namespace())
            && self.created_before.is_none_or(|t| record.created_at <= t)
            && self.response_prefix.as_ref().is_none_or(|p| {
                record.status == Status::Completed
                    && record.response.as_ref().is_some_and(|r| r.starts_with(p))
            })
    }

    /// Checks the parts a store relies on: a response prefix of at most [`RESPONSE_HEAD`]
    /// bytes.
    pub fn validate(&self) -> Result<(), InvalidListing> {
        match &self.response_prefix {
            Some(p) if p.len() > RESPONSE_HEAD => Err(InvalidListing::PrefixTooLong),
            _ => Ok(()),
        }
    }
}

/// One record as a listing shows it: everything but the fingerprint and the bulk of the
/// response (use `get` for the whole record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its key.
    pub key: Key,
    /// Its state when listed.
    pub state: RecordState,
    /// The fence of its latest lease.
    pub fence: u64,
    /// When its latest lease was acquired.
    pub created_at: Timestamp,
    /// When it last changed.
    pub updated_at: Timestamp,
    /// When its latest lease runs (or ran) out.
    pub lease_expires_at: Timestamp,
    /// When it may be forgotten.
    pub expires_at: Timestamp,
    /// The stored response's length, if it has one.
    pub response_len: Option<u64>,
    /// The first [`RESPONSE_HEAD`] bytes of the stored response (empty without one).
    pub response_head: Bytes,
}

impl Listed {
    /// How `record` is listed at `now`.
    pub fn of(record: &Record, now: Timestamp) -> Self {
        let response = record.response.clone().unwrap_or_default();
        Self {
            key: record.key.clone(),
            state: RecordState::of(record, now),
            fence: record.fence,
            created_at: record.created_at,
            updated_at: record.updated_at,
            lease_expires_at: record.lease_expires_at,
            expires_at: record.expires_at,
            response_len: record.response.as_ref().map(|r| r.len() as u64),
            response_head: response.slice(..response.len().min(RESPONSE_HEAD)),
        }
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    /// The records, in the store's order.
    pub records: Vec<Listed>,
    /// Where the next page starts; `None` when the listing is complete. A page may hold fewer
    /// records than asked for and still have a next one (a scan found few matches in its
    /// stretch of the keyspace), and a scan's page may hold a few more.
    pub next: Option<Cursor>,
}

impl Page {
    /// A page of a listing in key order, `limit` asked for: when it is full, the next starts
    /// after its last key (and answers whether there is more); when it is not, the listing is
    /// complete.
    pub fn in_key_order(records: Vec<Listed>, limit: usize) -> Self {
        let next = (records.len() == limit)
            .then(|| records.last().map(|l| Cursor::After(l.key.clone())))
            .flatten();
        Self { records, next }
    }
}

/// Checks a key-ordered listing's arguments as [`check_listing`] does, and gives the key it
/// starts after; a scan's cursor is not one such a store handed out.
pub fn key_listing<'a>(
    filter: &RecordFilter,
    after: Option<&'a Cursor>,
    limit: usize,
) -> Result<Option<&'a Key>, StoreError> {
    check_listing(filter, limit)?;
    match after {
        None => Ok(None),
        Some(Cursor::After(key)) => Ok(Some(key)),
        Some(Cursor::Scan(_)) => Err(InvalidListing::Cursor.into()),
    }
}

/// How many records are in each state, and the age of the oldest attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// In progress with a running lease.
    pub in_progress: u64,
    /// In progress with a lease that ran out.
    pub stuck: u64,
    /// Completed.
    pub completed: u64,
    /// Released.
    pub released: u64,
    /// Expired but not purged.
    pub expired: u64,
    /// When the oldest live in-progress or stuck record's lease was acquired.
    pub oldest_in_progress: Option<Timestamp>,
}

impl Counts {
    /// The count of one state.
    pub fn get(&self, state: RecordState) -> u64 {
        match state {
            RecordState::InProgress => self.in_progress,
            RecordState::Stuck => self.stuck,
            RecordState::Completed => self.completed,
            RecordState::Released => self.released,
            RecordState::Expired => self.expired,
        }
    }

    /// Adds one record in `state`, acquired at `created_at`.
    pub fn add(&mut self, state: RecordState, created_at: Timestamp) {
        let slot = match state {
            RecordState::InProgress => &mut self.in_progress,
            RecordState::Stuck => &mut self.stuck,
            RecordState::Completed => &mut self.completed,
            RecordState::Released => &mut self.released,
            RecordState::Expired => &mut self.expired,
        };
        *slot += 1;
        if matches!(state, RecordState::InProgress | RecordState::Stuck) {
            self.oldest_in_progress = Some(
                self.oldest_in_progress
                    .map_or(created_at, |t| t.min(created_at)),
            );
        }
    }

    /// Every record counted.
    pub fn total(&self) -> u64 {
        RecordState::ALL.into_iter().map(|s| self.get(s)).sum()
    }
}

/// A repair an operator applies to one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Repair {
    /// Give the key back, so the next `begin` runs the work: for an in-progress or stuck record
    /// whose attempt is gone, or a completed one whose answer must not stand (an unknown
    /// outcome that did not take effect). Its response is dropped and its retention starts
    /// again, as a `release` does.
    Release,
    /// Forget the record, as a purge would.
    Delete,
}

impl Repair {
    /// A stable lower-case name: `release`, `delete`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Delete => "delete",
        }
    }

    /// Whether this repair applies to a record in `state`: releasing needs a live record that
    /// is not released already; anything may be deleted.
    pub const fn applies_to(self, state: RecordState) -> bool {
        match self {
            Self::Release => matches!(
                state,
                RecordState::InProgress | RecordState::Stuck | RecordState::Completed
            ),
            Self::Delete => true,
        }
    }

    /// The record after releasing it at `now`. A completed record's steps are dropped, as a
    /// reopen drops them (its answer must not stand: the work runs again from its start); an
    /// in-progress one keeps them, so the next attempt resumes.
    pub fn released(mut record: Record, now: Timestamp) -> Record {
        if record.status == Status::Completed {
            record.steps.clear();
        }
        record.status = Status::Released;
        record.response = None;
        record.updated_at = now;
        record.expires_at = now.saturating_add(Duration::from_millis(record.ttl_ms));
        record
    }
}

/// What was shown to the operator, and so what a repair may change: the record must still be
/// in this state with this fence when the repair lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown {
    /// The state that was shown.
    pub state: RecordState,
    /// The fence that was shown.
    pub fence: u64,
}

impl Shown {
    /// Whether `record` is still what was shown, at `now`.
    pub fn is(&self, record: &Record, now: Timestamp) -> bool {
        record.fence == self.fence && RecordState::of(record, now) == self.state
    }
}

/// Listing, counting and repairing records: what an operator's tools need of a store.
///
/// # Contract
///
/// - **`list`** returns records matching the filter at `now`, at most about `limit` of them
///   (1 to [`MAX_PAGE`]), starting after `after`; following `next` until it is `None` visits
///   every record that matched throughout exactly once. Records written meanwhile may or may
///   not appear. It never loads the whole store and never pages by offset: a page by cursor
///   costs about its size wherever it starts. A filter no index answers (state, age, response
///   prefix) costs more: stores with an ordered key index (tables, memory) read on in key
///   order until the page is full, up to one pass over the records in scope; a store that
///   scans a keyspace (Redis) stops after a bounded stretch and may hand back a short, even
///   empty, page with a `next`, so callers that want `limit` matches follow `next`.
/// - **`count`** counts the records that pass the filter (its state ignored) by state.
///   Stores with no index on state may count by reading every record; it is for dashboards
///   and alerts that poll now and then, not for every request.
/// - **`repair`** applies `repair` to the record under `key` if and only if it is, at `now`,
///   still what was `shown` (same state, same fence) and the repair applies to that state;
///   answers whether it did, in one atomic step. So a bulk repair of what an operator saw
///   never touches a record that moved on meanwhile.
pub trait RecordAdmin: Send + Sync {
    /// One page of records matching `filter`, after `after`.
    fn list<'a>(
        &'a self,
        filter: &'a RecordFilter,
        after: Option<&'a Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Page, StoreError>>;

    /// The records passing `filter` (its state ignored), by state.
    fn count<'a>(
        &'a self,
        filter: &'a RecordFilter,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Counts, StoreError>>;

    /// Applies `repair` to the record under `key` if it is still what was `shown`.
    fn repair<'a>(
        &'a self,
        key: &'a Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

/// Checks a listing's arguments as every store must; `Err` names what is wrong.
pub fn check_listing(filter: &RecordFilter, limit: usize) -> Result<(), StoreError> {
    let invalid = if limit == 0 || limit > MAX_PAGE {
        Some(InvalidListing::PageSize)
    } else {
        filter.validate().err()
    };
    match invalid {
        Some(e) => Err(StoreError::Invalid(e)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BeginRequest, Fingerprint, LeaseId};

    fn record(now: Timestamp) -> Record {
        let req = BeginRequest::new(
            Key::parse("tenant-1", "pay.v2", "k!~x").unwrap(),
            Fingerprint::of_bytes(b"x"),
        )
        .with_lease(Duration::from_secs(10))
        .with_ttl(Duration::from_secs(100));
        Record::acquired(&req, now, 3, LeaseId::generate()).1
    }

    #[test]
    fn cursors_survive_their_text_form() {
        let now = Timestamp::from_millis(1_000);
        for cursor in [Cursor::After(record(now).key), Cursor::Scan(17)] {
            let text = cursor.to_string();
            assert!(text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
            assert_eq!(text.parse::<Cursor>().unwrap(), cursor);
        }
        for bad in [
            "",
            "k",
            "s0",
            "s-1",
            "s07",
            "s+7",
            "kzz-00-00",
            "k61-62",
            "x1",
            "k61-62-6",
        ] {
            assert_eq!(bad.parse::<Cursor>(), Err(InvalidListing::Cursor), "{bad}");
        }
    }

    #[test]
    fn every_record_is_in_one_state_over_its_life() {
        let t0 = Timestamp::from_millis(1_000_000);
        let r = record(t0);
        let at = |s| t0.saturating_add(Duration::from_secs(s));
        assert_eq!(RecordState::of(&r, at(0)), RecordState::InProgress);
        assert_eq!(RecordState::of(&r, at(10)), RecordState::Stuck);
        assert_eq!(RecordState::of(&r, at(109)), RecordState::Stuck);
        assert_eq!(RecordState::of(&r, at(110)), RecordState::Expired);
        let done = Record::complete(
            Some(&r),
            &crate::Lease {
                id: r.lease_id,
                fence: r.fence,
                expires_at: r.lease_expires_at,
            },
            Bytes::from_static(b"IDH1\x01ok"),
            at(1),
        )
        .unwrap()
        .unwrap();
        assert_eq!(RecordState::of(&done, at(2)), RecordState::Completed);
        let released = Repair::released(done.clone(), at(3));
        assert_eq!(RecordState::of(&released, at(4)), RecordState::Released);
        assert_eq!(RecordState::of(&released, at(103)), RecordState::Expired);

        let unknown = RecordFilter {
            response_prefix: Some(Bytes::from_static(b"IDH1\x01")),
            ..RecordFilter::default()
        };
        assert!(unknown.matches(&done, at(2)));
        assert!(!unknown.matches(&released, at(4)));
        let listed = Listed::of(&done, at(2));
        assert_eq!(listed.response_len, Some(7));
        assert_eq!(&listed.response_head[..], b"IDH1\x01ok");
    }

    #[test]
    fn a_repair_lands_only_on_what_was_shown() {
        let t0 = Timestamp::from_millis(1_000_000);
        let r = record(t0);
        let later = t0.saturating_add(Duration::from_secs(11));
        let shown = Shown {
            state: RecordState::Stuck,
            fence: 3,
        };
        assert!(shown.is(&r, later));
        assert!(!shown.is(&r, t0), "still running, not stuck");
        assert!(!Shown { fence: 2, ..shown }.is(&r, later));
        assert!(Repair::Release.applies_to(RecordState::Stuck));
        assert!(!Repair::Release.applies_to(RecordState::Released));
        assert!(!Repair::Release.applies_to(RecordState::Expired));
        assert!(Repair::Delete.applies_to(RecordState::Expired));
    }

    #[test]
    fn listings_are_bounded() {
        let f = RecordFilter::default();
        assert!(check_listing(&f, 0).is_err());
        assert!(check_listing(&f, MAX_PAGE + 1).is_err());
        assert!(check_listing(&f, MAX_PAGE).is_ok());
        let long = RecordFilter {
            response_prefix: Some(Bytes::from(vec![0; RESPONSE_HEAD + 1])),
            ..f
        };
        assert!(check_listing(&long, 10).is_err());
    }
}
