//! An in-memory store: for tests, and for a single process that can afford to forget
//! everything when it stops.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, Store, StoreError, Timestamp,
};

const SHARDS: usize = 16;

type Shard = Mutex<HashMap<Key, Record>>;

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
    hasher: RandomState,
    shards: Vec<Shard>,
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
                hasher: RandomState::new(),
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
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

    fn shard(&self, key: &Key) -> MutexGuard<'_, HashMap<Key, Record>> {
        // The modulo keeps the index below SHARDS, so it fits in usize.
        #[allow(clippy::cast_possible_truncation)]
        let i = (self.inner.hasher.hash_one(key) % SHARDS as u64) as usize;
        lock(&self.inner.shards[i])
    }
}

/// A poisoned shard only means another thread panicked while holding it; every write to the
/// map is a single `insert`, so the map itself is consistent and we keep serving.
fn lock(shard: &Shard) -> MutexGuard<'_, HashMap<Key, Record>> {
    shard
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl MemoryStore {
    fn update(
        &self,
        key: &Key,
        transition: impl FnOnce(Option<&Record>) -> Result<Option<Record>, idem_core::StaleLease>,
    ) -> Result<(), LeaseError> {
        let mut shard = self.shard(key);
        if let Some(new) = transition(shard.get(key))? {
            shard.insert(key.clone(), new);
        }
        Ok(())
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        let mut shard = self.shard(&req.key);
        let step = Record::begin(shard.get(&req.key), req, now);
        if let Some(new) = step.write {
            match shard.get_mut(&req.key) {
                Some(slot) => *slot = new,
                None => {
                    shard.insert(req.key.clone(), new);
                }
            }
        }
        Ok(step.outcome)
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.update(key, |r| Record::complete(r, lease, response, now))
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.update(key, |r| Record::release(r, lease, now))
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self.shard(key).get(key).filter(|r| r.is_live(now)).cloned())
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
