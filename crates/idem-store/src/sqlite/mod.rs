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

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::row::{RawRow, sql_int};
use idem_core::{
    Acquire, BeginOutcome, BeginRequest, BoxFuture, Bytes, Held, Key, Lease, LeaseError, LockError,
    LockName, LockState, LockStore, OwnerDigest, Record, ReleaseListener, StaleLease, Store,
    StoreError, Timestamp,
};

use crate::lock_feed::ReleaseFeed;
use rusqlite::{Connection, ErrorCode, OptionalExtension, TransactionBehavior, params};
use tokio::sync::oneshot;

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
    /// `StoreError::Unavailable`.
    pub busy_timeout: Duration,
    /// The most operations committed in one transaction.
    pub max_batch: usize,
    /// The most operations that may wait for the writer; beyond that, callers get
    /// `StoreError::Unavailable` at once rather than queueing without bound.
    pub max_queue: usize,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            max_batch: 512,
            max_queue: 16 * 1024,
        }
    }
}

/// The schema, one migration per entry; `PRAGMA user_version` is the number applied.
const MIGRATIONS: &[&str] = &[
    // 1: the record table. The key is a unique index rather than a WITHOUT ROWID primary key,
    // because stored responses can be large and WITHOUT ROWID tables suit small rows only.
    "CREATE TABLE idem_records (
        scope            TEXT    NOT NULL,
        namespace        TEXT    NOT NULL,
        client_key       TEXT    NOT NULL,
        fingerprint      BLOB    NOT NULL,
        status           TEXT    NOT NULL CHECK (status IN ('in_progress', 'completed', 'released')),
        fence            INTEGER NOT NULL,
        lease_id         BLOB    NOT NULL,
        lease_expires_at INTEGER NOT NULL,
        response         BLOB,
        ttl_ms           INTEGER NOT NULL,
        created_at       INTEGER NOT NULL,
        updated_at       INTEGER NOT NULL,
        expires_at       INTEGER NOT NULL
    );
    CREATE UNIQUE INDEX idem_records_key ON idem_records (scope, namespace, client_key);
    CREATE INDEX idem_records_expires_at ON idem_records (expires_at);",
    // 2: counters (segment ids), apart from records: they never expire.
    "CREATE TABLE idem_counters (
        scope      TEXT    NOT NULL,
        namespace  TEXT    NOT NULL,
        client_key TEXT    NOT NULL,
        value      INTEGER NOT NULL,
        PRIMARY KEY (scope, namespace, client_key)
    ) WITHOUT ROWID;",
    // 3: locks, one row per name, kept after release (the row carries the fence).
    "CREATE TABLE idem_locks (
        name       TEXT    NOT NULL PRIMARY KEY,
        owner      BLOB    NOT NULL,
        fence      INTEGER NOT NULL,
        expires_at INTEGER NOT NULL
    ) WITHOUT ROWID;",
];

/// Idempotency records in a SQLite database file. Clones share one writer thread.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    tx: mpsc::SyncSender<Op>,
    max_queue: usize,
    path: PathBuf,
    released: ReleaseFeed,
}

/// One operation for the writer thread: what to do, and where to send the answer.
struct Op {
    request: Request,
    responder: Responder,
}

enum Request {
    Begin(BeginRequest, Timestamp),
    Complete(Key, Lease, Bytes, Timestamp),
    Release(Key, Lease, Timestamp),
    Renew(Key, Lease, Duration, Timestamp),
    Advance(Key, u64),
    Raise(Key, u64),
    Reopen(Key, u64, Timestamp),
    Get(Key, Timestamp),
    Purge(Timestamp, usize),
    Lock(LockName, LockOp),
}

/// A lock operation; it runs by the writer's clock.
enum LockOp {
    Acquire(OwnerDigest, Duration),
    Renew(OwnerDigest, u64, Duration),
    Release(OwnerDigest, u64),
}

/// The answer of a [`LockOp`] of the same kind.
enum LockAnswer {
    Acquire(Acquire),
    Renew(Held),
    /// Whether the lock was still held.
    Release(bool),
}

enum Responder {
    Begin(oneshot::Sender<Result<BeginOutcome, StoreError>>),
    Lease(oneshot::Sender<Result<(), LeaseError>>),
    Renew(oneshot::Sender<Result<Lease, LeaseError>>),
    Advance(oneshot::Sender<Result<u64, StoreError>>),
    Reopen(oneshot::Sender<Result<bool, StoreError>>),
    Get(oneshot::Sender<Result<Option<Record>, StoreError>>),
    Purge(oneshot::Sender<Result<u64, StoreError>>),
    Lock(oneshot::Sender<Result<LockAnswer, LockError>>),
}

enum Answer {
    Begin(Result<BeginOutcome, StoreError>),
    Lease(Result<(), LeaseError>),
    Renew(Result<Lease, LeaseError>),
    Advance(Result<u64, StoreError>),
    Reopen(Result<bool, StoreError>),
    Get(Result<Option<Record>, StoreError>),
    Purge(Result<u64, StoreError>),
    Lock(Result<LockAnswer, LockError>),
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` with default options.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, SqliteOptions::default())
    }

    /// Opens (creating if needed) the database at `path`, applies pending migrations and starts
    /// the writer thread.
    pub fn open_with(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let conn = connect(&path, &options)?;
        let max_queue = options.max_queue.max(1);
        let (tx, rx) = mpsc::sync_channel(max_queue);
        let max_batch = options.max_batch.max(1);
        thread::Builder::new()
            .name("idem-sqlite".into())
            .spawn(move || Writer { conn, max_batch }.run(&rx))
            .map_err(|e| StoreError::backend("cannot start the SQLite writer thread", e))?;
        Ok(Self {
            tx,
            max_queue,
            path,
            released: ReleaseFeed::new(),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

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

fn writer_stopped() -> StoreError {
    StoreError::Unavailable {
        message: "the SQLite writer thread has stopped".into(),
        source: None,
    }
}

fn open_error(path: &Path, e: rusqlite::Error) -> StoreError {
    let what = match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => "the file is not a SQLite database".to_owned(),
        Some(ErrorCode::CannotOpen) => {
            "cannot open the file (does its directory exist, and may idem write there?)".to_owned()
        }
        Some(ErrorCode::ReadOnly) | Some(ErrorCode::PermissionDenied) => {
            "the file is not writable".to_owned()
        }
        _ => e.to_string(),
    };
    StoreError::backend(
        format!("cannot open SQLite database {}: {what}", path.display()),
        e,
    )
}

fn connect(path: &Path, options: &SqliteOptions) -> Result<Connection, StoreError> {
    let fail = |what: String| StoreError::Backend {
        message: format!("cannot open SQLite database {}: {what}", path.display()),
        source: None,
    };
    let mut conn = Connection::open(path).map_err(|e| open_error(path, e))?;
    conn.busy_timeout(options.busy_timeout)
        .map_err(|e| open_error(path, e))?;
    // journal_mode answers with the mode in effect; WAL is refused only by special files.
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .map_err(|e| open_error(path, e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(fail(format!(
            "journal_mode WAL is not available (got {mode})"
        )));
    }
    let sync = match options.synchronous {
        Synchronous::Full => "FULL",
        Synchronous::Normal => "NORMAL",
    };
    conn.pragma_update(None, "synchronous", sync)
        .map_err(|e| open_error(path, e))?;
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| open_error(path, e))?;
    let applied: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(|e| open_error(path, e))?;
    let applied = usize::try_from(applied).unwrap_or(usize::MAX);
    if applied > MIGRATIONS.len() {
        return Err(fail(format!(
            "the database has schema version {applied}, newer than this idem knows ({}); \
             use a newer idem",
            MIGRATIONS.len()
        )));
    }
    for sql in &MIGRATIONS[applied..] {
        tx.execute_batch(sql).map_err(|e| open_error(path, e))?;
    }
    tx.pragma_update(None, "user_version", MIGRATIONS.len())
        .map_err(|e| open_error(path, e))?;
    tx.commit().map_err(|e| open_error(path, e))?;
    Ok(conn)
}

struct Writer {
    conn: Connection,
    max_batch: usize,
}

fn store_error(e: &rusqlite::Error) -> StoreError {
    let message = format!("SQLite: {e}");
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Unavailable {
            message,
            source: None,
        },
        _ => StoreError::Backend {
            message,
            source: None,
        },
    }
}

impl Responder {
    /// Whether the caller has stopped waiting.
    fn is_closed(&self) -> bool {
        match self {
            Responder::Begin(tx) => tx.is_closed(),
            Responder::Lease(tx) => tx.is_closed(),
            Responder::Renew(tx) => tx.is_closed(),
            Responder::Advance(tx) => tx.is_closed(),
            Responder::Reopen(tx) => tx.is_closed(),
            Responder::Get(tx) => tx.is_closed(),
            Responder::Purge(tx) => tx.is_closed(),
            Responder::Lock(tx) => tx.is_closed(),
        }
    }

    /// Sends the answer; gives it back if the caller has gone.
    fn send(self, answer: Answer) -> Option<Answer> {
        match (self, answer) {
            (Responder::Begin(tx), Answer::Begin(a)) => tx.send(a).err().map(Answer::Begin),
            (Responder::Lease(tx), Answer::Lease(a)) => tx.send(a).err().map(Answer::Lease),
            (Responder::Renew(tx), Answer::Renew(a)) => tx.send(a).err().map(Answer::Renew),
            (Responder::Advance(tx), Answer::Advance(a)) => tx.send(a).err().map(Answer::Advance),
            (Responder::Reopen(tx), Answer::Reopen(a)) => tx.send(a).err().map(Answer::Reopen),
            (Responder::Get(tx), Answer::Get(a)) => tx.send(a).err().map(Answer::Get),
            (Responder::Purge(tx), Answer::Purge(a)) => tx.send(a).err().map(Answer::Purge),
            (Responder::Lock(tx), Answer::Lock(a)) => tx.send(a).err().map(Answer::Lock),
            // `apply` answers each request with its own kind; nothing else reaches here.
            (_, answer) => Some(answer),
        }
    }

    /// Tells the caller that its batch failed.
    fn fail(self, e: &rusqlite::Error) {
        let e = store_error(e);
        let _ = match self {
            Responder::Begin(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Lease(tx) => tx.send(Err(e.into())).map_err(drop),
            Responder::Renew(tx) => tx.send(Err(e.into())).map_err(drop),
            Responder::Advance(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Reopen(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Get(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Purge(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Lock(tx) => tx.send(Err(e.into())).map_err(drop),
        };
    }
}

impl Writer {
    fn run(mut self, rx: &mpsc::Receiver<Op>) {
        // Ends when every SqliteStore clone has been dropped.
        while let Ok(first) = rx.recv() {
            let mut batch = Vec::with_capacity(self.max_batch);
            batch.push(first);
            while batch.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            let orphans = self.run_batch(batch);
            if !orphans.is_empty() {
                // A key claimed for a caller that stopped waiting (a timeout, a dropped
                // request) is given back at once rather than held for a whole lease.
                let releases = orphans
                    .into_iter()
                    .map(|(key, lease, now)| Op {
                        request: Request::Release(key, lease, now),
                        responder: Responder::Lease(oneshot::channel().0),
                    })
                    .collect();
                self.run_batch(releases);
            }
        }
    }

    /// Runs `batch` in one transaction and answers every caller. Returns the leases acquired
    /// for callers that stopped waiting before the answer came.
    fn run_batch(&mut self, batch: Vec<Op>) -> Vec<(Key, Lease, Timestamp)> {
        // A caller that stopped waiting before its claim, lock or read ran needs none of them;
        // writes of a result (complete, release) are made regardless: the work is done.
        let batch: Vec<Op> = batch
            .into_iter()
            .filter(|op| {
                !(op.responder.is_closed()
                    && matches!(
                        op.request,
                        Request::Begin(..)
                            | Request::Get(..)
                            | Request::Purge(..)
                            | Request::Lock(_, LockOp::Acquire(..))
                    ))
            })
            .collect();
        let mut answers = Vec::with_capacity(batch.len());
        let result = (|| {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            for op in &batch {
                answers.push(apply(&tx, &op.request)?);
            }
            tx.commit()
        })();
        let mut orphans = Vec::new();
        match result {
            Ok(()) => {
                for (op, answer) in batch.into_iter().zip(answers) {
                    let returned = op.responder.send(answer);
                    if let (
                        Request::Begin(req, now),
                        Some(Answer::Begin(Ok(BeginOutcome::Acquired(lease)))),
                    ) = (op.request, returned)
                    {
                        orphans.push((req.key, lease, now));
                    }
                }
            }
            Err(e) => {
                // Nothing of this batch was committed: every caller gets the error (fail closed).
                for op in batch {
                    op.responder.fail(&e);
                }
            }
        }
        orphans
    }
}

/// Runs one operation inside the batch's transaction. `Err` is a SQL failure that aborts the
/// whole batch; refusals and corrupt rows are part of the answer.
fn apply(tx: &rusqlite::Transaction<'_>, request: &Request) -> rusqlite::Result<Answer> {
    Ok(match request {
        Request::Begin(req, now) => Answer::Begin(match load(tx, &req.key)? {
            Ok(existing) => {
                let step =
                    Record::begin(existing.as_ref(), req, *now, idem_core::LeaseId::generate());
                if let Some(new) = &step.write {
                    save(tx, new)?;
                }
                Ok(step.outcome)
            }
            Err(e) => Err(e),
        }),
        Request::Complete(key, lease, response, now) => Answer::Lease(transition(tx, key, |r| {
            Record::complete(r, lease, response.clone(), *now)
        })?),
        Request::Release(key, lease, now) => {
            Answer::Lease(transition(tx, key, |r| Record::release(r, lease, *now))?)
        }
        Request::Renew(key, lease, length, now) => Answer::Renew(match load(tx, key)? {
            Ok(Some(mut r)) => match r.renew_in_place(lease, *length, *now) {
                Ok(renewed) => {
                    save(tx, &r)?;
                    Ok(renewed)
                }
                Err(stale) => Err(stale.into()),
            },
            Ok(None) => Err(StaleLease.into()),
            Err(e) => Err(e.into()),
        }),
        Request::Advance(key, by) => {
            // Guarded so the sum never leaves SQLite's integers (it would turn into a float).
            let by = sql_int(*by);
            let value: Option<i64> = tx
                .prepare_cached(
                    "INSERT INTO idem_counters (scope, namespace, client_key, value)
                     VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (scope, namespace, client_key) DO UPDATE
                         SET value = value + excluded.value
                         WHERE value <= 9223372036854775807 - excluded.value
                     RETURNING value",
                )?
                .query_row(
                    params![
                        key.scope().as_str(),
                        key.namespace().as_str(),
                        key.client_key().as_str(),
                        by
                    ],
                    |row| row.get(0),
                )
                .optional()?;
            Answer::Advance(
                value
                    .and_then(|v| u64::try_from(v).ok())
                    .ok_or(StoreError::CounterExhausted),
            )
        }
        Request::Raise(key, to) => {
            let value: i64 = tx
                .prepare_cached(
                    "INSERT INTO idem_counters (scope, namespace, client_key, value)
                     VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (scope, namespace, client_key) DO UPDATE
                         SET value = max(value, excluded.value)
                     RETURNING value",
                )?
                .query_row(
                    params![
                        key.scope().as_str(),
                        key.namespace().as_str(),
                        key.client_key().as_str(),
                        sql_int(*to)
                    ],
                    |row| row.get(0),
                )?;
            Answer::Advance(u64::try_from(value).map_err(|_| StoreError::CounterExhausted))
        }
        Request::Reopen(key, fence, now) => Answer::Reopen(match load(tx, key)? {
            Ok(Some(mut r)) => {
                let changed = r.reopen_in_place(*fence, *now);
                if changed {
                    save(tx, &r)?;
                }
                Ok(changed)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(e),
        }),
        Request::Get(key, now) => {
            Answer::Get(load(tx, key)?.map(|r| r.filter(|r| r.is_live(*now))))
        }
        Request::Purge(now, limit) => {
            let now = sql_int(now.as_millis());
            let limit = i64::try_from(*limit).unwrap_or(i64::MAX);
            let n = tx
                .prepare_cached(
                    "DELETE FROM idem_records WHERE rowid IN (
                        SELECT rowid FROM idem_records
                        WHERE expires_at <= ?1 AND (status <> 'in_progress' OR lease_expires_at <= ?1)
                        LIMIT ?2)",
                )?
                .execute(params![now, limit])?;
            // Lock rows unused for an hour go with the same budget.
            let rest = limit.saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
            let before = now.saturating_sub(sql_int(idem_core::lock::lease_millis(
                idem_core::lock::LOCK_STATE_RETENTION,
            )));
            let locks = tx
                .prepare_cached(
                    "DELETE FROM idem_locks WHERE name IN (
                        SELECT name FROM idem_locks WHERE expires_at < ?1 LIMIT ?2)",
                )?
                .execute(params![before, rest])?;
            Answer::Purge(Ok((n + locks) as u64))
        }
        Request::Lock(name, op) => Answer::Lock(apply_lock(tx, name, op)?),
    })
}

/// A lock operation by the writer's clock, on the lock's row.
fn apply_lock(
    tx: &rusqlite::Transaction<'_>,
    name: &LockName,
    op: &LockOp,
) -> rusqlite::Result<Result<LockAnswer, LockError>> {
    let now = Timestamp::now();
    let mut state = tx
        .prepare_cached("SELECT owner, fence, expires_at FROM idem_locks WHERE name = ?1")?
        .query_row([name.as_str()], |row| {
            let owner: Vec<u8> = row.get(0)?;
            let fence: i64 = row.get(1)?;
            let expires_at: i64 = row.get(2)?;
            Ok((owner, fence, expires_at))
        })
        .optional()?
        .map(|(owner, fence, expires_at)| {
            Some(LockState {
                owner: OwnerDigest(owner.try_into().ok()?),
                fence: u64::try_from(fence).ok()?,
                expires_at: Timestamp::from_millis(u64::try_from(expires_at).ok()?),
            })
        });
    let Some(current) = state.take() else {
        return Ok(match op {
            LockOp::Acquire(owner, lease) => acquire_lock(tx, name, None, *owner, *lease, now)?,
            _ => Err(LockError::NotOwner),
        });
    };
    let Some(mut current) = current else {
        return Ok(Err(
            StoreError::Corrupt("a lock row is unreadable".into()).into()
        ));
    };
    let answer = match op {
        LockOp::Acquire(owner, lease) => {
            return acquire_lock(tx, name, Some(&current), *owner, *lease, now);
        }
        LockOp::Renew(owner, fence, lease) => current
            .renew(*owner, *fence, *lease, now)
            .map(LockAnswer::Renew),
        LockOp::Release(owner, fence) => current
            .release(*owner, *fence, now)
            .map(LockAnswer::Release),
    };
    if answer.is_ok() {
        save_lock(tx, name, &current)?;
    }
    Ok(answer)
}

fn acquire_lock(
    tx: &rusqlite::Transaction<'_>,
    name: &LockName,
    current: Option<&LockState>,
    owner: OwnerDigest,
    lease: Duration,
    now: Timestamp,
) -> rusqlite::Result<Result<LockAnswer, LockError>> {
    Ok(Ok(LockAnswer::Acquire(
        match LockState::acquire(current, owner, lease, now) {
            Ok(new) => {
                save_lock(tx, name, &new)?;
                Acquire::Acquired(Held {
                    fence: new.fence,
                    expires_at: new.expires_at,
                })
            }
            Err(until) => Acquire::Busy { until },
        },
    )))
}

fn save_lock(
    tx: &rusqlite::Transaction<'_>,
    name: &LockName,
    s: &LockState,
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO idem_locks (name, owner, fence, expires_at) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, fence = excluded.fence,
             expires_at = excluded.expires_at",
    )?
    .execute(params![
        name.as_str(),
        &s.owner.0[..],
        sql_int(s.fence),
        sql_int(s.expires_at.as_millis())
    ])?;
    Ok(())
}

fn transition(
    tx: &rusqlite::Transaction<'_>,
    key: &Key,
    f: impl FnOnce(Option<&Record>) -> Result<Option<Record>, StaleLease>,
) -> rusqlite::Result<Result<(), LeaseError>> {
    let existing = match load(tx, key)? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e.into())),
    };
    match f(existing.as_ref()) {
        Ok(Some(new)) => {
            save(tx, &new)?;
            Ok(Ok(()))
        }
        Ok(None) => Ok(Ok(())),
        Err(stale) => Ok(Err(stale.into())),
    }
}

fn load(
    tx: &rusqlite::Transaction<'_>,
    key: &Key,
) -> rusqlite::Result<Result<Option<Record>, StoreError>> {
    let mut stmt = tx.prepare_cached(
        "SELECT fingerprint, status, fence, lease_id, lease_expires_at, response, ttl_ms,
                created_at, updated_at, expires_at
         FROM idem_records WHERE scope = ?1 AND namespace = ?2 AND client_key = ?3",
    )?;
    let row = stmt
        .query_row(
            params![
                key.scope().as_str(),
                key.namespace().as_str(),
                key.client_key().as_str()
            ],
            |row| {
                Ok(RawRow {
                    fingerprint: row.get(0)?,
                    status: row.get(1)?,
                    fence: row.get(2)?,
                    lease_id: row.get(3)?,
                    lease_expires_at: row.get(4)?,
                    response: row.get(5)?,
                    ttl_ms: row.get(6)?,
                    created_at: row.get(7)?,
                    updated_at: row.get(8)?,
                    expires_at: row.get(9)?,
                })
            },
        )
        .optional()?;
    Ok(row.map(|raw| raw.into_record(key)).transpose())
}

fn save(tx: &rusqlite::Transaction<'_>, r: &Record) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO idem_records (scope, namespace, client_key, fingerprint, status, fence,
             lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)
         ON CONFLICT (scope, namespace, client_key) DO UPDATE SET
             fingerprint = excluded.fingerprint, status = excluded.status,
             fence = excluded.fence, lease_id = excluded.lease_id,
             lease_expires_at = excluded.lease_expires_at, response = excluded.response,
             ttl_ms = excluded.ttl_ms, created_at = excluded.created_at,
             updated_at = excluded.updated_at, expires_at = excluded.expires_at",
    )?
    .execute(params![
        r.key.scope().as_str(),
        r.key.namespace().as_str(),
        r.key.client_key().as_str(),
        &r.fingerprint.as_bytes()[..],
        r.status.as_str(),
        sql_int(r.fence),
        &r.lease_id.to_bytes()[..],
        sql_int(r.lease_expires_at.as_millis()),
        r.response.as_deref(),
        sql_int(r.ttl_ms),
        sql_int(r.created_at.as_millis()),
        sql_int(r.updated_at.as_millis()),
        sql_int(r.expires_at.as_millis()),
    ])?;
    Ok(())
}

impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
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

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let by = idem_core::counter_step(by)?;
        self.call(Request::Advance(key.clone(), by), Responder::Advance, Err)
            .await
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        self.call(Request::Raise(key.clone(), to), Responder::Advance, Err)
            .await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        let request = Request::Reopen(key.clone(), fence, now);
        self.call(request, Responder::Reopen, Err).await
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.call(Request::Get(key.clone(), now), Responder::Get, Err)
            .await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.call(Request::Purge(now, limit), Responder::Purge, Err)
            .await
    }
}

impl SqliteStore {
    async fn lock_op(&self, name: &LockName, op: LockOp) -> Result<LockAnswer, LockError> {
        self.call(Request::Lock(name.clone(), op), Responder::Lock, |e| {
            Err(e.into())
        })
        .await
    }
}

/// Locks by this machine's wall clock, in the database file: processes sharing the file share
/// the locks. Waiters in this process are woken on release; those of other processes notice at
/// their next attempt (see `Locks::poll_interval`).
impl LockStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Acquire, StoreError>> {
        Box::pin(async move {
            match self.lock_op(name, LockOp::Acquire(owner, lease)).await {
                Ok(LockAnswer::Acquire(a)) => Ok(a),
                Err(LockError::Store(e)) => Err(e),
                _ => Err(StoreError::Corrupt("unexpected lock answer".into())),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Held, LockError>> {
        Box::pin(async move {
            match self
                .lock_op(name, LockOp::Renew(owner, fence, lease))
                .await?
            {
                LockAnswer::Renew(held) => Ok(held),
                _ => Err(StoreError::Corrupt("unexpected lock answer".into()).into()),
            }
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        Box::pin(async move {
            match self.lock_op(name, LockOp::Release(owner, fence)).await? {
                LockAnswer::Release(was_held) => {
                    if was_held {
                        self.released.send(name.shared());
                    }
                    Ok(())
                }
                _ => Err(StoreError::Corrupt("unexpected lock answer".into()).into()),
            }
        })
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        Some(self.released.listen())
    }
}
