//! Replays answered from memory: [`ReplayCache`] wraps any store and keeps the completed
//! records it has seen, so that a retry of finished work costs no round trip.
//!
//! A completed record's answer does not change until the record expires: no `begin` acquires
//! it, no `complete` rewrites it. So a `begin` whose key the cache holds, unexpired, is answered
//! from there as the store would answer it: a replay for the same fingerprint, a mismatch for
//! another. Only an operator changes a completed record early (a reopen, a release of a token,
//! a repair): through this wrapper such a change also drops the key from the cache, but other
//! processes' caches keep the old answer for at most [`ReplayCacheLimits::max_age`]. Every
//! other call goes to the store.
//!
//! The cache is bounded in entries and in bytes at once by weighing each entry at least
//! `bytes / entries` (so a full cache of small answers holds `entries` of them) and at most its
//! size; the eviction policy is [`quick_cache`]'s (CLOCK-Pro, scan resistant).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, BoxFuture, Bytes, Counters, Counts, Cursor, Fingerprint, Key,
    Lease, LeaseError, Page, Record, RecordAdmin, RecordFilter, Repair, Replay, Shown, Step,
    StepError, Store, StoreError, Timestamp,
};

/// How much a [`ReplayCache`] keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCacheLimits {
    /// The most answers kept (at least 1).
    pub entries: usize,
    /// The most bytes of answers and keys kept, with a fixed overhead per entry counted.
    pub bytes: usize,
    /// How long an answer is kept at most, even if its record lives longer: the longest time
    /// another process's cache goes on replaying a record an operator reopened or deleted.
    pub max_age: Duration,
}

impl Default for ReplayCacheLimits {
    /// 10,000 answers, 32 MiB, one minute.
    fn default() -> Self {
        Self {
            entries: 10_000,
            bytes: 32 << 20,
            max_age: Duration::from_secs(60),
        }
    }
}

/// What an entry costs besides its answer and key: the map's slot, the fingerprint, the
/// times and the counted pointers.
const ENTRY_OVERHEAD: usize = 128;

#[derive(Clone)]
struct Entry {
    fingerprint: Fingerprint,
    replay: Replay,
    /// When the entry stops answering: the record's expiry, or its age limit if sooner.
    until: Timestamp,
}

#[derive(Clone)]
struct Weigher {
    /// Every entry weighs at least this much, which bounds the count of entries.
    floor: u64,
}

impl quick_cache::Weighter<Key, Entry> for Weigher {
    fn weight(&self, key: &Key, entry: &Entry) -> u64 {
        let size = entry.replay.response.len()
            + key.scope().as_str().len()
            + key.namespace().as_str().len()
            + key.client_key().as_str().len()
            + ENTRY_OVERHEAD;
        (size as u64).max(self.floor)
    }
}

/// A decision about a response: `true` keeps it out of the cache.
type Skip = Arc<dyn Fn(&[u8]) -> bool + Send + Sync>;

struct Shared {
    entries: quick_cache::sync::Cache<Key, Entry, Weigher>,
    max_age: Duration,
    hits: AtomicU64,
    /// Raised by every [`ReplayCache::forget`]: a replay read from the store while one ran may
    /// be the answer it removed, and is not kept.
    forgets: AtomicU64,
}

/// A store whose completed records are replayed from memory (see the module's notes).
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::{BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Store, Timestamp};
/// use idem_store::{MemoryStore, ReplayCache, ReplayCacheLimits};
///
/// let store = ReplayCache::new(MemoryStore::new(), ReplayCacheLimits::default());
/// let req = BeginRequest::new(Key::parse("t", "charge", "k1")?, Fingerprint::of_bytes(b"x"));
/// let now = Timestamp::now();
/// let BeginOutcome::Acquired(lease) = store.begin(&req, now).await? else { panic!() };
/// store.complete(&req.key, &lease, Bytes::from_static(b"done"), now).await?;
/// // The first replay comes from the store, the next ones from memory.
/// for _ in 0..2 {
///     assert!(matches!(store.begin(&req, now).await?, BeginOutcome::Replay(_)));
/// }
/// assert_eq!(store.hits(), 1);
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
pub struct ReplayCache<S> {
    store: S,
    shared: Arc<Shared>,
    skip: Option<Skip>,
}

impl<S: Clone> Clone for ReplayCache<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            shared: self.shared.clone(),
            skip: self.skip.clone(),
        }
    }
}

impl<S> std::fmt::Debug for ReplayCache<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("entries", &self.shared.entries.len())
            .field("bytes", &self.shared.entries.weight())
            .field("max_age", &self.shared.max_age)
            .finish_non_exhaustive()
    }
}

impl<S: Store> ReplayCache<S> {
    /// Wraps `store`, keeping answers within `limits`.
    pub fn new(store: S, limits: ReplayCacheLimits) -> Self {
        let entries = limits.entries.max(1);
        let bytes = limits.bytes.max(ENTRY_OVERHEAD);
        let floor = (bytes / entries).max(1) as u64;
        Self {
            store,
            shared: Arc::new(Shared {
                entries: quick_cache::sync::Cache::with_weighter(
                    entries,
                    bytes as u64,
                    Weigher { floor },
                ),
                max_age: limits.max_age,
                hits: AtomicU64::new(0),
                forgets: AtomicU64::new(0),
            }),
            skip: None,
        }
    }

    /// Keeps out of the cache every response for which `skip` answers `true`: answers that an
    /// operator is expected to reopen soon (an outcome marked unknown), which other processes
    /// should then not replay from memory.
    #[must_use]
    pub fn skip(mut self, skip: impl Fn(&[u8]) -> bool + Send + Sync + 'static) -> Self {
        self.skip = Some(Arc::new(skip));
        self
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.store
    }

    /// How many `begin`s were answered from memory.
    pub fn hits(&self) -> u64 {
        self.shared.hits.load(Ordering::Relaxed)
    }

    /// How many answers are kept now, and their weight in bytes.
    pub fn size(&self) -> (usize, u64) {
        (self.shared.entries.len(), self.shared.entries.weight())
    }

    /// Keeps `replay`, read from the store when [`Shared::forgets`] stood at `forgets`, unless
    /// a key was forgotten since.
    fn keep(&self, req: &BeginRequest, replay: &Replay, now: Timestamp, forgets: u64) {
        if self
            .skip
            .as_ref()
            .is_some_and(|skip| skip(&replay.response))
        {
            return;
        }
        let until = replay
            .expires_at
            .min(now.saturating_add(self.shared.max_age));
        if until <= now {
            return;
        }
        let entry = Entry {
            fingerprint: req.fingerprint,
            replay: replay.clone(),
            until,
        };
        self.shared.entries.insert(req.key.clone(), entry);
        // Checked after the insert, and `forget` counts before it removes: a forget that this
        // check misses removes the entry after it was inserted.
        if self.shared.forgets.load(Ordering::SeqCst) != forgets {
            self.shared.entries.remove(&req.key);
        }
    }

    fn forget(&self, key: &Key) {
        self.shared.forgets.fetch_add(1, Ordering::SeqCst);
        self.shared.entries.remove(key);
    }

    /// The answer to `req` from this cache's entries, if it holds its record unexpired at
    /// `now` (counted as a hit); an expired entry is dropped.
    fn cached(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        let entry = self.shared.entries.get(&req.key)?;
        if entry.until <= now {
            self.shared.entries.remove(&req.key);
            return None;
        }
        self.shared.hits.fetch_add(1, Ordering::Relaxed);
        Some(if entry.fingerprint == req.fingerprint {
            BeginOutcome::Replay(entry.replay)
        } else {
            BeginOutcome::Mismatch
        })
    }
}

impl<S: Store> Store for ReplayCache<S> {
    fn kind(&self) -> &'static str {
        self.store.kind()
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        // The wrapped store's `begin` asks its own memory, if it has one.
        if let Some(outcome) = self.cached(req, now) {
            return Ok(outcome);
        }
        let forgets = self.shared.forgets.load(Ordering::SeqCst);
        let outcome = self.store.begin(req, now).await?;
        if let BeginOutcome::Replay(replay) = &outcome {
            self.keep(req, replay, now, forgets);
        }
        Ok(outcome)
    }

    /// The answer to `req` from this cache, if it holds its record unexpired at `now`, else
    /// from the wrapped store's memory, if it has one.
    fn begin_from_memory(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        self.cached(req, now)
            .or_else(|| self.store.begin_from_memory(req, now))
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.store.complete(key, lease, response, now).await
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.store.release(key, lease, now).await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        self.store.renew(key, lease, length, now).await
    }

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        self.store.record_step(key, lease, step, now).await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        self.forget(key);
        let reopened = self.store.reopen(key, fence, now).await;
        // Again after: a `begin` that read the record before the reopen landed and answers
        // after it does not keep what it read (see `keep`).
        self.forget(key);
        reopened
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.store.get(key, now).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.store.purge_expired(now, limit).await
    }

    fn admin(&self) -> Option<&dyn RecordAdmin> {
        self.store.admin().map(|_| self as &dyn RecordAdmin)
    }
}

impl<S: Store> Counters for ReplayCache<S> {
    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        self.store.raise(key, to).await
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        self.store.advance(key, by).await
    }
}

/// The wrapped store's operator tools, with every repair also dropping the key from the cache.
impl<S: Store> RecordAdmin for ReplayCache<S> {
    fn list<'a>(
        &'a self,
        filter: &'a RecordFilter,
        after: Option<&'a Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        match self.store.admin() {
            Some(admin) => admin.list(filter, after, limit, now),
            None => Box::pin(async { Err(unsupported()) }),
        }
    }

    fn count<'a>(
        &'a self,
        filter: &'a RecordFilter,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Counts, StoreError>> {
        match self.store.admin() {
            Some(admin) => admin.count(filter, now),
            None => Box::pin(async { Err(unsupported()) }),
        }
    }

    fn repair<'a>(
        &'a self,
        key: &'a Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let admin = self.store.admin().ok_or_else(unsupported)?;
            self.forget(key);
            let repaired = admin.repair(key, shown, repair, now).await;
            self.forget(key);
            repaired
        })
    }
}

fn unsupported() -> StoreError {
    StoreError::Backend {
        message: "this store offers no operator tools".into(),
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    fn req(k: &str, body: &[u8]) -> BeginRequest {
        BeginRequest::new(
            Key::parse("t", "n", k).unwrap(),
            Fingerprint::of_bytes(body),
        )
        .with_ttl(Duration::from_secs(3600))
    }

    async fn completed(store: &ReplayCache<MemoryStore>, r: &BeginRequest, now: Timestamp) {
        let BeginOutcome::Acquired(lease) = store.begin(r, now).await.unwrap() else {
            panic!("not acquired")
        };
        store
            .complete(&r.key, &lease, Bytes::from_static(b"answer"), now)
            .await
            .unwrap();
    }

    fn cached(limits: ReplayCacheLimits) -> ReplayCache<MemoryStore> {
        ReplayCache::new(MemoryStore::new(), limits)
    }

    /// A `begin` that read the completed record before a reopen through the cache, and whose
    /// answer arrives after it, does not leave that answer in the cache.
    #[test]
    fn a_replay_read_before_a_reopen_is_not_kept() {
        use idem_testkit::{Fault, FaultyStore, Op};
        idem_testkit::block_on(async {
            let faulty = FaultyStore::new(MemoryStore::new());
            let store = ReplayCache::new(faulty.clone(), ReplayCacheLimits::default());
            let now = Timestamp::from_millis(1_000_000);
            let r = req("k", b"x");
            let BeginOutcome::Acquired(lease) = store.begin(&r, now).await.unwrap() else {
                panic!("not acquired")
            };
            store
                .complete(&r.key, &lease, Bytes::from_static(b"answer"), now)
                .await
                .unwrap();
            // Read from the store at once; the answer comes 200 ms later.
            faulty.fail_next(Op::Begin, Fault::SlowReply(Duration::from_millis(200)));
            let late = tokio::spawn({
                let (store, r) = (store.clone(), r.clone());
                async move { store.begin(&r, now).await }
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(store.reopen(&r.key, lease.fence, now).await.unwrap());
            assert!(matches!(
                late.await.unwrap().unwrap(),
                BeginOutcome::Replay(_)
            ));
            assert!(
                matches!(
                    store.begin(&r, now).await.unwrap(),
                    BeginOutcome::Acquired(_)
                ),
                "the reopened record runs again"
            );
        });
    }

    #[test]
    fn a_replay_is_answered_from_memory_after_the_first() {
        idem_testkit::block_on(async {
            let store = cached(ReplayCacheLimits::default());
            let now = Timestamp::from_millis(1_000_000);
            let r = req("a", b"x");
            completed(&store, &r, now).await;
            for _ in 0..3 {
                let BeginOutcome::Replay(replay) = store.begin(&r, now).await.unwrap() else {
                    panic!("not a replay")
                };
                assert_eq!(&replay.response[..], b"answer");
            }
            assert_eq!(store.hits(), 2);
            // Another fingerprint is a mismatch, from memory too.
            let other = req("a", b"y");
            assert_eq!(
                store.begin(&other, now).await.unwrap(),
                BeginOutcome::Mismatch
            );
            assert_eq!(store.hits(), 3);
        });
    }

    #[test]
    fn an_answer_is_not_kept_past_its_record_or_its_age_limit() {
        idem_testkit::block_on(async {
            let store = cached(ReplayCacheLimits {
                max_age: Duration::from_secs(10),
                ..ReplayCacheLimits::default()
            });
            let now = Timestamp::from_millis(1_000_000);
            let r = req("a", b"x");
            completed(&store, &r, now).await;
            store.begin(&r, now).await.unwrap();
            // Past the age limit the store is asked again (and answers a replay).
            let later = now.saturating_add(Duration::from_secs(11));
            assert!(matches!(
                store.begin(&r, later).await.unwrap(),
                BeginOutcome::Replay(_)
            ));
            assert_eq!(store.hits(), 0);
            // Past the record's expiry the key is acquired again, not replayed from memory.
            let short = req("b", b"x").with_ttl(Duration::from_secs(2));
            completed(&store, &short, now).await;
            store.begin(&short, now).await.unwrap();
            let expired = now.saturating_add(Duration::from_secs(3));
            assert!(matches!(
                store.begin(&short, expired).await.unwrap(),
                BeginOutcome::Acquired(_)
            ));
        });
    }

    #[test]
    fn a_reopen_or_repair_through_the_cache_drops_the_answer() {
        idem_testkit::block_on(async {
            let store = cached(ReplayCacheLimits::default());
            let now = Timestamp::from_millis(1_000_000);
            let r = req("a", b"x");
            completed(&store, &r, now).await;
            let BeginOutcome::Replay(replay) = store.begin(&r, now).await.unwrap() else {
                panic!("not a replay")
            };
            assert!(store.reopen(&r.key, replay.fence, now).await.unwrap());
            assert!(matches!(
                store.begin(&r, now).await.unwrap(),
                BeginOutcome::Acquired(_)
            ));

            let d = req("d", b"x");
            completed(&store, &d, now).await;
            let BeginOutcome::Replay(replay) = store.begin(&d, now).await.unwrap() else {
                panic!("not a replay")
            };
            let admin = store.admin().unwrap();
            let shown = Shown {
                state: idem_core::RecordState::Completed,
                fence: replay.fence,
            };
            assert!(
                admin
                    .repair(&d.key, shown, Repair::Delete, now)
                    .await
                    .unwrap()
            );
            assert!(matches!(
                store.begin(&d, now).await.unwrap(),
                BeginOutcome::Acquired(_)
            ));
            assert_eq!(store.hits(), 0);
        });
    }

    #[test]
    fn skipped_answers_always_go_to_the_store() {
        idem_testkit::block_on(async {
            let store = cached(ReplayCacheLimits::default()).skip(|r| r.starts_with(b"ans"));
            let now = Timestamp::from_millis(1_000_000);
            let r = req("a", b"x");
            completed(&store, &r, now).await;
            for _ in 0..3 {
                assert!(matches!(
                    store.begin(&r, now).await.unwrap(),
                    BeginOutcome::Replay(_)
                ));
            }
            assert_eq!(store.hits(), 0);
        });
    }

    #[test]
    fn the_cache_stays_within_its_entries_and_bytes() {
        idem_testkit::block_on(async {
            let limits = ReplayCacheLimits {
                entries: 50,
                bytes: 50 * 1024,
                ..ReplayCacheLimits::default()
            };
            let store = cached(limits);
            let now = Timestamp::from_millis(1_000_000);
            for i in 0..500 {
                let r = req(&format!("k{i}"), b"x");
                completed(&store, &r, now).await;
                store.begin(&r, now).await.unwrap();
            }
            let (entries, bytes) = store.size();
            assert!((1..=50).contains(&entries), "{entries} entries");
            assert!(bytes <= 50 * 1024, "{bytes} bytes");
            // Big answers are bounded by bytes before entries.
            let big = cached(limits);
            let response = Bytes::from(vec![b'x'; 8 * 1024]);
            for i in 0..100 {
                let r = req(&format!("k{i}"), b"x");
                let replay = Replay {
                    response: response.clone(),
                    fence: 1,
                    completed_at: now,
                    expires_at: now.saturating_add(Duration::from_secs(60)),
                };
                big.keep(&r, &replay, now, 0);
            }
            let (entries, bytes) = big.size();
            assert!(entries <= 50 * 1024 / (8 * 1024), "{entries} entries");
            assert!(bytes <= 50 * 1024, "{bytes} bytes");
        });
    }
}
