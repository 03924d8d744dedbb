//! An in-memory store: for tests, and for a single process that can afford to forget
//! everything when it stops. It holds at most [`MemoryLimits`] records and bytes.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use idem_core::{
    Acquire, BeginOutcome, BeginRequest, Bytes, Counters, Held, HeldLock, Key, Lease, LeaseError,
    LockError, LockName, LockState, LockStore, OwnerDigest, Record, ReleaseListener, StaleLease,
    Status, Step, StepError, Store, StoreError, Timestamp,
};

use crate::lock_wakeup::ReleaseFeed;

mod admin;

const SHARDS: usize = 16;

type Shard = Mutex<HashMap<Key, Box<Record>>>;

/// What one record costs beyond its key and response, for [`MemoryLimits::max_bytes`]: the
/// record itself, the box and the map slot that hold it, the key's shared allocation and
/// allocator headers. An estimate (about 250 bytes on 64-bit targets), not a measurement.
pub const RECORD_OVERHEAD: usize = std::mem::size_of::<Record>() + 128;

/// How much a [`MemoryStore`] may hold.
///
/// Both bounds are checked when a `begin` creates a record for a key that has none: when
/// either would be passed, records that are no longer live are purged first, and if that does
/// not make room the `begin` is refused with [`StoreError::Full`]. A live record is never
/// evicted to make room (forgetting it would run its work again). A `begin` on a key that
/// already has a record (a replay, an in-progress answer, a takeover) and every `complete`
/// need no room: refusing a completion would lose the result of work that already ran. So
/// usage can pass `max_bytes` by the responses of the records in progress when it was
/// reached; bound those with the HTTP layer's response limit. A recovery point
/// ([`Store::record_step`]) does need room: one that would pass `max_bytes` (after purging) is
/// refused with [`StoreError::Full`], which loses nothing (the next attempt runs the step
/// again).
///
/// A record counts as its key, its response, its steps and [`RECORD_OVERHEAD`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryLimits {
    /// The most records held, live or not yet purged (default 100,000).
    pub max_records: usize,
    /// The most bytes held, as estimated above (default 256 MiB).
    pub max_bytes: usize,
}

impl MemoryLimits {
    /// The default: 100,000 records and 256 MiB.
    pub const DEFAULT: Self = Self {
        max_records: 100_000,
        max_bytes: 256 << 20,
    };

    /// Limits of `max_records` records and `max_bytes` bytes.
    pub const fn new(max_records: usize, max_bytes: usize) -> Self {
        Self {
            max_records,
            max_bytes,
        }
    }
}

impl Default for MemoryLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Records in a sharded hash map, within [`MemoryLimits`]. Clones share the same records.
///
/// Every operation on a key runs under its shard's mutex, which makes `begin` atomic. Nothing
/// survives the process.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Vec<Shard>,
    limits: MemoryLimits,
    /// Taken after a shard's mutex, never before it.
    usage: Mutex<Usage>,
    /// Held by the one scan that purges to make room.
    scan: Mutex<()>,
    counters: Mutex<HashMap<Key, u64>>,
    locks: Mutex<Locks>,
    released: ReleaseFeed,
}

/// What the records hold, and a bound on when the first of them can die.
#[derive(Debug)]
struct Usage {
    records: usize,
    bytes: usize,
    /// No record stops being live before this (milliseconds): a full store does not scan
    /// for dead records before then. Lowered by every write; recomputed by each scan.
    next_death: u64,
}

/// Lock states, with a count of acquisitions since the last sweep of stale ones.
#[derive(Debug, Default)]
struct Locks {
    states: HashMap<LockName, LockState>,
    since_sweep: usize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with the default [`MemoryLimits`].
    pub fn new() -> Self {
        Self::with_limits(MemoryLimits::DEFAULT)
    }

    /// An empty store that holds at most `limits`.
    pub fn with_limits(limits: MemoryLimits) -> Self {
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                limits,
                usage: Mutex::new(Usage {
                    records: 0,
                    bytes: 0,
                    next_death: u64::MAX,
                }),
                scan: Mutex::default(),
                counters: Mutex::default(),
                locks: Mutex::default(),
                released: ReleaseFeed::new(),
            }),
        }
    }

    /// How many records are held, live or not.
    pub fn len(&self) -> usize {
        self.usage().0
    }

    /// The records held (live or not yet purged) and their bytes as [`MemoryLimits`] counts
    /// them: for a metric.
    pub fn usage(&self) -> (usize, usize) {
        let u = self.usage_lock();
        (u.records, u.bytes)
    }

    /// The limits this store was made with.
    pub fn limits(&self) -> MemoryLimits {
        self.inner.limits
    }

    fn usage_lock(&self) -> MutexGuard<'_, Usage> {
        self.inner
            .usage
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Accounts for a record that changed from `before` bytes to `after` (an existing slot).
    fn changed(&self, before: usize, after: &Record) {
        let mut u = self.usage_lock();
        u.bytes = u.bytes.saturating_sub(before).saturating_add(size(after));
        u.next_death = u.next_death.min(death(after));
    }

    /// Whether `bytes` more fit under the byte bound.
    fn has_room_for(&self, bytes: usize) -> bool {
        self.usage_lock().bytes.saturating_add(bytes) <= self.inner.limits.max_bytes
    }

    /// The error of a store at its bounds.
    fn full(&self) -> StoreError {
        let MemoryLimits {
            max_records,
            max_bytes,
        } = self.inner.limits;
        StoreError::Full {
            message: format!(
                "the memory store holds its most records ({max_records}) or bytes \
                 ({max_bytes}) in live records"
            ),
        }
    }

    /// Reserves room for a new record of `bytes`, if the limits allow it.
    fn reserve(&self, record: &Record) -> bool {
        let limits = self.inner.limits;
        let bytes = size(record);
        let mut u = self.usage_lock();
        if u.records >= limits.max_records || u.bytes.saturating_add(bytes) > limits.max_bytes {
            return false;
        }
        u.records += 1;
        u.bytes += bytes;
        u.next_death = u.next_death.min(death(record));
        true
    }

    /// Deletes up to `limit` records that are not live at `now`, shard by shard; answers how
    /// many it deleted and the earliest death of the records it kept (0 if it stopped early).
    fn purge(&self, now: Timestamp, limit: usize) -> (usize, u64) {
        let mut purged = 0usize;
        let mut earliest = u64::MAX;
        for shard in &self.inner.shards {
            if purged >= limit {
                earliest = 0;
                break;
            }
            let mut map = lock(shard);
            let (mut records, mut bytes) = (0usize, 0usize);
            map.retain(|_, r| {
                if purged < limit && !r.is_live(now) {
                    purged += 1;
                    records += 1;
                    bytes += size(r);
                    false
                } else {
                    earliest = earliest.min(death(r));
                    true
                }
            });
            let mut u = self.usage_lock();
            u.records = u.records.saturating_sub(records);
            u.bytes = u.bytes.saturating_sub(bytes);
        }
        (purged, earliest)
    }

    /// When the store is full: purges every record that is no longer live, unless no record
    /// can have died yet. One scan at a time, over at most `max_records` records, and only
    /// once some record's death has come, so a full store of live records costs a refused
    /// `begin` no scan.
    fn make_room(&self, now: Timestamp) {
        let _scan = self
            .inner
            .scan
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        {
            let mut u = self.usage_lock();
            if u.next_death > now.as_millis() {
                return;
            }
            u.next_death = u64::MAX;
        }
        let (_, earliest) = self.purge(now, usize::MAX);
        let mut u = self.usage_lock();
        u.next_death = u.next_death.min(earliest);
    }

    /// `begin` within the limits: `None` if it needs room that there is not.
    fn try_begin(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        let mut shard = self.shard(&req.key);
        // One lookup: keys are reference-counted, so the clone for `entry` is cheap.
        Some(match shard.entry(req.key.clone()) {
            Entry::Occupied(mut slot) => {
                let step =
                    Record::begin(Some(slot.get()), req, now, idem_core::LeaseId::generate());
                if let Some(new) = step.write {
                    let before = size(slot.get());
                    self.changed(before, &new);
                    **slot.get_mut() = new;
                }
                step.outcome
            }
            Entry::Vacant(slot) => {
                let step = Record::begin(None, req, now, idem_core::LeaseId::generate());
                if let Some(new) = step.write {
                    if !self.reserve(&new) {
                        return None;
                    }
                    slot.insert(Box::new(new));
                }
                step.outcome
            }
        })
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &Key) -> MutexGuard<'_, HashMap<Key, Box<Record>>> {
        // The digest is keyed SipHash: callers cannot crowd one shard on purpose.
        let h = key.digest() >> 32;
        // The modulo keeps the index below SHARDS, so it fits in usize.
        #[allow(clippy::cast_possible_truncation)]
        let i = (h % SHARDS as u64) as usize;
        lock(&self.inner.shards[i])
    }
}

/// A poisoned shard only means another thread panicked while holding it; every change is a
/// single `insert` or a transition that checks before it writes, so the map is consistent and
/// we keep serving.
fn lock(shard: &Shard) -> MutexGuard<'_, HashMap<Key, Box<Record>>> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A record's size as [`MemoryLimits`] counts it.
fn size(r: &Record) -> usize {
    let key = r.key.scope().as_str().len()
        + r.key.namespace().as_str().len()
        + r.key.client_key().as_str().len();
    let steps: usize = r.steps.iter().map(Step::encoded_len).sum();
    RECORD_OVERHEAD + key + r.response.as_ref().map_or(0, Bytes::len) + steps
}

/// The first instant (milliseconds) at which the record is not live (see [`Record::is_live`]).
fn death(r: &Record) -> u64 {
    let end = r.expires_at.as_millis();
    match r.status {
        Status::InProgress => end.max(r.lease_expires_at.as_millis()),
        _ => end,
    }
}

impl MemoryStore {
    fn locks(&self) -> MutexGuard<'_, Locks> {
        self.inner
            .locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn update<E: From<StaleLease>>(
        &self,
        key: &Key,
        transition: impl FnOnce(&mut Record) -> Result<bool, E>,
    ) -> Result<(), E> {
        let mut shard = self.shard(key);
        let record = shard.get_mut(key).ok_or(StaleLease)?;
        let before = size(record);
        if transition(record)? {
            self.changed(before, record);
        }
        Ok(())
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        if let Some(outcome) = self.try_begin(req, now) {
            return Ok(outcome);
        }
        // Full: make room without holding the key's shard, then decide afresh.
        self.make_room(now);
        self.try_begin(req, now).ok_or_else(|| self.full())
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.update(key, |r| {
            r.complete_in_place(lease, response, now)
                .map_err(LeaseError::from)
        })
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.update(key, |r| {
            r.release_in_place(lease, now).map_err(LeaseError::from)
        })
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: std::time::Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        let mut shard = self.shard(key);
        let record = shard.get_mut(key).ok_or(StaleLease)?;
        let before = size(record);
        let renewed = record.renew_in_place(lease, length, now)?;
        self.changed(before, record);
        Ok(renewed)
    }

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        // Checked before the shard is taken (`make_room` takes every shard); concurrent steps
        // may pass the bound by what they add between the check and the write.
        let growth = step.encoded_len();
        if !self.has_room_for(growth) {
            self.make_room(now);
            if !self.has_room_for(growth) {
                return Err(StepError::Store(self.full()));
            }
        }
        self.update(key, |r| {
            r.record_step_in_place(lease, step, now)
                .map_err(StepError::from)
        })
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        let Some(record) = shard.get_mut(key) else {
            return Ok(false);
        };
        let before = size(record);
        let reopened = record.reopen_in_place(fence, now);
        if reopened {
            self.changed(before, record);
        }
        Ok(reopened)
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self
            .shard(key)
            .get(key)
            .filter(|r| r.is_live(now))
            .map(|r| Record::clone(r)))
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        Ok(self.purge(now, limit).0 as u64)
    }

    fn admin(&self) -> Option<&dyn idem_core::RecordAdmin> {
        Some(self)
    }
}

impl Counters for MemoryStore {
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let mut counters = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let by = idem_core::counter_step(by)?;
        let value = counters.entry(key.clone()).or_insert(0);
        let next = value
            .checked_add(by)
            .filter(|n| *n <= idem_core::MAX_COUNTER)
            .ok_or(StoreError::CounterExhausted)?;
        *value = next;
        Ok(next)
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        let mut counters = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let value = counters.entry(key.clone()).or_insert(0);
        *value = (*value).max(to.min(idem_core::MAX_COUNTER));
        Ok(*value)
    }
}

/// Locks by the process's wall clock. Waiters in this process are woken on release.
impl LockStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: std::time::Duration,
    ) -> Result<Acquire, StoreError> {
        let now = Timestamp::now();
        let mut locks = self.locks();
        // Forget states unused for an hour, now and then, so the map stays bounded by the
        // locks in use.
        locks.since_sweep += 1;
        if locks.since_sweep >= 4096 {
            locks.since_sweep = 0;
            locks.states.retain(|_, s| !s.is_stale(now));
        }
        let answer = match LockState::acquire(locks.states.get(name), owner, lease, now) {
            Ok(state) => {
                locks.states.insert(name.clone(), state);
                Acquire::Acquired(Held {
                    fence: state.fence,
                    expires_at: state.expires_at,
                })
            }
            Err(until) => Acquire::Busy { until },
        };
        Ok(answer)
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: std::time::Duration,
    ) -> Result<Held, LockError> {
        match self.locks().states.get_mut(name) {
            Some(state) => state.renew(owner, fence, lease, Timestamp::now()),
            None => Err(LockError::NotOwner),
        }
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        let answer = match self.locks().states.get_mut(name) {
            Some(state) => state.release(owner, fence, Timestamp::now()),
            None => Err(LockError::NotOwner),
        };
        if let Ok(true) = answer {
            self.inner.released.send(name.shared());
        }
        answer.map(drop)
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        Some(self.inner.released.listen())
    }

    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        let now = Timestamp::now();
        let mut held: Vec<HeldLock> = self
            .locks()
            .states
            .iter()
            .filter(|(_, s)| s.expires_at > now)
            .map(|(name, s)| HeldLock {
                name: name.clone(),
                fence: s.fence,
                expires_at: s.expires_at,
            })
            .collect();
        held.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        held.truncate(limit);
        Ok(Some(held))
    }
}
