//! The idempotency record and its state machine.
//!
//! ```text
//!               begin(fp)                    complete(lease, response)
//!   (absent) ─────────────▶ IN_PROGRESS ───────────────────────────▶ COMPLETED ──ttl──▶ (absent)
//!      ▲                         │ release(lease)
//!      └──── RELEASED ◀──────────┘   (or the lease expires: the next begin takes over)
//! ```
//!
//! The transitions are pure functions over [`Record`] so that every store which serialises
//! access to a key (the memory store under a mutex, SQLite inside a write transaction) applies
//! exactly the same rules; stores that compute a transition inside the database (a SQL
//! statement, a Lua script) must agree with these functions, and the conformance suite checks
//! that they do.

mod lease;

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

pub use crate::error::StaleLease;
use crate::step::{self, Step, StepRefused};
use crate::{Fingerprint, Key, Timestamp, clock::duration_millis};
pub use lease::{DEFAULT_LEASE, Lease, LeaseId, MAX_LEASE, MIN_DURATION};

/// How long a completed record is kept, unless the caller says otherwise: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// The longest retention a caller of idem's servers may ask for: 365 days.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The lifecycle state of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// An attempt holds a lease and is running the work.
    InProgress,
    /// The work finished; its response is stored and replayed to every retry.
    Completed,
    /// The attempt gave the key back (a retryable failure). For `begin` the key is absent; the
    /// record is kept only so that the next lease gets a higher fencing number.
    Released,
}

impl Status {
    /// The name used in storage and in the JSON API.
    pub const fn as_str(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Released => "released",
        }
    }

    /// Parses [`Status::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "in_progress" => Some(Status::InProgress),
            "completed" => Some(Status::Completed),
            "released" => Some(Status::Released),
            _ => None,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What `begin` is asked to do.
#[derive(Debug, Clone)]
pub struct BeginRequest {
    /// The record's key.
    pub key: Key,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the lease lasts (at least [`MIN_DURATION`]).
    pub lease: Duration,
    /// How long the record is kept after it completes, is released, or its lease runs out
    /// (at least [`MIN_DURATION`]).
    pub ttl: Duration,
}

impl BeginRequest {
    /// A request with the default lease and TTL.
    pub fn new(key: Key, fingerprint: Fingerprint) -> Self {
        Self {
            key,
            fingerprint,
            lease: DEFAULT_LEASE,
            ttl: DEFAULT_TTL,
        }
    }

    /// Sets the lease length.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the TTL.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }
}

/// A stored result handed back to a retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The stored response, byte for byte.
    pub response: Bytes,
    /// The fence of the lease that completed it.
    pub fence: u64,
    /// When it was completed.
    pub completed_at: Timestamp,
    /// When the record expires: until then its answer does not change (short of an operator's
    /// repair), which is what lets a cache keep it ([`Record::expires_at`]).
    pub expires_at: Timestamp,
}

/// The answer of `begin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeginOutcome {
    /// The caller holds the key: run the work, then complete or release.
    Acquired(Lease),
    /// The work finished before with the same fingerprint: return the stored response.
    Replay(Replay),
    /// Another attempt holds a live lease on the key.
    InProgress {
        /// When that lease runs out (for `Retry-After`).
        lease_expires_at: Timestamp,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
}

/// One idempotency record as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its key.
    pub key: Key,
    /// The fingerprint of the request that owns it.
    pub fingerprint: Fingerprint,
    /// Where it is in its lifecycle.
    pub status: Status,
    /// The fence of the latest lease.
    pub fence: u64,
    /// The id of the latest lease (kept after completion, so a repeated `complete` by the same
    /// lease is recognised).
    pub lease_id: LeaseId,
    /// When the latest lease runs out.
    pub lease_expires_at: Timestamp,
    /// The stored response; `Some` exactly when completed.
    pub response: Option<Bytes>,
    /// The retention asked for at `begin`, in milliseconds.
    pub ttl_ms: u64,
    /// When the latest lease was acquired.
    pub created_at: Timestamp,
    /// When the record last changed.
    pub updated_at: Timestamp,
    /// When the record may be forgotten (see [`Record::is_live`]).
    pub expires_at: Timestamp,
    /// The steps of multi-step work recorded so far, in order ([`crate::step`]): kept through
    /// takeovers and releases so that a later attempt resumes, dropped by a reopen.
    pub steps: Vec<Step>,
}

/// What a store must do after a `begin`: answer `outcome`, and write `write` if it is `Some`.
#[derive(Debug, Clone)]
pub struct BeginStep {
    /// The answer.
    pub outcome: BeginOutcome,
    /// The record to store in place of the existing one, if anything changes.
    pub write: Option<Record>,
}

impl Record {
    /// Whether the record still exists for `begin` and `get` at `now`.
    ///
    /// A completed or released record lives until `expires_at` (its completion or release plus
    /// the TTL); an in-progress one until its lease has run out *and* a whole TTL after that. A record that
    /// is not live is absent: `get` does not return it, `begin` acquires over it and
    /// `purge_expired` may delete it.
    pub fn is_live(&self, now: Timestamp) -> bool {
        match self.status {
            Status::InProgress => self.lease_expires_at > now || self.expires_at > now,
            Status::Completed | Status::Released => self.expires_at > now,
        }
    }

    /// Whether this record holds exactly `lease`.
    pub fn holds(&self, lease: &Lease) -> bool {
        self.lease_id == lease.id && self.fence == lease.fence
    }

    /// The `begin` transition: `existing` is the stored record for `req.key`, if any (live or
    /// not), and the store must apply the returned step atomically with having read `existing`.
    /// `id` is the lease id an acquisition hands out; the store draws it
    /// ([`LeaseId::generate`]), so that the transition is a function of its inputs alone.
    pub fn begin(
        existing: Option<&Record>,
        req: &BeginRequest,
        now: Timestamp,
        id: LeaseId,
    ) -> BeginStep {
        if let Some(r) = existing.filter(|r| r.is_live(now)) {
            let outcome = match (r.status, r.fingerprint == req.fingerprint) {
                (Status::Completed, true) => Some(BeginOutcome::Replay(Replay {
                    response: r.response.clone().unwrap_or_default(),
                    fence: r.fence,
                    completed_at: r.updated_at,
                    expires_at: r.expires_at,
                })),
                (Status::Completed | Status::InProgress, false) => Some(BeginOutcome::Mismatch),
                // Steps of the first request took effect: another request may not resume them.
                (Status::Released, false) if !r.steps.is_empty() => Some(BeginOutcome::Mismatch),
                (Status::InProgress, true) if r.lease_expires_at > now => {
                    Some(BeginOutcome::InProgress {
                        lease_expires_at: r.lease_expires_at,
                    })
                }
                // An expired lease with the same fingerprint, or a released key: take over.
                (Status::InProgress, true) | (Status::Released, _) => None,
            };
            if let Some(outcome) = outcome {
                return BeginStep {
                    outcome,
                    write: None,
                };
            }
        }
        let fence = existing.map_or(Lease::first_fence(now), |r| Lease::next_fence(r.fence));
        let (lease, mut record) = Self::acquired(req, now, fence, id);
        // A takeover or a begin after a release resumes the steps already recorded.
        if let Some(live) = existing.filter(|r| r.is_live(now)) {
            record.steps.clone_from(&live.steps);
        }
        BeginStep {
            outcome: BeginOutcome::Acquired(lease),
            write: Some(record),
        }
    }

    /// The lease and the record a `begin` that acquires writes, given the fence and the lease
    /// id. Stores that
    /// decide `begin` inside the database (a SQL statement, a Lua script) take every value but
    /// the fence from here, so they agree with [`Record::begin`] to the millisecond.
    pub fn acquired(
        req: &BeginRequest,
        now: Timestamp,
        fence: u64,
        id: LeaseId,
    ) -> (Lease, Record) {
        let lease = Lease {
            id,
            fence,
            expires_at: now.saturating_add(req.lease.max(MIN_DURATION)),
        };
        let ttl = req.ttl.max(MIN_DURATION);
        let record = Record {
            key: req.key.clone(),
            fingerprint: req.fingerprint,
            status: Status::InProgress,
            fence,
            lease_id: lease.id,
            lease_expires_at: lease.expires_at,
            response: None,
            ttl_ms: duration_millis(ttl),
            created_at: now,
            updated_at: now,
            // Kept for a whole TTL after the lease runs out: a holder that stalls past its
            // lease finds the record (and its fence) still there for that long.
            expires_at: lease.expires_at.saturating_add(ttl),
            steps: Vec::new(),
        };
        (lease, record)
    }

    /// The `complete` transition. `Ok(Some(r))`: store `r`. `Ok(None)`: this lease already
    /// completed the record with the same response bytes; nothing changes. `Err`: refused,
    /// which includes a repeated `complete` by the same lease with a *different* response
    /// (the first response stays and is what retries replay).
    ///
    /// A lease that ran out but was not taken over may still complete: nobody else holds the
    /// key, and refusing would leave work that already took effect to run a second time.
    pub fn complete(
        existing: Option<&Record>,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<Option<Record>, StaleLease> {
        let mut r = existing.ok_or(StaleLease)?.clone();
        Ok(r.complete_in_place(lease, response, now)?.then_some(r))
    }

    /// [`Record::complete`] on the record itself: `Ok(true)` if it changed.
    pub fn complete_in_place(
        &mut self,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<bool, StaleLease> {
        if !(self.is_live(now) && self.holds(lease)) {
            return Err(StaleLease);
        }
        match self.status {
            Status::InProgress => {
                self.status = Status::Completed;
                self.response = Some(response);
                self.settle(now);
                Ok(true)
            }
            // A retry of the same completion is harmless; a different response would be
            // silently dropped, so it is refused instead.
            Status::Completed if self.response.as_deref() == Some(&response[..]) => Ok(false),
            Status::Completed | Status::Released => Err(StaleLease),
        }
    }

    /// The `release` transition: the attempt failed in a way that is safe to retry, so the key
    /// is given back. `Ok(None)`: this lease already released it.
    pub fn release(
        existing: Option<&Record>,
        lease: &Lease,
        now: Timestamp,
    ) -> Result<Option<Record>, StaleLease> {
        let mut r = existing.ok_or(StaleLease)?.clone();
        Ok(r.release_in_place(lease, now)?.then_some(r))
    }

    /// [`Record::release`] on the record itself: `Ok(true)` if it changed.
    pub fn release_in_place(&mut self, lease: &Lease, now: Timestamp) -> Result<bool, StaleLease> {
        if !(self.is_live(now) && self.holds(lease)) {
            return Err(StaleLease);
        }
        match self.status {
            Status::InProgress => {
                self.status = Status::Released;
                self.response = None;
                self.settle(now);
                Ok(true)
            }
            Status::Released => Ok(false),
            Status::Completed => Err(StaleLease),
        }
    }

    /// The `renew` transition: the holder of an in-progress record's lease extends it to
    /// `now + length` (at least [`MIN_DURATION`]), keeping its id and fence; retention runs on
    /// from the new lease end. Refused unless the live record is in progress under exactly
    /// this lease. A lease that ran out but was not taken over may still renew (as it may
    /// still complete): nobody else holds the key.
    pub fn renew_in_place(
        &mut self,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, StaleLease> {
        if !(self.is_live(now) && self.holds(lease) && self.status == Status::InProgress) {
            return Err(StaleLease);
        }
        let renewed = lease.renewed(length, now);
        self.lease_expires_at = renewed.expires_at;
        self.expires_at = self
            .lease_expires_at
            .saturating_add(Duration::from_millis(self.ttl_ms));
        self.updated_at = now;
        Ok(renewed)
    }

    /// The `record_step` transition: the holder of an in-progress record's lease records a
    /// step ([`crate::step`]), and `updated_at` moves to `now`, or a millisecond past its last
    /// value if that is not earlier. `Ok(true)` if the record changed; `Ok(false)` for a repeat
    /// of a step recorded with the same outcome. Refused as stale unless the live record is in
    /// progress under exactly this lease (a lease that ran out but was not taken over may still
    /// record, as it may still complete).
    pub fn record_step_in_place(
        &mut self,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<bool, StepRefused> {
        if !(self.is_live(now) && self.holds(lease) && self.status == Status::InProgress) {
            return Err(StaleLease.into());
        }
        let changed = step::record(&mut self.steps, step)?;
        if changed {
            // Forward even within the millisecond of the last write (or behind it, on a caller
            // whose clock is behind): every write past a claim changes the record, so a store
            // that settles by comparing the record with the one it claimed (Redis `SET … IFEQ`)
            // cannot miss a step.
            self.updated_at = now.max(self.updated_at.saturating_add(Duration::from_millis(1)));
        }
        Ok(changed)
    }

    /// The `reopen` transition: a completed record whose stored result must not be replayed
    /// any more (an outcome recorded as unknown, repaired by an operator or a policy) is turned
    /// into a released one, so that the next `begin` runs the work again with a higher fence.
    /// A one-time token is spent by the same step, under the name
    /// [`Store::release_completed`](crate::Store::release_completed): issued is completed, used
    /// is released.
    ///
    /// Applies only while the record is live, completed, and completed by the lease with
    /// `fence`; answers whether it changed. The record's steps are dropped: the work runs again
    /// from its start. Naming the fence makes concurrent reopens safe: once
    /// one of them has reopened the record (and perhaps a new attempt has acquired it), the
    /// others change nothing.
    pub fn reopen_in_place(&mut self, fence: u64, now: Timestamp) -> bool {
        if !(self.is_live(now) && self.status == Status::Completed && self.fence == fence) {
            return false;
        }
        self.status = Status::Released;
        self.response = None;
        self.steps.clear();
        self.settle(now);
        true
    }

    /// Stamps a completion or release: retention runs from now.
    fn settle(&mut self, now: Timestamp) {
        self.updated_at = now;
        self.expires_at = now.saturating_add(Duration::from_millis(self.ttl_ms));
    }
}

#[cfg(test)]
mod tests;
