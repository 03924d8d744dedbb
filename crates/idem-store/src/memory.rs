//! An in-memory store: for tests, and for a single process that can afford to forget
//! everything when it stops.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::{
    Acquire, BeginOutcome, BeginRequest, BoxFuture, Bytes, Held, Key, Lease, LeaseError, LockError,
    LockName, LockState, LockStore, OwnerDigest, Record, ReleaseListener, StaleLease, Store,
    StoreError, Timestamp,
};

use crate::lock_feed::ReleaseFeed;

const SHARDS: usize = 16;

type Shard = Mutex<HashMap<Key, Box<Record>>>;

/// Records in a sharded hash map. Clones share the same records.
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
    counters: Mutex<HashMap<Key, u64>>,
    locks: Mutex<Locks>,
    released: ReleaseFeed,
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
    /// An empty store.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                counters: Mutex::default(),
                locks: Mutex::default(),
                released: ReleaseFeed::new(),
            }),
        }
    }

    /// How many records are held, live or not.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).len()).sum()
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
    shard
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl MemoryStore {
    fn locks(&self) -> MutexGuard<'_, Locks> {
        self.inner
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn update(
        &self,
        key: &Key,
        transition: impl FnOnce(&mut Record) -> Result<bool, StaleLease>,
    ) -> Result<(), LeaseError> {
        let mut shard = self.shard(key);
        let record = shard.get_mut(key).ok_or(StaleLease)?;
        transition(record)?;
        Ok(())
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        let mut shard = self.shard(&req.key);
        // One lookup: keys are reference-counted, so the clone for `entry` is cheap.
        Ok(match shard.entry(req.key.clone()) {
            Entry::Occupied(mut slot) => {
                let step = Record::begin(Some(slot.get()), req, now);
                if let Some(new) = step.write {
                    **slot.get_mut() = new;
                }
                step.outcome
            }
            Entry::Vacant(slot) => {
                let step = Record::begin(None, req, now);
                if let Some(new) = step.write {
                    slot.insert(Box::new(new));
                }
                step.outcome
            }
        })
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.update(key, |r| r.complete_in_place(lease, response, now))
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.update(key, |r| r.release_in_place(lease, now))
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
        Ok(record.renew_in_place(lease, length, now)?)
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        Ok(self
            .shard(key)
            .get_mut(key)
            .is_some_and(|r| r.reopen_in_place(fence, now)))
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let mut counters = self
            .inner
            .counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let value = counters.entry(key.clone()).or_insert(0);
        *value = (*value).max(to.min(idem_core::MAX_COUNTER));
        Ok(*value)
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self
            .shard(key)
            .get(key)
            .filter(|r| r.is_live(now))
            .map(|r| Record::clone(r)))
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        let mut purged = 0usize;
        for shard in &self.inner.shards {
            if purged >= limit {
                break;
            }
            let mut map = lock(shard);
            map.retain(|_, r| {
                if purged < limit && !r.is_live(now) {
                    purged += 1;
                    false
                } else {
                    true
                }
            });
        }
        Ok(purged as u64)
    }
}

/// Locks by the process's wall clock. Waiters in this process are woken on release.
impl LockStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        lease: std::time::Duration,
    ) -> BoxFuture<'a, Result<Acquire, StoreError>> {
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
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn renew<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: std::time::Duration,
    ) -> BoxFuture<'a, Result<Held, LockError>> {
        let answer = match self.locks().states.get_mut(name) {
            Some(state) => state.renew(owner, fence, lease, Timestamp::now()),
            None => Err(LockError::NotOwner),
        };
        Box::pin(std::future::ready(answer))
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        let answer = match self.locks().states.get_mut(name) {
            Some(state) => state.release(owner, fence, Timestamp::now()),
            None => Err(LockError::NotOwner),
        };
        if let Ok(true) = answer {
            self.inner.released.send(name.shared());
        }
        Box::pin(std::future::ready(answer.map(drop)))
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        Some(self.inner.released.listen())
    }
}
