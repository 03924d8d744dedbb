//! The lease: an attempt's time-limited right to run the work for one key and to settle its
//! record, with its random id and its fence, the number that rises at every acquisition so a
//! resource can refuse a holder that was overtaken.

use std::fmt;
use std::time::Duration;

use crate::Timestamp;

/// How long a lease lasts, unless the caller says otherwise: 60 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// The shortest lease and TTL: shorter ones (zero, or under a millisecond) are raised to this,
/// since a lease that has run out when it is granted would let two attempts in at once.
pub const MIN_DURATION: Duration = Duration::from_millis(1);
/// The longest lease a caller of idem's servers (`idem serve`, `idem gateway`) may ask for:
/// 24 hours.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);

/// The random identity of one lease: 128 bits, unguessable, shown as 32 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(u128);

impl LeaseId {
    /// A fresh random lease id.
    pub fn generate() -> Self {
        Self(rand::random())
    }

    /// Big-endian bytes, for stores that keep it as a blob.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Reads [`LeaseId::to_bytes`] back.
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(b))
    }

    /// Parses 32 hexadecimal digits.
    pub fn parse(s: &str) -> Option<Self> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(Self)
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: a full lease id is a capability to complete the record.
        write!(f, "LeaseId({:08x}…)", self.0 >> 96)
    }
}

/// The right to run the work for one key, and to complete or release its record.
///
/// `fence` rises every time a key's record is acquired (a first begin, a begin after release or
/// expiry, a takeover of an expired lease), so a resource that remembers the highest fence it
/// has seen can refuse a holder that was overtaken. It never goes back, not even when the
/// record is deleted or purged: see [`Lease::first_fence`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Which lease this is.
    pub id: LeaseId,
    /// The fencing number.
    pub fence: u64,
    /// When the lease runs out and another `begin` may take the key over.
    pub expires_at: Timestamp,
}

impl Lease {
    /// This lease extended to `now + length` (at least [`MIN_DURATION`]): what a successful
    /// `renew` hands back, in every store.
    pub fn renewed(&self, length: Duration, now: Timestamp) -> Lease {
        Lease {
            expires_at: now.saturating_add(length.max(MIN_DURATION)),
            ..*self
        }
    }

    /// The fence of a lease that creates a key's record at `now` (no record was there, or
    /// only one past its retention): the millisecond, times 1000 (at least 1000).
    ///
    /// A fence is the millisecond its record was created, times 1000, plus one for each
    /// acquisition since ([`Lease::next_fence`]). So a key's fences never go back, not even
    /// when its record is deleted, purged, or lost with a store that kept nothing: a record
    /// created again in a later millisecond starts above every fence the key had, unless its
    /// last record averaged more than one acquisition a microsecond. The clock is the caller's
    /// `now`, the one that already decides when leases run out.
    pub fn first_fence(now: Timestamp) -> u64 {
        now.as_millis().max(1).saturating_mul(FENCE_STRIDE)
    }

    /// The fence of a lease that takes over a record whose fence was `previous` (after a
    /// release, a lease that ran out, a reopen): one more, skipping whole thousands, so that
    /// only a record's creating lease has one.
    pub const fn next_fence(previous: u64) -> u64 {
        let next = previous.saturating_add(1);
        if next.is_multiple_of(FENCE_STRIDE) {
            next.saturating_add(1)
        } else {
            next
        }
    }

    /// Whether an attempt may have held the key before this lease, and so may have recorded
    /// steps (see [`crate::step`]) that this one resumes after. Not for the lease that created
    /// the record (a fence of whole thousands, [`Lease::first_fence`]): a caller can skip
    /// reading the record for steps then.
    pub const fn may_resume(&self) -> bool {
        !self.fence.is_multiple_of(FENCE_STRIDE)
    }

    /// Which acquisition of its record this lease is: 1 for the lease that created it, one
    /// more for each lease after it (runs that failed and gave the key back, attempts whose
    /// process died and whose lease was taken over). Exact up to 1000.
    pub fn acquisition(&self) -> u32 {
        Self::acquisition_of(self.fence)
    }

    /// [`Lease::acquisition`] of a lease with `fence`.
    pub fn acquisition_of(fence: u64) -> u32 {
        u32::try_from(fence % FENCE_STRIDE).map_or(u32::MAX, |n| n + 1)
    }
}

/// A fence counts acquisitions in its last three decimal digits (see [`Lease::first_fence`]).
const FENCE_STRIDE: u64 = 1000;
