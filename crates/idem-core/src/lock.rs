//! Distributed locks with fencing: names, owners, the lock state machine and the
//! [`LockStore`] trait every lock backend implements.
//!
//! A lock is held by one owner at a time, for a lease; every acquisition hands out a *fence*,
//! a number that strictly increases per lock name. A holder that paused past its lease (a GC
//! pause, a stopped process, a slow network) may still believe it holds the lock; a resource
//! that remembers the highest fence it has seen and refuses lower ones stops that holder's
//! writes. The lock gives efficiency (usually one worker at a time); the fence gives
//! correctness.
//!
//! # Fences survive lost state
//!
//! A fence is `max(previous fence + 1, the backend's clock in microseconds)` (a millisecond
//! clock times 1000 where the backend has no finer one). The backend's
//! clock term keeps fences increasing even when the previous fence is gone: a Redis restarted
//! without persistence, a replica promoted before it saw the last writes, a lock row purged
//! after an hour of disuse. On a server backend each acquisition takes at least one round trip,
//! far more than a microsecond, so a fence stays within a few counts of the clock, and any
//! fence handed out later, from any copy of the state, is higher, as long as the backend's
//! clock does not step back. In-process backends with a millisecond clock can run ahead of it
//! while they hand out more than 1000 fences a millisecond (see docs/design.md).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::{BoxFuture, StoreError};
use crate::{Timestamp, clock::duration_millis};

/// The longest lock name, in bytes.
pub const MAX_LOCK_NAME: usize = 200;

/// How long a lock's state (its last owner and fence) is kept after its lease ends, so that a
/// late release by that owner is still recognised. After that the state may be deleted: the
/// fence's clock term keeps the next fence higher.
pub const LOCK_STATE_RETENTION: Duration = Duration::from_secs(3600);

/// The name of a lock: 1 to [`MAX_LOCK_NAME`] bytes of visible ASCII (`!` to `~`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

/// Why a lock name or owner id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid lock {what}: {why}")]
pub struct InvalidLock {
    what: &'static str,
    why: &'static str,
}

impl LockName {
    /// Checks and wraps a name.
    pub fn new(name: &str) -> Result<Self, InvalidLock> {
        let invalid = |why| InvalidLock { what: "name", why };
        if name.is_empty() {
            return Err(invalid("it is empty"));
        }
        if name.len() > MAX_LOCK_NAME {
            return Err(invalid("it is longer than 200 bytes"));
        }
        if !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid("it may hold only visible ASCII characters"));
        }
        Ok(Self(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 128 bits of the name's SHA-256 in hex: a fixed-size key for backends.
    pub fn digest_hex(&self) -> String {
        crate::hex(&Sha256::digest(self.0.as_bytes())[..16])
    }

    /// The name shared, as release feeds carry it.
    pub fn shared(&self) -> Arc<str> {
        Arc::clone(&self.0)
    }
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockName({:?})", &*self.0)
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who holds a lock: an id the holder keeps (and may send again to retry an acquire), of
/// which backends store only the SHA-256 ([`LockOwner::digest`]), so that a copy of the lock
/// state cannot release anyone's lock.
#[derive(Clone, PartialEq, Eq)]
pub struct LockOwner(String);

impl LockOwner {
    /// A fresh owner id: 128 random bits as 32 hex digits.
    pub fn random() -> Self {
        Self(crate::random_hex128())
    }

    /// Checks and wraps an id chosen by a caller: 16 to 64 characters of `A-Z a-z 0-9 - _`
    /// (at least 16, so that ids cannot be guessed easily).
    pub fn parse(id: &str) -> Result<Self, InvalidLock> {
        let invalid = |why| InvalidLock { what: "id", why };
        if !(16..=64).contains(&id.len()) {
            return Err(invalid("it must be 16 to 64 characters long"));
        }
        if !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(invalid("it may hold only A-Z, a-z, 0-9, '-' and '_'"));
        }
        Ok(Self(id.to_owned()))
    }

    /// The id, to give back to the holder.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// What backends store and compare.
    pub fn digest(&self) -> OwnerDigest {
        OwnerDigest(Sha256::digest(self.0.as_bytes()).into())
    }
}

impl fmt::Debug for LockOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The id releases the lock: never print it.
        f.write_str("LockOwner(..)")
    }
}

/// The SHA-256 of a [`LockOwner`] id.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerDigest(pub [u8; 32]);

impl OwnerDigest {
    /// Lower-case hex, as text backends store it.
    pub fn to_hex(&self) -> String {
        crate::hex(&self.0)
    }
}

impl fmt::Debug for OwnerDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerDigest({}…)", &self.to_hex()[..8])
    }
}

/// A lease on a lock just granted or renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The fence of this holding: higher than any fence handed out before for the name.
    pub fence: u64,
    /// When the lease ends, by the backend's clock.
    pub expires_at: Timestamp,
}

/// A lock held now, as an operator's listing shows it: never its owner, whose digest is
/// derived from a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock {
    /// The lock's name.
    pub name: LockName,
    /// The fence of the current holding.
    pub fence: u64,
    /// When the lease ends, by the backend's clock.
    pub expires_at: Timestamp,
}

/// The answer of an acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquire {
    /// The caller holds the lock now (or still: an acquire repeated by the holder extends its
    /// lease and keeps its fence).
    Acquired(Held),
    /// Another owner holds it until `until` (by the backend's clock), unless it releases first.
    Busy {
        /// When the current lease ends.
        until: Timestamp,
    },
}

/// The answer of [`LockStore::acquire_queued`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    /// The holding, or who holds the lock still when the wait ran out.
    pub answer: Acquire,
    /// When the request that granted the holding was sent, by this process's monotonic
    /// clock: its lease runs from no earlier (so a holder's own view of its lease ends no
    /// later than the backend's, however long it waited in the queue).
    pub asked: std::time::Instant,
}

/// Why a lock operation did not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another owner holds the lock.
    #[error("the lock is held by another owner")]
    Held {
        /// When that owner's lease ends, unless it releases or renews first.
        until: Timestamp,
    },
    /// Waited as long as allowed without getting the lock.
    #[error("timed out waiting for the lock")]
    Timeout,
    /// The caller does not hold this lock (with this fence): it was released, its lease ran
    /// out, or another owner has taken it since.
    #[error("not the lock's owner")]
    NotOwner,
    /// The holder lost the lock (its lease ran out or was taken over); once lost, a guard stays
    /// lost.
    #[error("the lock was lost")]
    Lost,
    /// A name or owner id that cannot be used.
    #[error(transparent)]
    Invalid(#[from] InvalidLock),
    /// The backend failed; the operation may or may not have taken effect.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What a backend keeps per lock name; the pure transitions that in-process and SQL backends
/// apply (Redis runs the same rules in its scripts).
///
/// The lock is *held* by `owner` while `expires_at > now`. The state outlives the lease so that
/// the fence keeps increasing and a late release by the last owner is recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockState {
    /// The last owner to acquire it.
    pub owner: OwnerDigest,
    /// That owner's fence.
    pub fence: u64,
    /// When the lease ends (or ended; a release sets it to the release time).
    pub expires_at: Timestamp,
}

impl LockState {
    /// Acquires for `owner`: the new state, or when the current holder's lease ends.
    ///
    /// A holder acquiring again extends its lease and keeps its fence; anyone else gets a new,
    /// higher fence (see [`next_fence`]) once the lease has ended.
    pub fn acquire(
        current: Option<&LockState>,
        owner: OwnerDigest,
        lease: Duration,
        now: Timestamp,
    ) -> Result<LockState, Timestamp> {
        let expires_at = lease_end(now, lease);
        match current {
            Some(s) if s.expires_at > now && s.owner == owner => Ok(LockState { expires_at, ..*s }),
            Some(s) if s.expires_at > now => Err(s.expires_at),
            _ => Ok(LockState {
                owner,
                fence: next_fence(current.map_or(0, |s| s.fence), now),
                expires_at,
            }),
        }
    }

    /// Extends the lease of the holder `owner` with `fence`; refused once the lease has ended
    /// (a lost lock stays lost, even if nobody has taken it).
    pub fn renew(
        &mut self,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
        now: Timestamp,
    ) -> Result<Held, LockError> {
        if self.owner != owner || self.fence != fence || self.expires_at <= now {
            return Err(LockError::NotOwner);
        }
        self.expires_at = lease_end(now, lease);
        Ok(Held {
            fence,
            expires_at: self.expires_at,
        })
    }

    /// Ends the lease of `owner` with `fence`. Succeeds again when repeated, and after the
    /// lease ran out as long as nobody has acquired since; answers whether the lock was still
    /// held (so waiters should be told).
    pub fn release(
        &mut self,
        owner: OwnerDigest,
        fence: u64,
        now: Timestamp,
    ) -> Result<bool, LockError> {
        if self.owner != owner || self.fence != fence {
            return Err(LockError::NotOwner);
        }
        let was_held = self.expires_at > now;
        self.expires_at = self.expires_at.min(now);
        Ok(was_held)
    }

    /// Whether the state may be deleted at `now` (see [`LOCK_STATE_RETENTION`]).
    pub fn is_stale(&self, now: Timestamp) -> bool {
        self.expires_at.saturating_add(LOCK_STATE_RETENTION) <= now
    }
}

/// The fence after `previous`, at `now`: `max(previous + 1, now in microseconds)`.
pub fn next_fence(previous: u64, now: Timestamp) -> u64 {
    previous
        .saturating_add(1)
        .max(now.as_millis().saturating_mul(1000))
}

/// Lock names released, as a backend hears of them, to wake waiters early.
pub trait ReleaseListener: Send {
    /// The next release: `Some(name)`, or `None` when releases may have been missed (the
    /// listener fell behind or reconnected), so waiters should try again. A feed that has
    /// ended stays pending; waiters fall back to their timers.
    fn next(&mut self) -> BoxFuture<'_, Option<Arc<str>>>;
}

/// Where locks live.
///
/// # Contract
///
/// Each operation is one atomic step per name and follows [`LockState`]'s transitions, with the
/// backend's clock as `now` (the server's, for server backends, so that clients' clocks do not
/// matter). The conformance suite in `idem-testkit` checks every backend:
///
/// - **Mutual exclusion.** Of any number of concurrent acquires of a name that is not held,
///   exactly one answers `Acquired`; while a lease lasts nobody else acquires.
/// - **Fencing.** Every new holding gets a fence strictly greater than every fence handed out
///   before for the name.
/// - **Owner checks.** `renew` and `release` by anyone but the holder with its fence answer
///   [`LockError::NotOwner`] and change nothing. `release` repeated by the last owner succeeds.
/// - **Failures fail closed.** An error never hides a granted lease that the caller could not
///   learn of for long: the lease runs out by itself.
pub trait LockStore: Send + Sync + 'static {
    /// A short name of the backend.
    fn kind(&self) -> &'static str;

    /// Acquires `name` for `owner` for `lease`, or says who holds it until when.
    fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> impl Future<Output = Result<Acquire, StoreError>> + Send;

    /// Extends the holder's lease to `lease` from now.
    fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> impl Future<Output = Result<Held, LockError>> + Send;

    /// Releases the holding and wakes waiters.
    fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> impl Future<Output = Result<(), LockError>> + Send;

    /// Starts listening for releases (of any name); `None` if the backend cannot tell, and
    /// waiters poll. Subscribe *before* trying to acquire, so no release is missed in between.
    fn listen(&self) -> Option<Box<dyn ReleaseListener>>;

    /// Acquires `name`, waiting up to `wait` in the backend's own queue while another owner
    /// holds it, for backends that keep their waiters in order (ZooKeeper): each waiter is
    /// woken only when the one just ahead of it leaves, never by every release. `None` for a
    /// backend without such a queue; callers then wait on [`LockStore::listen`] and timers,
    /// as `idem::Locks` does.
    ///
    /// Answers `Busy` once `wait` has run out, with when the granting request was sent.
    /// Dropped before it answers, the future takes
    /// back what it added: its place in the queue, and a holding it took for an owner that did
    /// not hold the lock when it began (an owner that held it keeps it).
    fn acquire_queued(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
        wait: Duration,
    ) -> Option<BoxFuture<'static, Result<Queued, StoreError>>> {
        let _ = (name, owner, lease, wait);
        None
    }

    /// For a backend whose holdings belong to a session of the store's (ZooKeeper, etcd):
    /// resolves once the holdings granted from now on may end before their lease does,
    /// because the session they belong to ended, or lost touch with the service for long
    /// enough that the service may have ended it. `None` for a backend whose holdings end by
    /// their lease alone. Ask before acquiring, so that no ending is missed in between (a
    /// session that ends before the acquire is answered resolves it at once: a holding is
    /// given up too early, never kept too long).
    fn session_end(&self) -> Option<BoxFuture<'static, ()>> {
        None
    }

    /// The locks held now (whose lease has not run out by the backend's clock), ordered by
    /// name, at most `limit` of them; `None` if the backend cannot list them. Which ones a
    /// backend shows when more are held is its own choice (the first by name, or the first it
    /// finds); the listing is a snapshot, for an operator.
    fn held(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Option<Vec<HeldLock>>, StoreError>> + Send {
        let _ = limit;
        std::future::ready(Ok(None))
    }
}

/// An object-safe [`LockStore`], for choosing the backend at run time, as [`DynStore`] is
/// for records. Every `LockStore` is a `DynLockStore`; [`SharedLockStore`] is a `LockStore`
/// again.
///
/// [`DynStore`]: crate::DynStore
pub trait DynLockStore: Send + Sync + 'static {
    /// See [`LockStore::kind`].
    fn kind(&self) -> &'static str;
    /// See [`LockStore::acquire`].
    fn acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Acquire, StoreError>>;
    /// See [`LockStore::renew`].
    fn renew<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Held, LockError>>;
    /// See [`LockStore::release`].
    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> BoxFuture<'a, Result<(), LockError>>;
    /// See [`LockStore::listen`].
    fn listen(&self) -> Option<Box<dyn ReleaseListener>>;
    /// See [`LockStore::acquire_queued`].
    fn acquire_queued(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
        wait: Duration,
    ) -> Option<BoxFuture<'static, Result<Queued, StoreError>>>;
    /// See [`LockStore::session_end`].
    fn session_end(&self) -> Option<BoxFuture<'static, ()>>;
    /// See [`LockStore::held`].
    fn held(&self, limit: usize) -> BoxFuture<'_, Result<Option<Vec<HeldLock>>, StoreError>>;
}

impl<L: LockStore> DynLockStore for L {
    fn kind(&self) -> &'static str {
        LockStore::kind(self)
    }
    fn acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Acquire, StoreError>> {
        Box::pin(LockStore::acquire(self, name, owner, lease))
    }
    fn renew<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Held, LockError>> {
        Box::pin(LockStore::renew(self, name, owner, fence, lease))
    }
    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        Box::pin(LockStore::release(self, name, owner, fence))
    }
    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        LockStore::listen(self)
    }
    fn acquire_queued(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
        wait: Duration,
    ) -> Option<BoxFuture<'static, Result<Queued, StoreError>>> {
        LockStore::acquire_queued(self, name, owner, lease, wait)
    }
    fn session_end(&self) -> Option<BoxFuture<'static, ()>> {
        LockStore::session_end(self)
    }
    fn held(&self, limit: usize) -> BoxFuture<'_, Result<Option<Vec<HeldLock>>, StoreError>> {
        Box::pin(LockStore::held(self, limit))
    }
}

/// A lock backend chosen at run time.
pub type SharedLockStore = Arc<dyn DynLockStore>;

/// A lock backend behind an `Arc`: a [`SharedLockStore`] chosen at run time, or an
/// `Arc<MemoryStore>` shared by hand. Calls go through [`DynLockStore`].
impl<T: DynLockStore + ?Sized> LockStore for Arc<T> {
    fn kind(&self) -> &'static str {
        DynLockStore::kind(&**self)
    }
    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        DynLockStore::acquire(&**self, name, owner, lease).await
    }
    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<Held, LockError> {
        DynLockStore::renew(&**self, name, owner, fence, lease).await
    }
    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        DynLockStore::release(&**self, name, owner, fence).await
    }
    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        DynLockStore::listen(&**self)
    }
    fn acquire_queued(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
        wait: Duration,
    ) -> Option<BoxFuture<'static, Result<Queued, StoreError>>> {
        DynLockStore::acquire_queued(&**self, name, owner, lease, wait)
    }
    fn session_end(&self) -> Option<BoxFuture<'static, ()>> {
        DynLockStore::session_end(&**self)
    }
    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        DynLockStore::held(&**self, limit).await
    }
}

/// A lease length in whole milliseconds, as backends store it: at least 1 (a lease is never
/// granted already run out, so of two acquires in one millisecond only one wins) and at most
/// [`MAX_LEASE_MILLIS`] (so that its end fits every backend's numbers).
pub fn lease_millis(lease: Duration) -> u64 {
    duration_millis(lease).clamp(1, MAX_LEASE_MILLIS)
}

/// The longest lease a lock is granted, in milliseconds: 2^50 (over 35,000 years). Its end, added
/// to any time of this era, is still exact in a double (Redis's Lua numbers) and a signed 64-bit
/// integer (SQL).
pub const MAX_LEASE_MILLIS: u64 = 1 << 50;

/// When a lease of `lease` granted at `now` ends, by [`lease_millis`].
fn lease_end(now: Timestamp, lease: Duration) -> Timestamp {
    now.saturating_add(Duration::from_millis(lease_millis(lease)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(n: u8) -> OwnerDigest {
        OwnerDigest([n; 32])
    }
    const LEASE: Duration = Duration::from_secs(10);

    #[test]
    fn a_zero_lease_still_excludes_and_a_huge_one_is_capped() {
        let now = Timestamp::from_millis(1_000);
        let held = LockState::acquire(None, owner(1), Duration::ZERO, now).unwrap();
        assert_eq!(held.expires_at, Timestamp::from_millis(1_001));
        assert_eq!(
            LockState::acquire(Some(&held), owner(2), LEASE, now),
            Err(held.expires_at),
            "a second owner in the same millisecond waits"
        );
        let mut held = LockState::acquire(None, owner(1), Duration::MAX, now).unwrap();
        assert_eq!(held.expires_at.as_millis(), 1_000 + MAX_LEASE_MILLIS);
        let renewed = held
            .renew(owner(1), held.fence, Duration::ZERO, now)
            .unwrap();
        assert_eq!(renewed.expires_at, Timestamp::from_millis(1_001));
    }

    #[test]
    fn names_and_ids_are_checked() {
        assert!(LockName::new("orders:42").is_ok());
        assert!(LockName::new("").is_err());
        assert!(LockName::new("a b").is_err());
        assert!(LockName::new(&"x".repeat(201)).is_err());
        assert!(LockName::new(&"x".repeat(200)).is_ok());
        assert!(LockOwner::parse("short").is_err());
        assert!(LockOwner::parse("0123456789abcdef").is_ok());
        assert!(LockOwner::parse("0123456789abcdef!").is_err());
        let a = LockOwner::random();
        assert_eq!(a.as_str().len(), 32);
        assert_ne!(a, LockOwner::random());
        assert_eq!(format!("{a:?}"), "LockOwner(..)");
        assert_eq!(a.digest(), LockOwner::parse(a.as_str()).unwrap().digest());
    }

    #[test]
    fn one_holder_at_a_time_and_fences_increase() {
        let t = Timestamp::from_millis(1_000);
        let a = LockState::acquire(None, owner(1), LEASE, t).unwrap();
        assert_eq!(a.fence, 1_000_000);
        // Busy for another owner until the lease ends; the holder re-acquires in place.
        assert_eq!(
            LockState::acquire(Some(&a), owner(2), LEASE, t),
            Err(a.expires_at)
        );
        let again =
            LockState::acquire(Some(&a), owner(1), LEASE, t.saturating_add(LEASE / 2)).unwrap();
        assert_eq!(again.fence, a.fence);
        // After the lease, another owner takes it with a higher fence, even in the same
        // millisecond as far as the clock term goes.
        let b = LockState::acquire(Some(&again), owner(2), LEASE, again.expires_at).unwrap();
        assert!(b.fence > a.fence);
        let c = LockState::acquire(Some(&LockState { expires_at: t, ..b }), owner(3), LEASE, t)
            .unwrap();
        assert_eq!(c.fence, b.fence + 1);
    }

    #[test]
    fn renew_and_release_check_the_owner_and_fence() {
        let t = Timestamp::from_millis(1_000);
        let mut s = LockState::acquire(None, owner(1), LEASE, t).unwrap();
        assert!(matches!(
            s.renew(owner(2), s.fence, LEASE, t),
            Err(LockError::NotOwner)
        ));
        assert!(matches!(
            s.renew(owner(1), s.fence + 1, LEASE, t),
            Err(LockError::NotOwner)
        ));
        assert!(matches!(
            s.release(owner(2), s.fence, t),
            Err(LockError::NotOwner)
        ));
        let later = t.saturating_add(Duration::from_secs(5));
        let held = s.renew(owner(1), s.fence, LEASE, later).unwrap();
        assert_eq!(held.expires_at, later.saturating_add(LEASE));
        assert_eq!(s.release(owner(1), s.fence, later).ok(), Some(true));
        // Repeated: still fine, and nothing to wake.
        assert_eq!(s.release(owner(1), s.fence, later).ok(), Some(false));
        // A released lock cannot be renewed, and is free for others.
        assert!(s.renew(owner(1), s.fence, LEASE, later).is_err());
        assert!(LockState::acquire(Some(&s), owner(2), LEASE, later).is_ok());
    }

    #[test]
    fn a_lease_that_ran_out_cannot_be_renewed() {
        let t = Timestamp::from_millis(1_000);
        let mut s = LockState::acquire(None, owner(1), LEASE, t).unwrap();
        assert!(
            s.renew(owner(1), s.fence, LEASE, t.saturating_add(LEASE))
                .is_err()
        );
        // ...but its owner may still release it while nobody else took it.
        assert!(
            s.release(owner(1), s.fence, t.saturating_add(LEASE))
                .is_ok()
        );
        assert!(!s.is_stale(t.saturating_add(LEASE)));
        assert!(s.is_stale(t.saturating_add(LEASE + LOCK_STATE_RETENTION)));
    }

    #[test]
    fn a_holder_acquiring_again_extends_its_lease_and_keeps_its_fence() {
        let t = Timestamp::from_millis(1_000);
        let a = LockState::acquire(None, owner(1), LEASE, t).unwrap();
        let later = t.saturating_add(LEASE / 2);
        let again = LockState::acquire(Some(&a), owner(1), LEASE, later).unwrap();
        assert_eq!(
            again,
            LockState {
                owner: owner(1),
                fence: a.fence,
                expires_at: later.saturating_add(LEASE),
            },
            "the lease runs from the repeated acquire, not from the first"
        );
        // A millisecond before the end it still holds: the fence stays.
        let last = Timestamp::from_millis(a.expires_at.as_millis() - 1);
        let at_last = LockState::acquire(Some(&a), owner(1), LEASE, last).unwrap();
        assert_eq!(at_last.fence, a.fence);
        assert_eq!(at_last.expires_at, last.saturating_add(LEASE));
    }

    #[test]
    fn a_holder_acquiring_as_its_lease_ends_gets_a_new_fence() {
        let t = Timestamp::from_millis(1_000);
        let a = LockState::acquire(None, owner(1), LEASE, t).unwrap();
        // At `expires_at` the lease has ended: the same owner acquires anew, like anyone else.
        let end = a.expires_at;
        let again = LockState::acquire(Some(&a), owner(1), LEASE, end).unwrap();
        assert_eq!(
            again,
            LockState {
                owner: owner(1),
                fence: next_fence(a.fence, end),
                expires_at: end.saturating_add(LEASE),
            }
        );
        assert!(again.fence > a.fence);
    }

    #[test]
    fn an_owner_id_needs_a_valid_length_and_only_valid_characters() {
        let shortest = "0123456789-_abcd";
        let longest = "ABCDEFGHIJKLMNOPQRSTUVWXYZ-abcdefghijklmnopqrstuvwxyz_0123456789";
        for id in [shortest, longest] {
            assert_eq!(
                LockOwner::parse(id).map(|o| o.as_str().to_owned()),
                Ok(id.to_owned())
            );
        }
        let length = "invalid lock id: it must be 16 to 64 characters long";
        for id in [
            "",
            &shortest[1..],
            &format!("{longest}x"),
            &"-".repeat(15),
            &"_".repeat(65),
        ] {
            let refused = LockOwner::parse(id).map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(refused, Err(length.to_owned()), "{id:?}");
        }
        // Of a valid length, one character outside the set refuses it, wherever it is.
        let characters = "invalid lock id: it may hold only A-Z, a-z, 0-9, '-' and '_'";
        for bad in [
            ' ', '!', '.', '/', ':', '@', '[', '`', '{', '~', '+', '\0', 'é',
        ] {
            for id in [
                format!("{bad}{}", &shortest[1..]),
                format!("{shortest}{bad}"),
            ] {
                let refused = LockOwner::parse(&id).map(|_| ()).map_err(|e| e.to_string());
                assert_eq!(refused, Err(characters.to_owned()), "{id:?}");
            }
        }
    }

    #[test]
    fn a_lock_name_shows_as_itself_and_digests_to_a_fixed_key() {
        let name = LockName::new("orders:42").unwrap();
        assert_eq!(name.as_str(), "orders:42");
        assert_eq!(name.to_string(), "orders:42");
        assert_eq!(format!("{name:?}"), r#"LockName("orders:42")"#);
        assert_eq!(&*name.shared(), "orders:42");
        // The first 128 bits of SHA-256("orders:42").
        assert_eq!(name.digest_hex(), "8a5f217ddb0c9f03d16c0db38f2ba1c3");
        assert_eq!(
            LockName::new("").map_err(|e| e.to_string()),
            Err("invalid lock name: it is empty".to_owned())
        );
    }

    #[test]
    fn an_owner_is_kept_as_the_sha256_of_its_id_and_never_shown_whole() {
        let id = LockOwner::parse("owner-0123456789_abcdef").unwrap();
        let sha256 = "5cfadabb4ba988cf3cf6165340c0e86190036ba328f916d2e768aed13f13e7c9";
        assert_eq!(id.digest().to_hex(), sha256);
        assert_eq!(format!("{:?}", id.digest()), "OwnerDigest(5cfadabb…)");
        assert_eq!(format!("{id:?}"), "LockOwner(..)");
    }

    /// A backend answering every call with values of its own and noting its arguments, to see
    /// that [`DynLockStore`] and `Arc` pass calls and answers through unchanged.
    struct Recorder {
        calls: std::sync::Mutex<Vec<String>>,
        asked: std::time::Instant,
    }

    impl Recorder {
        fn note(&self, call: String) {
            self.calls.lock().unwrap().push(call);
        }
    }

    const UNTIL: Timestamp = Timestamp::from_millis(7_000);

    impl LockStore for Recorder {
        fn kind(&self) -> &'static str {
            "recorder"
        }
        async fn acquire(
            &self,
            name: &LockName,
            owner: OwnerDigest,
            lease: Duration,
        ) -> Result<Acquire, StoreError> {
            self.note(format!("acquire {name} {owner:?} {lease:?}"));
            Ok(Acquire::Busy { until: UNTIL })
        }
        async fn renew(
            &self,
            name: &LockName,
            owner: OwnerDigest,
            fence: u64,
            lease: Duration,
        ) -> Result<Held, LockError> {
            self.note(format!("renew {name} {owner:?} {fence} {lease:?}"));
            Ok(Held {
                fence,
                expires_at: UNTIL,
            })
        }
        async fn release(
            &self,
            name: &LockName,
            owner: OwnerDigest,
            fence: u64,
        ) -> Result<(), LockError> {
            self.note(format!("release {name} {owner:?} {fence}"));
            Err(LockError::NotOwner)
        }
        fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
            self.note("listen".to_owned());
            Some(Box::new(OneRelease(Some("orders:42".into()))))
        }
        fn acquire_queued(
            &self,
            name: &LockName,
            owner: OwnerDigest,
            lease: Duration,
            wait: Duration,
        ) -> Option<BoxFuture<'static, Result<Queued, StoreError>>> {
            self.note(format!(
                "acquire_queued {name} {owner:?} {lease:?} {wait:?}"
            ));
            let queued = Queued {
                answer: Acquire::Busy { until: UNTIL },
                asked: self.asked,
            };
            Some(Box::pin(std::future::ready(Ok(queued))))
        }
        fn session_end(&self) -> Option<BoxFuture<'static, ()>> {
            self.note("session_end".to_owned());
            Some(Box::pin(std::future::ready(())))
        }
        async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
            self.note(format!("held {limit}"));
            Ok(Some(vec![HeldLock {
                name: LockName::new("orders:42").unwrap(),
                fence: 3,
                expires_at: UNTIL,
            }]))
        }
    }

    struct OneRelease(Option<Arc<str>>);

    impl ReleaseListener for OneRelease {
        fn next(&mut self) -> BoxFuture<'_, Option<Arc<str>>> {
            Box::pin(std::future::ready(self.0.take()))
        }
    }

    /// The answer of a future that is ready at its first poll, as the recorder's are.
    fn at_once<F: Future>(fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => panic!("the recorder answers at once"),
        }
    }

    #[test]
    fn a_shared_store_passes_every_call_and_answer_through() {
        let recorder = Arc::new(Recorder {
            calls: std::sync::Mutex::new(Vec::new()),
            asked: std::time::Instant::now(),
        });
        // `Arc<Recorder>` is a `LockStore` through `DynLockStore`, as a `SharedLockStore` is.
        let store = Arc::clone(&recorder);
        let name = LockName::new("orders:42").unwrap();
        let (who, lease, wait) = (
            owner(1),
            Duration::from_millis(1_500),
            Duration::from_secs(2),
        );
        assert_eq!(LockStore::kind(&store), "recorder");
        assert_eq!(
            at_once(LockStore::acquire(&store, &name, who, lease)).unwrap(),
            Acquire::Busy { until: UNTIL }
        );
        assert_eq!(
            at_once(LockStore::renew(&store, &name, who, 5, lease)).unwrap(),
            Held {
                fence: 5,
                expires_at: UNTIL
            }
        );
        assert!(matches!(
            at_once(LockStore::release(&store, &name, who, 5)),
            Err(LockError::NotOwner)
        ));
        let mut listener = LockStore::listen(&store).expect("the recorder's listener");
        assert_eq!(at_once(listener.next()).as_deref(), Some("orders:42"));
        let queued = LockStore::acquire_queued(&store, &name, who, lease, wait)
            .expect("the recorder's queue");
        assert_eq!(
            at_once(queued).unwrap(),
            Queued {
                answer: Acquire::Busy { until: UNTIL },
                asked: recorder.asked,
            }
        );
        at_once(LockStore::session_end(&store).expect("the recorder's session"));
        let held = at_once(LockStore::held(&store, 10)).unwrap().unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!((held[0].name.as_str(), held[0].fence), ("orders:42", 3));
        let o = format!("{who:?}");
        assert_eq!(
            *recorder.calls.lock().unwrap(),
            [
                format!("acquire orders:42 {o} 1.5s"),
                format!("renew orders:42 {o} 5 1.5s"),
                format!("release orders:42 {o} 5"),
                "listen".to_owned(),
                format!("acquire_queued orders:42 {o} 1.5s 2s"),
                "session_end".to_owned(),
                "held 10".to_owned(),
            ]
        );
    }
}
