//! The embedded default store: SQLite, bundled into the binary.
//!
//! # How it works
//!
//! One writer thread per store owns the connection. Operations arrive over a channel; the
//! thread takes every operation that is waiting (up to a batch limit), runs them in one
//! `BEGIN IMMEDIATE` transaction and commits once, then answers each caller. Under load this is
//! group commit: one `fsync` serves a whole batch, which is how 64 concurrent tasks reach tens
//! of thousands of `begin`+`complete` per second with full durability.
//!
//! Inside the transaction each operation reads its record, applies the pure transition from
//! `idem-core` and writes the result. `BEGIN IMMEDIATE` takes SQLite's write lock before the
//! read, so read-decide-write is atomic with respect to every other connection, including
//! other processes on the same file (they wait on the lock, up to `busy_timeout`).
//!
//! The database runs in WAL mode; `synchronous = FULL` by default, so a completed record
//! survives a power loss, not only a crash of the process.
//!
//! Reads that need no write lock do not queue behind the writer: `get`, and the first step of
//! every `begin`, run on read connections of their own (`reader`), which in WAL mode see the
//! last commit without waiting for the writer. A `begin` whose record is completed (a replay
//! or a mismatch) or held by a live attempt is answered from that read: the answer needs no
//! write and was true at the moment of the read, so it is the one the writer would have given
//! then. Only a `begin` that writes (a fresh key, a takeover) goes on to the writer, which
//! reads the record again inside its transaction and decides.
//!
//! A fresh key's read finds nothing, so a filter of the keys the table may hold (`known`: a
//! Bloom filter loaded when the store opens and taught every key the writer commits) sends
//! a `begin` of a key it certainly does not hold straight to the writer. It only routes: a
//! key it wrongly calls absent (written by another process since the load) is decided by the
//! writer, correctly, and learnt.
//!
//! The operations the writer runs are listed once in `ops` (what each asks, where its answer
//! goes, and which function runs it); the writer thread and its batches are in `writer`, what
//! an operation on records does inside the transaction in `records`, the read connections in
//! `reader`, the key filter in `known`, the locks in `locks`, the operator's view (listing,
//! counting, repairs) in `admin`, and the schema, connection settings and errors in `schema`.
//! The imports point one way: this module sends operations to `ops`, the writer runs them
//! through `ops`, and `ops` calls `records`, `admin` and `locks`, which import neither.

use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Counters, Key, Lease, LeaseError, LockError, LockName,
    Record, RecordAdmin, Repair, Shown, Step, StepError, Store, StoreError, Timestamp,
};
use tokio::sync::oneshot;

use crate::lock_wakeup::ReleaseFeed;

mod admin;
mod known;
mod locks;
mod ops;
mod reader;
mod records;
mod schema;
mod writer;

use known::KnownKeys;
use reader::Readers;

use locks::{LockAnswer, LockOp};
use ops::{Op, Request, Responder};
use schema::connect;
use writer::Writer;

/// How much each `COMMIT` waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `synchronous = FULL`: a completed record survives power loss (the default).
    #[default]
    Full,
    /// `synchronous = NORMAL`: survives a crash of the process; the last commits may be lost
    /// on power loss (the database stays consistent).
    Normal,
}

/// Settings of a [`SqliteStore`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SqliteOptions {
    /// Durability of each commit.
    pub synchronous: Synchronous,
    /// How long to wait for another connection's write lock before failing with
    /// `StoreError::Unavailable`; opening the file (switching it to WAL, migrating it) waits
    /// as long for other openers.
    pub busy_timeout: Duration,
    /// The most operations committed in one transaction.
    pub max_batch: usize,
    /// The most operations that may wait for the writer; beyond that, callers get
    /// `StoreError::Unavailable` at once rather than queueing without bound.
    pub max_queue: usize,
    /// Read connections for replays and `get`, each on a thread of its own; 0 sends them
    /// through the writer.
    pub read_connections: usize,
    /// Keep in memory a filter of the keys the table holds, so that a `begin` of a key it
    /// certainly does not hold goes straight to the writer rather than reading first (with
    /// read connections). A key another process wrote after the filter was loaded is learnt
    /// at its first `begin` here, which goes through the writer: slower than a read, and
    /// while another connection holds the write lock it waits for it, and may fail with
    /// `StoreError::Unavailable` where a read would have replayed. About 2.4 bytes a record
    /// (at least 77 KiB, at most 40 MiB, twice that while a larger one loads), loaded when the
    /// store opens, on the connection listings use. Default true; off for a file whose keys
    /// other processes write most of, and for a command that runs a few operations and exits.
    pub key_filter: bool,
    /// Create the database file when it is missing (default true). Off for a tool that only
    /// looks at and mends an existing store: a mistyped path must be an error, not a new,
    /// empty database that answers every question with nothing.
    pub create: bool,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            max_batch: 512,
            max_queue: 16 * 1024,
            read_connections: 2,
            key_filter: true,
            create: true,
        }
    }
}

/// How many listings and counts may wait for their read connection.
const LISTINGS_QUEUE: usize = 64;

/// Idempotency records in a SQLite database file. Clones share one writer thread.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    tx: mpsc::SyncSender<Op>,
    max_queue: usize,
    path: PathBuf,
    released: ReleaseFeed,
    /// Replays and `get` (none: through the writer).
    reads: Option<Arc<Readers>>,
    /// Keys the table may hold: a `begin` of any other goes straight to the writer (none:
    /// every `begin` reads first).
    known: Option<Arc<KnownKeys>>,
    /// Listings and counts, apart, so that a long count never delays a replay.
    listings: Arc<Readers>,
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` with default options.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, SqliteOptions::default())
    }

    /// Opens the database at `path` (creating it if needed, unless [`SqliteOptions::create`] is
    /// off), applies pending migrations and starts the writer thread.
    pub fn open_with(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let conn = connect(&path, &options)?;
        let max_queue = options.max_queue.max(1);
        let (tx, rx) = mpsc::sync_channel(max_queue);
        let max_batch = options.max_batch.max(1);
        let reads = (options.read_connections > 0).then(|| {
            Arc::new(Readers::new(
                "reads",
                path.clone(),
                options.busy_timeout,
                options.read_connections,
                options.max_queue,
            ))
        });
        let listings = Arc::new(Readers::new(
            "listings",
            path.clone(),
            options.busy_timeout,
            1,
            LISTINGS_QUEUE,
        ));
        let known =
            (reads.is_some() && options.key_filter).then(|| KnownKeys::load(Arc::clone(&listings)));
        let writer = Writer {
            conn,
            max_batch,
            known: known.clone(),
        };
        thread::Builder::new()
            .name("idem-sqlite".into())
            .spawn(move || writer.run(&rx))
            .map_err(|e| StoreError::backend("cannot start the SQLite writer thread", e))?;
        Ok(Self {
            tx,
            max_queue,
            reads,
            known,
            listings,
            path,
            released: ReleaseFeed::new(),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this store keeps a key filter (tests of how stores are opened).
    #[cfg(test)]
    pub(crate) fn has_key_filter(&self) -> bool {
        self.known.is_some()
    }

    /// The record for `key`, live or not, read on a read connection; `None` without them.
    async fn read(&self, key: &Key) -> Option<Result<Option<Record>, StoreError>> {
        let key = key.clone();
        let reads = self.reads.as_ref()?;
        Some(reads.run(move |conn| records::load(conn, &key)).await)
    }

    /// The answer to a `begin` that writes nothing (a replay, a mismatch, an attempt in
    /// flight), from a read connection; `None` when the writer must decide: the `begin`
    /// writes (a fresh key, a takeover), or the read could not be made.
    async fn decided_by_reading(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        let existing = self.read(&req.key).await?.ok()??;
        // The lease id is only written by a `begin` that acquires, which this one never
        // answers: no random id need be drawn.
        let unused = idem_core::LeaseId::from_bytes([0; 16]);
        let step = Record::begin(Some(&existing), req, now, unused);
        step.write.is_none().then_some(step.outcome)
    }

    /// A lock operation, run by the writer.
    async fn lock_op(&self, name: &LockName, op: LockOp) -> Result<LockAnswer, LockError> {
        self.call(Request::Lock(name.clone(), op), Responder::Lock, |e| {
            Err(e.into())
        })
        .await
    }

    /// An operator's repair, run by the writer: whether it changed the record.
    async fn repair_record(
        &self,
        key: &Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let request = Request::Repair(key.clone(), shown, repair, now);
        self.call(request, Responder::Reopen, Err).await
    }

    /// Sends `request` to the writer and waits for its answer.
    async fn call<T>(
        &self,
        request: Request,
        responder: impl FnOnce(oneshot::Sender<T>) -> Responder,
        failed: impl FnOnce(StoreError) -> T,
    ) -> T {
        let (reply, rx) = oneshot::channel();
        let op = Op {
            request,
            responder: responder(reply),
        };
        match self.tx.try_send(op) {
            Ok(()) => rx.await.unwrap_or_else(|_| failed(writer_stopped())),
            Err(mpsc::TrySendError::Full(_)) => failed(StoreError::Unavailable {
                message: format!(
                    "the SQLite store has {} operations waiting; try again shortly",
                    self.max_queue
                ),
                source: None,
            }),
            Err(mpsc::TrySendError::Disconnected(_)) => failed(writer_stopped()),
        }
    }
}

impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        // A key the filter has not seen skips the read; the writer teaches it after its commit.
        let may_hold = self.known.as_ref().is_none_or(|k| k.may_hold(&req.key));
        if may_hold && let Some(outcome) = self.decided_by_reading(req, now).await {
            return Ok(outcome);
        }
        self.call(Request::Begin(req.clone(), now), Responder::Begin, Err)
            .await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let request = Request::Complete(key.clone(), *lease, response, now);
        self.call(request, Responder::Lease, |e| Err(e.into()))
            .await
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        let request = Request::Release(key.clone(), *lease, now);
        self.call(request, Responder::Lease, |e| Err(e.into()))
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        let request = Request::Renew(key.clone(), *lease, length, now);
        self.call(request, Responder::Renew, |e| Err(e.into()))
            .await
    }

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        let request = Request::Step(key.clone(), *lease, step.clone(), now);
        self.call(request, Responder::Step, |e| Err(e.into())).await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        let request = Request::Reopen(key.clone(), fence, now);
        self.call(request, Responder::Reopen, Err).await
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        match self.read(key).await {
            // No read connections, or all busy, gone or unable to open (as for `begin`, any
            // read that cannot be made): the writer reads too.
            None | Some(Err(_)) => {
                self.call(Request::Get(key.clone(), now), Responder::Get, Err)
                    .await
            }
            Some(read) => Ok(read?.filter(|r| r.is_live(now))),
        }
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.call(Request::Purge(now, limit), Responder::Purge, Err)
            .await
    }

    fn admin(&self) -> Option<&dyn RecordAdmin> {
        Some(self)
    }
}

impl Counters for SqliteStore {
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let by = idem_core::counter_step(by)?;
        self.call(Request::Advance(key.clone(), by), Responder::Advance, Err)
            .await
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        self.call(Request::Raise(key.clone(), to), Responder::Advance, Err)
            .await
    }
}

fn writer_stopped() -> StoreError {
    StoreError::Unavailable {
        message: "the SQLite writer thread has stopped".into(),
        source: None,
    }
}
