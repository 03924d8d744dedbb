//! The keys the store may hold, so that a `begin` of a key it certainly does not hold goes
//! straight to the writer instead of reading first: that read would find nothing, and the
//! writer reads the record again inside its transaction anyway.
//!
//! A Bloom filter (`fastbloom`'s, whose bits are atomics, so `begin`s checking it and the
//! writer setting it share one read lock) of every key in the table, loaded on the listings
//! connection when the store opens, and taught by the writer the key of every `begin` it
//! commits, before it answers (so also that of a caller that stopped waiting). It is only a
//! way to route a `begin`, never an answer: "maybe held" reads first, as a store without the
//! filter does; "not held" goes to the writer, which decides by the record it reads. A wrong
//! "not held" gives the same answer, only later: it is a key that another process (or another
//! store on the same file) wrote after the load, and its first `begin` here goes through the
//! writer like a fresh key's (waiting, while another connection holds the write lock, up to
//! `busy_timeout`, and failing as unavailable past it, where a read would have replayed); the
//! writer then teaches the filter the key, so the next `begin` reads first.
//!
//! Keys are never taken out (a Bloom filter cannot forget one): a record purged after its expiry
//! stays "maybe held" and costs a read, as before. When more keys were learnt than the filter
//! was sized for, a new one, sized for twice the table (which forgets the purged keys), is
//! loaded the same way and replaces it; until then the old one answers and both learn.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use fastbloom::AtomicBloomFilter;
use idem_core::Key;
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, ToSql};

use super::reader::Readers;

/// The fewest keys a filter is sized for (about 77 KiB of bits); the tests grow filters past it.
const MIN_CAPACITY: usize = if cfg!(test) { 64 } else { 1 << 16 };
/// The most keys a filter is sized for (about 40 MiB of bits; twice that while a rebuild loads
/// the next); the tests reach it. A table past half of it gets a filter that fills up and
/// answers "maybe held" more and more often (a `begin` then reads first, as without a filter);
/// it is loaded again after every `MAX_CAPACITY / 2` keys learnt (see `Filter::outgrown`).
const MAX_CAPACITY: usize = if cfg!(test) { 512 } else { 1 << 25 };
/// How many keys one read of the scan takes. Each read is a statement of its own, with a WAL
/// snapshot of its own, queued as a job of its own: a large table's load neither holds one
/// snapshot for its whole length (which keeps checkpoints from resetting the WAL, so the WAL
/// file grows meanwhile) nor keeps an operator's listing waiting behind it.
const ROWS_PER_READ: usize = if cfg!(test) { 16 } else { 4096 };
/// The rate of keys wrongly said "maybe held" (each costs one read) at capacity.
const FALSE_POSITIVES: f64 = 0.01;
/// The longest wait before loading again after a load failed.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The keys a [`super::SqliteStore`] may hold; shared by its clones.
pub(super) struct KnownKeys {
    filters: RwLock<Filters>,
    /// Loads run here, beside operators' listings, never in the way of a replay's read.
    listings: Arc<Readers>,
    /// The key's hash, computed once for every filter: random keys of this process's own.
    hasher: RandomState,
}

#[derive(Default)]
struct Filters {
    /// Answers [`KnownKeys::may_hold`]; `None` until the first load is done (every key is
    /// then "maybe held").
    current: Option<Arc<Filter>>,
    /// Being loaded from the table: learns beside `current`, replaces it when loaded.
    loading: Option<Arc<Filter>>,
    /// A load is queued or running.
    rebuilding: bool,
    /// Loads that failed in a row, and when the next may start.
    failures: u32,
    retry_at: Option<Instant>,
    /// Loads done.
    loads: u64,
}

struct Filter {
    bits: AtomicBloomFilter,
    capacity: usize,
    /// Keys that set a bit no key before them had set: distinct keys, less the false
    /// positives among them.
    keys: AtomicUsize,
    /// `keys` when the load was done: what the table held then, and what is learnt since.
    at_load: AtomicUsize,
}

impl Filter {
    fn new(capacity: usize) -> Self {
        Self {
            bits: AtomicBloomFilter::with_false_pos(FALSE_POSITIVES).expected_items(capacity),
            capacity,
            keys: AtomicUsize::new(0),
            at_load: AtomicUsize::new(0),
        }
    }

    fn insert(&self, hash: u64) {
        if !self.bits.insert_hash(hash) {
            self.keys.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// More keys than it was sized for, half of them learnt since the load. Below the ceiling
    /// a load leaves a filter at most half full, so the first part implies the second; at the
    /// ceiling a table larger than the filter leaves it over capacity from the start, and the
    /// second part spaces the rebuilds (a count and a scan each) by `MAX_CAPACITY / 2` keys
    /// rather than running them back to back.
    fn outgrown(&self) -> bool {
        let keys = self.keys.load(Ordering::Relaxed);
        keys > self.capacity
            && keys.saturating_sub(self.at_load.load(Ordering::Relaxed)) > self.capacity / 2
    }
}

/// A load, from job to job. However it ends (filled, failed, or dropped unrun), dropping it
/// ends the rebuild, so that a later one may start.
struct Load {
    known: Arc<KnownKeys>,
    filled: Option<Arc<Filter>>,
    /// Why it failed, for the log.
    failed: Option<rusqlite::Error>,
}

impl Load {
    fn new(known: Arc<KnownKeys>) -> Self {
        Self {
            known,
            filled: None,
            failed: None,
        }
    }

    /// The first job: sizes the filter for twice the table and lets it learn.
    fn size(self, conn: &Connection) {
        if Arc::strong_count(&self.known) == 1 {
            return; // the store is gone
        }
        let rows = match conn.query_row("SELECT count(*) FROM idem_records", [], |r| {
            r.get::<_, usize>(0)
        }) {
            Ok(rows) => rows,
            Err(e) => {
                let mut load = self;
                load.failed = Some(e);
                return;
            }
        };
        let filter = Arc::new(Filter::new(
            rows.saturating_mul(2).clamp(MIN_CAPACITY, MAX_CAPACITY),
        ));
        self.known.write().loading = Some(Arc::clone(&filter));
        let listings = Arc::clone(&self.known.listings);
        let _ = listings.detach(move |conn| self.fill(conn, filter, None));
    }

    /// The next jobs, one a read: put every key of the table in the filter, `ROWS_PER_READ`
    /// keys at a time in the order of the key index, each read after the last key the one
    /// before it read. A key that the store holds throughout the scan is in one of the reads
    /// (rows are found by their key, not by their place, so what is written or purged between
    /// two reads moves nothing); one begun after the filter was published is also taught to it
    /// by the writer. Each read queues the next as a job of its own, so that listings queued
    /// meanwhile run between them; when the queue is full, the next read runs in this job.
    fn fill(self, conn: &Connection, filter: Arc<Filter>, after: Option<Position>) {
        let mut next = Some((self, filter, after));
        while let Some((mut load, filter, after)) = next.take() {
            if Arc::strong_count(&load.known) == 1 {
                return; // the store is gone, and so is the use of reading on
            }
            match load.read_keys(conn, &filter, after.as_ref()) {
                Ok(Some(last)) => next = load.queue_fill(filter, last),
                Ok(None) => load.filled = Some(filter),
                // The load fails; dropping it ends the rebuild.
                Err(e) => load.failed = Some(e),
            }
        }
    }

    /// Queues the read after `last` as a job of its own; hands the load back when the queue
    /// refused it (full, or its threads gone: then the next read here finds out).
    fn queue_fill(
        self,
        filter: Arc<Filter>,
        last: Position,
    ) -> Option<(Self, Arc<Filter>, Option<Position>)> {
        let listings = Arc::clone(&self.known.listings);
        // The job takes the load out of the cell when it runs; a job refused is dropped unrun
        // and leaves it there.
        let cell = Arc::new(Mutex::new(Some((self, filter, Some(last)))));
        let queued = Arc::clone(&cell);
        let refused = listings
            .detach(move |conn| {
                let taken = queued.lock().unwrap_or_else(PoisonError::into_inner).take();
                if let Some((load, filter, after)) = taken {
                    load.fill(conn, filter, after);
                }
            })
            .is_err();
        // Queued, the job owns the load now (it may be running already); refused, nothing else
        // can reach the cell.
        refused
            .then(|| cell.lock().unwrap_or_else(PoisonError::into_inner).take())
            .flatten()
    }

    /// Puts the first `ROWS_PER_READ` keys after `after` (from the start without it) in the
    /// filter; returns the last one when it read that many (there may be more).
    fn read_keys(
        &self,
        conn: &Connection,
        filter: &Filter,
        after: Option<&Position>,
    ) -> rusqlite::Result<Option<Position>> {
        const FIRST: &str = "SELECT scope, namespace, client_key FROM idem_records \
             ORDER BY scope, namespace, client_key LIMIT ?1";
        const NEXT: &str = "SELECT scope, namespace, client_key FROM idem_records \
             WHERE (scope, namespace, client_key) > (?2, ?3, ?4) \
             ORDER BY scope, namespace, client_key LIMIT ?1";
        let limit = i64::try_from(ROWS_PER_READ).unwrap_or(i64::MAX);
        let mut keys = conn.prepare_cached(if after.is_some() { NEXT } else { FIRST })?;
        let mut rows = match after {
            Some([scope, namespace, client_key]) => {
                keys.query(rusqlite::params![limit, scope, namespace, client_key])?
            }
            None => keys.query([limit])?,
        };
        let mut read = 0usize;
        while let Some(row) = rows.next()? {
            let [scope, namespace, client_key] = [0, 1, 2].map(|i| Part::read(row, i));
            let (_, scope) = scope?;
            let (_, namespace) = namespace?;
            let (_, client_key) = client_key?;
            filter.insert(self.known.hash(scope, namespace, client_key));
            read += 1;
            if read == ROWS_PER_READ {
                // Only the slice's last key is copied out, to start the next read after it.
                return Ok(Some([
                    Part::of(row, 0)?,
                    Part::of(row, 1)?,
                    Part::of(row, 2)?,
                ]));
            }
        }
        Ok(None)
    }
}

/// Where a scan of the key index stands: the last key read, as the row held it.
type Position = [Part; 3];

/// One part of a key as its row holds it: the bytes, and whether they are TEXT or a BLOB (the
/// index puts every TEXT before every BLOB, so a position must be bound back as the type it
/// was read as). Kept as bytes, not as a `String`: a key written by another program that is
/// not UTF-8 is still read past.
#[derive(Debug, Clone)]
struct Part {
    text: bool,
    bytes: Vec<u8>,
}

impl Part {
    /// Column `i` of `row`, borrowed: whether it is TEXT, and its bytes.
    fn read<'r>(row: &'r rusqlite::Row<'_>, i: usize) -> rusqlite::Result<(bool, &'r [u8])> {
        match row.get_ref(i)? {
            ValueRef::Text(bytes) => Ok((true, bytes)),
            ValueRef::Blob(bytes) => Ok((false, bytes)),
            other => Err(rusqlite::Error::InvalidColumnType(
                i,
                format!("key part {i}"),
                other.data_type(),
            )),
        }
    }

    /// Column `i` of `row`, copied.
    fn of(row: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<Self> {
        let (text, bytes) = Self::read(row, i)?;
        Ok(Self {
            text,
            bytes: bytes.to_vec(),
        })
    }
}

impl ToSql for Part {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(if self.text {
            ValueRef::Text(&self.bytes)
        } else {
            ValueRef::Blob(&self.bytes)
        }))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.known.loaded(self.filled.take(), self.failed.take());
    }
}

impl std::fmt::Debug for KnownKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let filters = self.read();
        f.debug_struct("KnownKeys")
            .field("loaded", &filters.current.is_some())
            .field("rebuilding", &filters.rebuilding)
            .field("loads", &filters.loads)
            .finish_non_exhaustive()
    }
}

impl KnownKeys {
    /// An empty set of known keys, with the first load from the table queued on `listings`.
    pub(super) fn load(listings: Arc<Readers>) -> Arc<Self> {
        let known = Arc::new(Self {
            filters: RwLock::new(Filters::default()),
            listings,
            hasher: RandomState::new(),
        });
        known.rebuild();
        known
    }

    /// False only when no record of `key` was in the table at the last load and this store's
    /// writer has committed no `begin` of it since.
    pub(super) fn may_hold(&self, key: &Key) -> bool {
        let hash = self.hash_key(key);
        self.read()
            .current
            .as_ref()
            .is_none_or(|filter| filter.bits.contains_hash(hash))
    }

    /// Notes that the writer has committed a `begin` of `key`: its record is in the table.
    pub(super) fn learn(self: &Arc<Self>, key: &Key) {
        let hash = self.hash_key(key);
        let rebuild = {
            let filters = self.read();
            for filter in filters.current.iter().chain(&filters.loading) {
                filter.insert(hash);
            }
            !filters.rebuilding
                && filters.current.as_ref().is_none_or(|f| f.outgrown())
                && filters.retry_at.is_none_or(|at| Instant::now() >= at)
        };
        if rebuild {
            self.rebuild();
        }
    }

    /// Queues a load of a new filter from the table, unless one is queued or running.
    ///
    /// It takes jobs on the listings connection. The first counts the table, sizes the filter
    /// for twice that and lets it learn from then on; the next, each queued by the one before,
    /// put the table's keys in it, a slice of the key index each (`Load::fill`). The listings
    /// connection has one thread, which runs the jobs queued while it was busy as a later
    /// batch (`reader::run_batch`, in one read transaction), so every read of the keys, and the
    /// WAL snapshot it takes, starts after the filter learns. The writer teaches a key after
    /// its commit: a record this store writes is either in what a read of the keys finds or
    /// taught to the filter, never missed between them.
    fn rebuild(self: &Arc<Self>) {
        {
            let mut filters = self.write();
            if filters.rebuilding {
                return;
            }
            filters.rebuilding = true;
        }
        let load = Load::new(Arc::clone(self));
        // A job refused (the queue is full, the threads are gone, the connection does not
        // open) is dropped unrun, and `Load` ends the rebuild as failed.
        if let Err(error) = self.listings.detach(move |conn| load.size(conn)) {
            self.not_loaded(&error);
        }
    }

    /// Says that a load failed: only slower meanwhile (every `begin` reads first, as with no
    /// filter), but an operator should hear of a table that cannot be read.
    fn not_loaded(&self, error: &dyn std::fmt::Display) {
        let filters = self.read();
        let failures = filters.failures;
        let retry_in = filters
            .retry_at
            .map(|at| at.saturating_duration_since(Instant::now()));
        drop(filters);
        tracing::warn!(
            %error,
            failures,
            retry_in_ms = retry_in.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            "the SQLite store's key filter did not load; every begin reads first until it does"
        );
    }

    /// Ends a load: its filter answers from now on, or, when it failed, the next load waits
    /// a while (doubling, up to a minute) and the filter in place answers meanwhile.
    /// `failed` is why a read of the table failed, if one did.
    fn loaded(&self, filter: Option<Arc<Filter>>, failed: Option<rusqlite::Error>) {
        let mut filters = self.write();
        filters.rebuilding = false;
        filters.loading = None;
        let mut replaced = None;
        match filter {
            Some(filter) => {
                filter
                    .at_load
                    .store(filter.keys.load(Ordering::Relaxed), Ordering::Relaxed);
                replaced = filters.current.replace(filter);
                filters.failures = 0;
                filters.retry_at = None;
                filters.loads += 1;
            }
            None => {
                filters.failures = filters.failures.saturating_add(1);
                let backoff = Duration::from_secs(1)
                    .saturating_mul(1 << filters.failures.min(6))
                    .min(MAX_BACKOFF);
                filters.retry_at = Some(Instant::now() + backoff);
            }
        }
        drop(filters);
        if let Some(error) = failed {
            self.not_loaded(&error);
        }
        // The old filter (up to 40 MiB) is freed here, not under the lock every `begin` takes.
        drop(replaced);
    }

    fn hash_key(&self, key: &Key) -> u64 {
        self.hash(
            key.scope().as_str().as_bytes(),
            key.namespace().as_str().as_bytes(),
            key.client_key().as_str().as_bytes(),
        )
    }

    /// One hash of a key's three parts, the same from a [`Key`] and from a row.
    fn hash(&self, scope: &[u8], namespace: &[u8], client_key: &[u8]) -> u64 {
        self.hasher.hash_one((scope, namespace, client_key))
    }

    fn read(&self) -> RwLockReadGuard<'_, Filters> {
        // Every change under the lock is a few plain assignments: a panic elsewhere while it
        // was held leaves the state whole.
        self.filters.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Filters> {
        self.filters.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
