//! Idempotency records in PostgreSQL.
//!
//! Each operation is one conditional statement that PostgreSQL applies atomically per row:
//! `begin` is an `INSERT … ON CONFLICT DO UPDATE … WHERE <the key may be acquired>`, so of
//! any number of concurrent `begin`s exactly one gets a row back; `complete`, `release` and
//! `reopen` are `UPDATE`s conditioned on the lease (id and fence) and the record's state. Only
//! when a conditional statement changed nothing is the row read, to tell the caller why (and
//! that read is decided by the same pure transitions as every other store).
//!
//! Expiry follows the caller's clock (`now`), as everywhere; expired rows are deleted in
//! bounded batches by `purge_expired`, found through an index on `purge_after`: the lease end
//! plus the TTL, set when a lease is granted or renewed. Completing or releasing changes
//! `expires_at` but no indexed column, so it is a HOT update (the table keeps free space in
//! each page for it). A completion after the lease ran out, or a reopen, moves `expires_at`
//! past `purge_after`, so a purge deletes a row only once both times have passed.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, StaleLease, Store,
    StoreError, Timestamp,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection, PgPool, SqlSafeStr, SqlStr};

use crate::batch::{BeginJob, CompleteJob, GroupCommit, ManyAtOnce};
use crate::row::sql_int;
use crate::sql::{self, Migration, TableName};

/// The schema, one migration per version; applied in order, each once.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "records table and purge index",
        statements: &[
            "CREATE TABLE IF NOT EXISTS {table} (
            scope            TEXT    NOT NULL,
            namespace        TEXT    NOT NULL,
            client_key       TEXT    NOT NULL,
            fingerprint      BYTEA   NOT NULL,
            status           TEXT    NOT NULL
                CHECK (status IN ('in_progress', 'completed', 'released')),
            fence            BIGINT  NOT NULL,
            lease_id         BYTEA   NOT NULL,
            lease_expires_at BIGINT  NOT NULL,
            response         BYTEA,
            ttl_ms           BIGINT  NOT NULL,
            created_at       BIGINT  NOT NULL,
            updated_at       BIGINT  NOT NULL,
            expires_at       BIGINT  NOT NULL,
            purge_after      BIGINT  NOT NULL,
            PRIMARY KEY (scope, namespace, client_key)
        ) WITH (fillfactor = 80)",
            "CREATE INDEX IF NOT EXISTS {name}_purge_after ON {table} (purge_after)",
        ],
    },
    Migration {
        version: 2,
        description: "counters",
        statements: &["CREATE TABLE IF NOT EXISTS {table}_counters (
            scope      TEXT   NOT NULL,
            namespace  TEXT   NOT NULL,
            client_key TEXT   NOT NULL,
            value      BIGINT NOT NULL,
            PRIMARY KEY (scope, namespace, client_key)
        )"],
    },
    Migration {
        version: 3,
        description: "locks",
        statements: &["CREATE TABLE IF NOT EXISTS {table}_locks (
            name       TEXT   NOT NULL PRIMARY KEY,
            owner      BYTEA  NOT NULL,
            fence      BIGINT NOT NULL,
            expires_at BIGINT NOT NULL
        ) WITH (fillfactor = 80)"],
    },
];

/// How a [`PostgresStore`] connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresOptions {
    /// The records table (created on first use); letters, digits and `_`, optionally
    /// schema-qualified (`idem.records`). Default `idem_records`.
    pub table: String,
    /// The most connections the pool opens. Default 16.
    pub max_connections: u32,
    /// How long an operation waits for a free connection (or a new one) before failing with
    /// [`StoreError::Unavailable`]. Default 5 s.
    pub acquire_timeout: Duration,
    /// How long a statement waits for a row lock (`lock_timeout`) before failing with
    /// [`StoreError::Unavailable`]: a `begin` of a key whose record a caller's open
    /// transaction holds (same-transaction mode) waits at most this long instead of holding a
    /// pooled connection without bound. It applies to every statement on the store's
    /// connections, business writes run through [`PostgresStore::pool`] included. Default 5 s.
    pub lock_timeout: Duration,
    /// The most records one statement begins or completes (group commit). Calls that arrive
    /// while statements are in flight wait and then go together, up to this many per
    /// statement, on at most an eighth of the pool's connections for each kind; 1 sends every
    /// call on its own; at most 1024. Default 64.
    pub max_batch: usize,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        Self {
            table: "idem_records".to_owned(),
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(5),
            max_batch: 64,
        }
    }
}

/// Idempotency records in a PostgreSQL table. Clones share one connection pool.
///
/// The pool reconnects by itself: while the server is down every operation fails with
/// [`StoreError::Unavailable`] (the work does not run), and once it is back operations succeed
/// again without a restart.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    sql: Statements,
    locks: crate::postgres_locks::PgLocks,
    /// `None` when every call goes on its own (`max_batch` 1).
    batches: Option<GroupCommit>,
}

#[derive(Clone, Debug)]
struct Statements {
    begin: SqlStr,
    begin_many: SqlStr,
    complete_many: SqlStr,
    load: SqlStr,
    complete: SqlStr,
    release: SqlStr,
    renew: SqlStr,
    reopen: SqlStr,
    get: SqlStr,
    purge: SqlStr,
    advance: SqlStr,
    raise: SqlStr,
}

/// The columns [`RawRow`] is read from, in its order.
const COLUMNS: &str = "fingerprint, status, fence, lease_id, lease_expires_at, response, ttl_ms,
    created_at, updated_at, expires_at";

/// How `begin` takes an existing row over: only when it may be acquired (expired, released,
/// or in progress for the same request with its lease run out, as `Record::begin` decides),
/// `now` being the new row's `created_at`.
const TAKE_OVER: &str = "ON CONFLICT (scope, namespace, client_key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, status = 'in_progress',
        fence = r.fence + 1, lease_id = EXCLUDED.lease_id,
        lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
        ttl_ms = EXCLUDED.ttl_ms, created_at = EXCLUDED.created_at,
        updated_at = EXCLUDED.updated_at, expires_at = EXCLUDED.expires_at,
        purge_after = EXCLUDED.purge_after
    WHERE r.expires_at <= EXCLUDED.created_at
       OR r.status = 'released'
       OR (r.status = 'in_progress' AND r.fingerprint = EXCLUDED.fingerprint
           AND r.lease_expires_at <= EXCLUDED.created_at)";

/// `expires_at` for a record settled at `$now`: `now + ttl_ms`, capped at `i64::MAX`.
const SETTLED_EXPIRY: &str = "LEAST(ttl_ms, 9223372036854775807 - $4) + $4";

impl Statements {
    fn new(t: &TableName) -> Self {
        let s = |sql: String| AssertSqlSafe(sql).into_sql_str();
        let key = "scope = $1 AND namespace = $2 AND client_key = $3";
        Self {
            // A fresh row has fence 1; an existing one is taken over only when it may be
            // acquired: expired, released, or in progress for the same request with its lease
            // run out (`Record::begin`).
            begin: s(format!(
                "INSERT INTO {t} AS r (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 VALUES ($1, $2, $3, $5, 'in_progress', 1, $6, $7, NULL, $8, $4, $4, $9, $9)
                 {TAKE_OVER}
                 RETURNING fence"
            )),
            // `begin` for many records: the same decision per row, `now` being each row's
            // `created_at`. Rows go in key order, so two batches lock shared keys in the same
            // order and cannot deadlock; each acquired row comes back with its (unique) lease id.
            begin_many: s(format!(
                "INSERT INTO {t} AS r (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 SELECT i.scope, i.namespace, i.client_key, i.fingerprint, 'in_progress', 1,
                     i.lease_id, i.lease_expires_at, NULL, i.ttl_ms, i.now, i.now, i.expires_at,
                     i.expires_at
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[],
                     $6::bytea[], $7::int8[], $8::int8[], $9::int8[])
                     AS i(scope, namespace, client_key, now, fingerprint, lease_id,
                          lease_expires_at, ttl_ms, expires_at)
                 ORDER BY i.scope, i.namespace, i.client_key
                 {TAKE_OVER}
                 RETURNING lease_id, fence"
            )),
            // `complete` for many records; each completed row comes back with its lease id.
            complete_many: s(format!(
                "UPDATE {t} AS r SET status = 'completed', response = i.response,
                     updated_at = i.now,
                     expires_at = LEAST(r.ttl_ms, 9223372036854775807 - i.now) + i.now
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[],
                     $6::int8[], $7::bytea[])
                     AS i(scope, namespace, client_key, now, lease_id, fence, response)
                 WHERE r.scope = i.scope AND r.namespace = i.namespace
                   AND r.client_key = i.client_key AND r.lease_id = i.lease_id
                   AND r.fence = i.fence AND r.status = 'in_progress' AND r.expires_at > i.now
                 RETURNING r.lease_id"
            )),
            load: s(format!("SELECT {COLUMNS} FROM {t} WHERE {key}")),
            complete: s(format!(
                "UPDATE {t} SET status = 'completed', response = $7, updated_at = $4,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {key} AND lease_id = $5 AND fence = $6 AND status = 'in_progress'
                   AND expires_at > $4"
            )),
            release: s(format!(
                "UPDATE {t} SET status = 'released', response = NULL, updated_at = $4,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {key} AND lease_id = $5 AND fence = $6 AND status = 'in_progress'
                   AND expires_at > $4"
            )),
            // $6: the new lease end. Retention runs on from it, and the purge index follows
            // if it must move later.
            renew: s(format!(
                "UPDATE {t} SET lease_expires_at = $6, updated_at = $4,
                     expires_at = LEAST(ttl_ms, 9223372036854775807 - $6) + $6,
                     purge_after = GREATEST(purge_after, LEAST(ttl_ms, 9223372036854775807 - $6) + $6)
                 WHERE {key} AND lease_id = $5 AND fence = $7 AND status = 'in_progress'
                   AND expires_at > $4"
            )),
            reopen: s(format!(
                "UPDATE {t} SET status = 'released', response = NULL, updated_at = $4,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {key} AND fence = $5 AND status = 'completed' AND expires_at > $4"
            )),
            get: s(format!(
                "SELECT {COLUMNS} FROM {t} WHERE {key} AND expires_at > $4"
            )),
            // No row back: the sum would pass i64::MAX.
            advance: s(format!(
                "INSERT INTO {t}_counters AS c (scope, namespace, client_key, value)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (scope, namespace, client_key) DO UPDATE
                     SET value = c.value + EXCLUDED.value
                     WHERE c.value <= 9223372036854775807 - EXCLUDED.value
                 RETURNING value"
            )),
            raise: s(format!(
                "INSERT INTO {t}_counters AS c (scope, namespace, client_key, value)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (scope, namespace, client_key) DO UPDATE
                     SET value = GREATEST(c.value, EXCLUDED.value)
                 RETURNING value"
            )),
            purge: s(format!(
                // The condition is repeated outside: a row a concurrent `begin` took over
                // while this waited for its lock is rechecked against it and kept.
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                     SELECT ctid FROM {t} WHERE purge_after <= $1 AND expires_at <= $1
                     LIMIT $2))
                   AND purge_after <= $1 AND expires_at <= $1"
            )),
        }
    }
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host/db`) with default options and applies pending
    /// migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, PostgresOptions::default()).await
    }

    /// Connects with `options` and applies pending migrations.
    pub async fn connect_with(url: &str, options: PostgresOptions) -> Result<Self, StoreError> {
        let connect: PgConnectOptions = url
            .parse()
            .map_err(|e| StoreError::backend("the PostgreSQL URL is not valid", e))?;
        let table = TableName::parse(&options.table)?;
        // Read committed whatever the server's default: under repeatable read a contended
        // upsert fails with a serialization error instead of waiting and deciding.
        let connect = connect.options([
            (
                "lock_timeout",
                format!("{}ms", options.lock_timeout.as_millis().max(1)),
            ),
            ("default_transaction_isolation", "read committed".to_owned()),
        ]);
        // One direct connection first: it reports why a server cannot be reached (the pool
        // would only say it timed out), and it applies the migrations.
        let mut first = connect
            .connect()
            .await
            .map_err(|e| error("cannot connect to PostgreSQL", e))?;
        migrate(&mut first, &table).await?;
        let _ = first.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(connect);
        Ok(Self {
            sql: Statements::new(&table),
            locks: crate::postgres_locks::PgLocks::new(&table),
            pool,
            batches: GroupCommit::new(options.max_connections, options.max_batch),
        })
    }

    /// The connection pool, for running business writes next to the records.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Completes the record inside the caller's transaction (same-transaction mode): the
    /// caller's business writes and the completion commit together, or neither does, so a
    /// crash can never leave one without the other.
    ///
    /// Call [`Store::begin`] first, on its own (the in-progress record must be visible to
    /// other attempts while the work runs); then open a transaction on [`Self::pool`], do the
    /// work in it, call this, and commit. If this returns an error, roll back: a
    /// [`LeaseError::Stale`] means another attempt took the key over, and the work must not
    /// commit. Until the commit the record's row is locked, so a concurrent `begin` of the key
    /// waits for the outcome.
    ///
    /// ```no_run
    /// # async fn demo(store: &idem_store::PostgresStore, key: &idem_core::Key, lease: &idem_core::Lease)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.pool().begin().await?;
    /// sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 7")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// let now = idem_core::Timestamp::now();
    /// store.complete_in(&mut tx, key, lease, b"{\"ok\":true}".to_vec().into(), now).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(
        &self,
        tx: &mut PgConnection,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.settle_on(tx, &self.sql.complete, key, lease, Some(response), now)
            .await
    }

    pub(crate) fn locks(&self) -> &crate::postgres_locks::PgLocks {
        &self.locks
    }

    pub(crate) async fn conn(
        &self,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| error("no PostgreSQL connection", e))
    }

    async fn load(&self, c: &mut PgConnection, key: &Key) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(self.sql.load.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .fetch_optional(c)
            .await
            .map_err(|e| error("cannot read the record", e))?;
        row.map(|r| sql::raw(&r)?.into_record(key)).transpose()
    }

    /// `begin` on one connection (of the pool, or a caller's transaction).
    async fn begin_on(
        &self,
        c: &mut PgConnection,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        // The record a fresh acquisition writes; its fence comes from the database.
        let (lease, fresh) = Record::acquired(req, now, 1, idem_core::LeaseId::generate());
        // A bounded number of rounds: another begin may change the row between our refused
        // upsert and our read (released, expired); then the upsert is tried again.
        for _ in 0..8 {
            let fence: Option<i64> = sqlx::query_scalar(self.sql.begin.clone())
                .bind(req.key.scope().as_str())
                .bind(req.key.namespace().as_str())
                .bind(req.key.client_key().as_str())
                .bind(sql_int(now.as_millis()))
                .bind(&fresh.fingerprint.as_bytes()[..])
                .bind(&lease.id.to_bytes()[..])
                .bind(sql_int(lease.expires_at.as_millis()))
                .bind(sql_int(fresh.ttl_ms))
                .bind(sql_int(fresh.expires_at.as_millis()))
                .fetch_optional(&mut *c)
                .await
                .map_err(|e| error("cannot begin the record", e))?;
            if let Some(fence) = fence {
                let fence = u64::try_from(fence)
                    .map_err(|_| StoreError::Corrupt("the stored fence is negative".into()))?;
                return Ok(BeginOutcome::Acquired(Lease { fence, ..lease }));
            }
            let existing = self.load(c, &req.key).await?;
            let step = Record::begin(existing.as_ref(), req, now, idem_core::LeaseId::generate());
            if !matches!(step.outcome, BeginOutcome::Acquired(_)) {
                return Ok(step.outcome);
            }
        }
        Err(StoreError::Unavailable {
            message: "the record kept changing under contention; try again".into(),
            source: None,
        })
    }

    /// Runs a lease-conditioned update; if it changed nothing, reads the row to tell a
    /// repeated call by the same lease (`Ok`) from a stale lease.
    async fn settle_on(
        &self,
        c: &mut PgConnection,
        statement: &SqlStr,
        key: &Key,
        lease: &Lease,
        response: Option<Bytes>,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let mut q = sqlx::query(statement.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(now.as_millis()))
            .bind(&lease.id.to_bytes()[..])
            .bind(sql_int(lease.fence));
        if let Some(r) = &response {
            q = q.bind(&r[..]);
        }
        let done = q
            .execute(&mut *c)
            .await
            .map_err(|e| error("cannot settle the record", e))?;
        if done.rows_affected() == 1 {
            return Ok(());
        }
        let Some(mut record) = self.load(c, key).await? else {
            return Err(StaleLease.into());
        };
        sql::repeated_settle(&mut record, lease, response, now)
    }
}

impl ManyAtOnce for PostgresStore {
    async fn begin_alone(
        &self,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let mut c = self.conn().await?;
        self.begin_on(&mut c, req, now).await
    }

    async fn complete_alone(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let mut c = self.conn().await?;
        self.settle_on(&mut c, &self.sql.complete, key, lease, Some(response), now)
            .await
    }

    async fn begin_many(
        &self,
        jobs: &[BeginJob],
        fresh: &[(Lease, Record)],
    ) -> Result<Option<Vec<crate::batch::Acquired>>, StoreError> {
        let column = |f: fn(&BeginJob, &(Lease, Record)) -> i64| -> Vec<i64> {
            jobs.iter().zip(fresh).map(|(j, r)| f(j, r)).collect()
        };
        let mut c = self.conn().await?;
        Ok(sqlx::query_as(self.sql.begin_many.clone())
            .bind(key_column(jobs.iter().map(|j| &j.req.key), |k| {
                k.scope().as_str()
            }))
            .bind(key_column(jobs.iter().map(|j| &j.req.key), |k| {
                k.namespace().as_str()
            }))
            .bind(key_column(jobs.iter().map(|j| &j.req.key), |k| {
                k.client_key().as_str()
            }))
            .bind(column(|j, _| sql_int(j.now.as_millis())))
            .bind(
                fresh
                    .iter()
                    .map(|(_, r)| r.fingerprint.as_bytes().to_vec())
                    .collect::<Vec<_>>(),
            )
            .bind(
                fresh
                    .iter()
                    .map(|(l, _)| l.id.to_bytes())
                    .collect::<Vec<_>>(),
            )
            .bind(column(|_, (l, _)| sql_int(l.expires_at.as_millis())))
            .bind(column(|_, (_, r)| sql_int(r.ttl_ms)))
            .bind(column(|_, (_, r)| sql_int(r.expires_at.as_millis())))
            .fetch_all(&mut *c)
            .await
            .ok())
    }

    /// The rows go in key order, as the batched `begin` takes them, so that batches meeting
    /// on keys lock them in one order.
    async fn complete_many(&self, jobs: &[CompleteJob]) -> Result<Option<Vec<bool>>, StoreError> {
        let asked = jobs;
        let mut sorted: Vec<&CompleteJob> = jobs.iter().collect();
        sorted.sort_by(|a, b| a.key.cmp(&b.key));
        let jobs = &sorted[..];
        let mut c = self.conn().await?;
        let done: Option<Vec<Vec<u8>>> = sqlx::query_scalar(self.sql.complete_many.clone())
            .bind(key_column(jobs.iter().map(|j| &j.key), |k| {
                k.scope().as_str()
            }))
            .bind(key_column(jobs.iter().map(|j| &j.key), |k| {
                k.namespace().as_str()
            }))
            .bind(key_column(jobs.iter().map(|j| &j.key), |k| {
                k.client_key().as_str()
            }))
            .bind(
                jobs.iter()
                    .map(|j| sql_int(j.now.as_millis()))
                    .collect::<Vec<_>>(),
            )
            .bind(
                jobs.iter()
                    .map(|j| j.lease.id.to_bytes())
                    .collect::<Vec<_>>(),
            )
            .bind(
                jobs.iter()
                    .map(|j| sql_int(j.lease.fence))
                    .collect::<Vec<_>>(),
            )
            .bind(jobs.iter().map(|j| &j.response[..]).collect::<Vec<_>>())
            .fetch_all(&mut *c)
            .await
            .ok();
        Ok(done.map(|done| {
            asked
                .iter()
                .map(|j| done.iter().any(|id| id[..] == j.lease.id.to_bytes()[..]))
                .collect()
        }))
    }
}

/// One part of each key, as a column to bind as an array.
fn key_column<'k>(keys: impl Iterator<Item = &'k Key>, part: fn(&Key) -> &str) -> Vec<&'k str> {
    keys.map(part).collect()
}

/// Whether every migration is applied (false if that cannot be read).
async fn current(c: &mut PgConnection, table: &TableName) -> bool {
    let applied: Result<Vec<i64>, _> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {}",
        table.migrations_table()
    )))
    .fetch_all(&mut *c)
    .await;
    applied.is_ok_and(|a| sql::pending(MIGRATIONS, &a).is_ok_and(|p| p.is_empty()))
}

/// Applies pending migrations in one transaction, under an advisory lock so that
/// processes starting together apply each migration once.
async fn migrate(c: &mut PgConnection, table: &TableName) -> Result<(), StoreError> {
    // Up to date already: nothing to lock or create, so a service may run as a user without
    // the right to change the schema (after `idem migrate` ran as one with it).
    if current(c, table).await {
        return Ok(());
    }
    let fail = |e| error("cannot apply the PostgreSQL schema", e);
    let mut tx = c.begin().await.map_err(fail)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("idem migrations {table}"))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let versions = table.migrations_table();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {versions} (
             version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at BIGINT NOT NULL)"
    )))
    .execute(&mut *tx)
    .await
    .map_err(fail)?;
    let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {versions} ORDER BY version"
    )))
    .fetch_all(&mut *tx)
    .await
    .map_err(fail)?;
    for m in sql::pending(MIGRATIONS, &applied)? {
        for statement in m.statements {
            sqlx::query(AssertSqlSafe(table.fill(statement)))
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {versions} (version, description, applied_at) VALUES ($1, $2, $3)"
        )))
        .bind(m.version)
        .bind(m.description)
        .bind(sql_int(Timestamp::now().as_millis()))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    }
    tx.commit().await.map_err(fail)
}

/// Whether a SQLSTATE says the server is busy, going away or failing over rather than that
/// the statement is wrong.
fn transient_sqlstate(code: &str) -> bool {
    let class = |prefix: &str| code.starts_with(prefix);
    (class("08") || class("53") || class("40")) && code != "53100"
        // Shutdowns (admin, crash, cannot connect now); not 57P04, a dropped database.
        || ["57P01", "57P02", "57P03", "55P03", "57014", "25006"].contains(&code)
}

/// Classifies a database error by SQLSTATE: the server or the network failing may pass
/// (connection errors 08, shutdowns 57P01-03, out of memory or connections 53 but not a full disk,
/// serialization and deadlock 40, a lock or statement timeout 55P03 and 57014, a read-only
/// server after a failover 25006); the rest is a backend error.
pub(crate) fn error(what: &str, e: sqlx::Error) -> StoreError {
    let transient = match &e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| transient_sqlstate(&c)),
        other => sql::is_transient(other),
    };
    // The driver's text names the failure (refused, timed out, the server's message), never
    // the values bound to a statement.
    let message = format!("{what}: {e}");
    if transient {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
}

impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        match &self.batches {
            Some(batches) => batches.begin(self, req, now).await,
            None => self.begin_alone(req, now).await,
        }
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        match &self.batches {
            Some(batches) => batches.complete(self, key, lease, response, now).await,
            None => self.complete_alone(key, lease, response, now).await,
        }
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        let mut c = self.conn().await?;
        self.settle_on(&mut c, &self.sql.release, key, lease, None, now)
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        let renewed = lease.renewed(length, now);
        let ends = renewed.expires_at;
        let done = sqlx::query(self.sql.renew.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(now.as_millis()))
            .bind(&lease.id.to_bytes()[..])
            .bind(sql_int(ends.as_millis()))
            .bind(sql_int(lease.fence))
            .execute(&self.pool)
            .await
            .map_err(|e| error("cannot renew the lease", e))?;
        (done.rows_affected() == 1)
            .then_some(renewed)
            .ok_or_else(|| StaleLease.into())
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        let done = sqlx::query(self.sql.reopen.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(now.as_millis()))
            .bind(sql_int(fence))
            .execute(&self.pool)
            .await
            .map_err(|e| error("cannot reopen the record", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(self.sql.get.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(now.as_millis()))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| error("cannot read the record", e))?;
        row.map(|r| sql::raw(&r)?.into_record(key)).transpose()
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let value: Option<i64> = sqlx::query_scalar(self.sql.advance.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(idem_core::counter_step(by)?))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| error("cannot advance the counter", e))?;
        value
            .and_then(|v| u64::try_from(v).ok())
            .ok_or(StoreError::CounterExhausted)
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        let value: i64 = sqlx::query_scalar(self.sql.raise.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(to))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| error("cannot raise the counter", e))?;
        u64::try_from(value).map_err(|_| StoreError::Corrupt("a negative counter".into()))
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let done = sqlx::query(self.sql.purge.clone())
            .bind(sql_int(now.as_millis()))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(|e| error("cannot purge expired records", e))?;
        let records = done.rows_affected();
        // Lock rows unused for an hour go with the same budget.
        let rest = u64::try_from(limit)
            .unwrap_or(u64::MAX)
            .saturating_sub(records);
        if rest == 0 {
            return Ok(records);
        }
        let mut c = self.conn().await?;
        let locks = self
            .locks
            .purge(&mut c, i64::try_from(rest).unwrap_or(i64::MAX))
            .await?;
        Ok(records + locks)
    }
}

#[cfg(test)]
mod tests {
    use super::transient_sqlstate;

    #[test]
    fn sqlstates_that_may_pass_and_those_that_do_not() {
        for code in [
            "08006", "08001", "53300", "40001", "40P01", "57P01", "57P03", "55P03", "57014",
            "25006",
        ] {
            assert!(transient_sqlstate(code), "{code}");
        }
        for code in [
            "53100", "57P04", "23505", "42P01", "42501", "22003", "28P01",
        ] {
            assert!(!transient_sqlstate(code), "{code}");
        }
    }
}
