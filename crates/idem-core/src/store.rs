//! The `Store` trait: where records live.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::admin::RecordAdmin;
use crate::counter::{Counters, DynCounters};
pub use crate::error::{BoxFuture, LeaseError, StoreError};
use crate::record::{BeginOutcome, BeginRequest, Lease, Record};
use crate::step::{Step, StepError};
use crate::{Key, Timestamp};

/// Where idempotency records live.
///
/// # Contract
///
/// Every implementation must behave exactly as the pure transitions on [`Record`]
/// ([`Record::begin`], [`Record::complete`], [`Record::release`], [`Record::is_live`]) describe,
/// and the conformance suite in `idem-testkit` checks that it does. In particular:
///
/// - **`begin` is one atomic step.** Reading the current record, deciding, and writing the new
///   one happen as a single linearizable operation per key: for any set of concurrent `begin`s
///   of one key whose records are absent, *exactly one* answers `Acquired`; every other answers
///   `InProgress` (or `Replay`/`Mismatch` if the winner has completed meanwhile). Never two
///   `Acquired` for leases that are live at the same time.
/// - **Fencing.** Each `Acquired` lease for a key has a fence strictly greater than every fence
///   issued before for that key while its record was kept (released and expired records keep
///   their fence until they are purged).
/// - **Stale leases are refused.** `complete` and `release` succeed only while the live record
///   holds that very lease (same id and fence). A lease whose record was taken over, released,
///   completed by another lease, or is no longer live (its retention ended, or it was purged)
///   gets [`LeaseError::Stale`] and changes nothing. A lease that ran out but was *not* taken
///   over may still complete: nobody else holds the key, and refusing would make the next
///   `begin` run work that already took effect a second time.
/// - **Repeats.** Repeating a successful `release`, or a successful `complete` with the same
///   response bytes, with the same lease is a no-op success. A repeated `complete` with a
///   different response is [`LeaseError::Stale`] and the first response stays; the comparison
///   is part of the same atomic step.
/// - **Expiry is by the caller's clock.** Every operation takes `now`; a store never reads a
///   clock to decide liveness. A completed or released record expires at `completed_at + ttl`;
///   an expired record is absent to `begin` and `get`. Native TTLs (Redis) may be used only to
///   reclaim space, never to decide an outcome before `now` says so.
/// - **`renew`** extends the lease of a live in-progress record held by exactly that lease,
///   atomically, keeping its id and fence.
/// - **`record_step`** records a step on a live in-progress record held by exactly that lease,
///   as [`Record::record_step_in_place`] decides, atomically; a repeat of a recorded step is a
///   no-op success. Steps survive takeovers and releases and are handed back by `get`; a
///   reopen or the record's expiry drops them. When it returns `Ok`, the step is as durable as
///   a `complete`.
/// - **`reopen`** turns a live record completed by the lease with that fence into a released
///   one, atomically, and does nothing to any other record. (`release_completed` is the same
///   step under the name one-time tokens use; it is provided, and not to be overridden.)
/// - **Counters** ([`Counters`], a supertrait) follow their own contract.
/// - **`purge_expired`** deletes at most `limit` records that are not live at `now` and
///   returns how many it deleted; it never deletes a live record.
/// - **Durability.** When `complete` returns `Ok`, the response survives a crash of the calling
///   process (and, for stores that say so, of the machine).
/// - **Failures fail closed.** Any error is reported as `Err`; a store never answers `Acquired`
///   without having stored the in-progress record.
/// - **Responses are opaque bytes**, returned by `Replay` exactly as stored.
/// - **`begin_from_memory`**, where a store overrides it, answers only what `begin` would
///   answer at `now` without writing anything (`Replay` or `Mismatch`), from memory, changing
///   no record; `None` when it does not know.
pub trait Store: Counters + Send + Sync + 'static {
    /// A short name of the backend (`"memory"`, `"sqlite"`).
    fn kind(&self) -> &'static str;

    /// Claims the key, or reports why not. See the contract above.
    fn begin(
        &self,
        req: &BeginRequest,
        now: Timestamp,
    ) -> impl Future<Output = Result<BeginOutcome, StoreError>> + Send;

    /// The answer `begin` would give `req` at `now`, if it is known without I/O and takes no
    /// write: a `Replay` or a `Mismatch` from the completed records a store keeps in memory
    /// (idem-store's `ReplayCache` does). `None` when it is not known; never
    /// `Acquired` or `InProgress`. It claims nothing and changes no record, so a caller may ask
    /// it where an abandoned `begin` would be unsafe (before handing the claim to a task of
    /// its own) and go on to `begin` when it answers `None`.
    ///
    /// Provided: `None`, for stores that keep nothing in memory.
    fn begin_from_memory(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        let _ = (req, now);
        None
    }

    /// Stores `response` as the record's result and marks it completed.
    fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), LeaseError>> + Send;

    /// Gives the key back after a retryable failure, so that the next `begin` runs the work.
    fn release(
        &self,
        key: &Key,
        lease: &Lease,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), LeaseError>> + Send;

    /// Extends `lease` to `now + length` (see [`Record::renew_in_place`]) and returns it with
    /// its new end; [`LeaseError::Stale`] if the record is not in progress under this lease.
    fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> impl Future<Output = Result<Lease, LeaseError>> + Send;

    /// Records `step` on the record `lease` holds (see [`Record::record_step_in_place`]).
    fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StepError>> + Send;

    /// Turns the live record for `key`, if it is completed with `fence`, into a released one
    /// (see [`Record::reopen_in_place`]); answers whether it changed.
    fn reopen(
        &self,
        key: &Key,
        fence: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Releases the live record for `key` if it is completed with `fence`, and answers whether
    /// it did: the very step [`Store::reopen`] takes, named for callers that hold a completed
    /// record as a right to be used once rather than as work to run again. One-time tokens are
    /// spent this way: of any number of concurrent calls with one fence, at most one answers
    /// `true`, and only while the record is live and completed with that fence.
    ///
    /// Provided, and not to be overridden: it is `reopen`, which the conformance suite checks.
    fn release_completed(
        &self,
        key: &Key,
        fence: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.reopen(key, fence, now)
    }

    /// The live record for `key`, if any.
    fn get(
        &self,
        key: &Key,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Deletes up to `limit` records that are no longer live; returns how many.
    fn purge_expired(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The operator's view of this store (listing, counting, fenced repairs), if it offers one.
    /// Every store in idem does; the provided `None` keeps stores written elsewhere compiling.
    fn admin(&self) -> Option<&dyn RecordAdmin> {
        None
    }
}

/// An object-safe [`Store`], for choosing the backend at run time (from a URL in a config).
/// Every `Store` is a `DynStore`; `Arc<dyn DynStore>` is a `Store` again, and its counters
/// ([`DynCounters`], a supertrait) are reached through it or by coercion to `SharedCounters`.
pub trait DynStore: DynCounters + Send + Sync + 'static {
    /// See [`Store::kind`].
    fn kind(&self) -> &'static str;
    /// See [`Store::begin`].
    fn begin<'a>(
        &'a self,
        req: &'a BeginRequest,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<BeginOutcome, StoreError>>;
    /// See [`Store::begin_from_memory`].
    fn begin_from_memory(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome>;
    /// See [`Store::complete`].
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        response: Bytes,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<(), LeaseError>>;
    /// See [`Store::release`].
    fn release<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<(), LeaseError>>;
    /// See [`Store::renew`].
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        length: Duration,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Lease, LeaseError>>;
    /// See [`Store::record_step`].
    fn record_step<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        step: &'a Step,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<(), StepError>>;
    /// See [`Store::reopen`].
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        fence: u64,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    /// See [`Store::get`].
    fn get<'a>(
        &'a self,
        key: &'a Key,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;
    /// See [`Store::purge_expired`].
    fn purge_expired(&self, now: Timestamp, limit: usize)
    -> BoxFuture<'_, Result<u64, StoreError>>;
    /// See [`Store::admin`].
    fn admin(&self) -> Option<&dyn RecordAdmin>;
}

impl<S: Store> DynStore for S {
    fn kind(&self) -> &'static str {
        Store::kind(self)
    }
    fn begin<'a>(
        &'a self,
        req: &'a BeginRequest,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<BeginOutcome, StoreError>> {
        Box::pin(Store::begin(self, req, now))
    }
    fn begin_from_memory(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        Store::begin_from_memory(self, req, now)
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        response: Bytes,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<(), LeaseError>> {
        Box::pin(Store::complete(self, key, lease, response, now))
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<(), LeaseError>> {
        Box::pin(Store::release(self, key, lease, now))
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        length: Duration,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Lease, LeaseError>> {
        Box::pin(Store::renew(self, key, lease, length, now))
    }
    fn record_step<'a>(
        &'a self,
        key: &'a Key,
        lease: &'a Lease,
        step: &'a Step,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<(), StepError>> {
        Box::pin(Store::record_step(self, key, lease, step, now))
    }
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        fence: u64,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Store::reopen(self, key, fence, now))
    }
    fn get<'a>(
        &'a self,
        key: &'a Key,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(Store::get(self, key, now))
    }
    fn purge_expired(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(Store::purge_expired(self, now, limit))
    }
    fn admin(&self) -> Option<&dyn RecordAdmin> {
        Store::admin(self)
    }
}

/// A store chosen at run time.
pub type SharedStore = Arc<dyn DynStore>;

impl Store for SharedStore {
    fn kind(&self) -> &'static str {
        DynStore::kind(&**self)
    }
    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        DynStore::begin(&**self, req, now).await
    }
    fn begin_from_memory(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        DynStore::begin_from_memory(&**self, req, now)
    }
    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        DynStore::complete(&**self, key, lease, response, now).await
    }
    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        DynStore::release(&**self, key, lease, now).await
    }
    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        DynStore::renew(&**self, key, lease, length, now).await
    }
    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        DynStore::record_step(&**self, key, lease, step, now).await
    }
    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        DynStore::reopen(&**self, key, fence, now).await
    }
    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        DynStore::get(&**self, key, now).await
    }
    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        DynStore::purge_expired(&**self, now, limit).await
    }
    fn admin(&self) -> Option<&dyn RecordAdmin> {
        DynStore::admin(&**self)
    }
}
