//! The schema, and opening a connection with the settings every store uses.

use std::path::Path;

use idem_core::StoreError;
use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior};

use super::{SqliteOptions, Synchronous};

/// The schema, one migration per entry; `PRAGMA user_version` is the number applied.
pub(super) const MIGRATIONS: &[&str] = &[
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
    // 4: the steps of multi-step work (`idem_core::step::encode`), NULL for none.
    "ALTER TABLE idem_records ADD COLUMN steps BLOB;",
];

/// A failure of a statement: busy or locked may pass, the rest is a backend error.
pub(super) fn store_error(e: &rusqlite::Error) -> StoreError {
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

pub(super) fn open_error(path: &Path, e: rusqlite::Error) -> StoreError {
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

/// Opens the file as [`connect_once`] does, trying again while SQLite answers that another
/// connection holds the lock, until `busy_timeout` has passed. The busy handler that
/// `busy_timeout` sets does not cover every case: where two connections each hold a shared
/// lock and want the exclusive one (two openers switching a new file to WAL at once), SQLite
/// answers one of them "database is locked" at once rather than let both wait on each other.
pub(super) fn connect(path: &Path, options: &SqliteOptions) -> Result<Connection, StoreError> {
    let until = std::time::Instant::now() + options.busy_timeout;
    let mut pause = std::time::Duration::from_millis(2);
    loop {
        match connect_once(path, options) {
            Err(e) if busy(&e) && std::time::Instant::now() + pause < until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(100));
            }
            opened => return opened,
        }
    }
}

/// Whether `e` is SQLite's "database is locked" (or "table is locked").
fn busy(e: &StoreError) -> bool {
    let StoreError::Backend {
        source: Some(source),
        ..
    } = e
    else {
        return false;
    };
    source
        .downcast_ref::<rusqlite::Error>()
        .and_then(rusqlite::Error::sqlite_error_code)
        .is_some_and(|code| matches!(code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked))
}

fn connect_once(path: &Path, options: &SqliteOptions) -> Result<Connection, StoreError> {
    let fail = |what: String| StoreError::Backend {
        message: format!("cannot open SQLite database {}: {what}", path.display()),
        source: None,
    };
    let mut flags = OpenFlags::default();
    if !options.create {
        // Without the flag SQLite refuses a missing file itself; the check first only makes
        // the message plain.
        flags.remove(OpenFlags::SQLITE_OPEN_CREATE);
        if !path.exists() {
            return Err(fail(
                "there is no such file (an existing database is opened, none is created)"
                    .to_owned(),
            ));
        }
    }
    let mut conn = Connection::open_with_flags(path, flags).map_err(|e| open_error(path, e))?;
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
