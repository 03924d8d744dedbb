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
//!
//! The statements on the records table and their batched forms are in `records`, the schema
//! and its migrations in `migrate`, the lease locks in `locks`, the operator's view (its
//! dialect's part) in `admin`, and the classification of errors by SQLSTATE in `error`; what
//! this shares with MySQL is in `crate::sql`.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Counters, Key, Lease, LeaseError, Record, RecordAdmin,
    StaleLease, Step, StepError, Store, StoreError, Timestamp,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use crate::batch::GroupCommit;
use crate::row::sql_int;
use crate::sql::{self, TableName};

mod admin;
mod error;
mod locks;
mod migrate;
mod records;

pub(crate) use error::error;
use records::Statements;

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
    table: TableName,
    sql: Statements,
    locks: locks::PgLocks,
    /// `None` when every call goes on its own (`max_batch` 1).
    batches: Option<GroupCommit>,
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
        migrate::migrate(&mut first, &table).await?;
        let _ = first.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .connect_lazy_with(connect);
        Ok(Self {
            sql: Statements::new(&table),
            locks: locks::PgLocks::new(&table),
            table,
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

    /// Records a step inside the caller's transaction, as [`Self::complete_in`] completes: the
    /// step's own writes and its recovery point commit together, or neither does. If this
    /// returns an error, roll back ([`StepError::Refused`] with a stale lease means another
    /// attempt took the key over).
    pub async fn record_step_in(
        &self,
        tx: &mut PgConnection,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        self.record_step_on(tx, key, lease, step, now).await
    }

    pub(crate) fn locks(&self) -> &locks::PgLocks {
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
}

impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn admin(&self) -> Option<&dyn RecordAdmin> {
        Some(self)
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        crate::batch::begin(self, req, now).await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        crate::batch::complete(self, key, lease, response, now).await
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

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        let mut c = self.conn().await?;
        self.record_step_on(&mut c, key, lease, step, now).await
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

impl Counters for PostgresStore {
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
}

impl sql::Dialect for sqlx::Postgres {
    const SERVER: &'static str = "PostgreSQL";
    const MIGRATIONS: &'static [sql::Migration] = migrate::MIGRATIONS;
    const TABLE_OPTIONS: &'static str = "";
    const THREE_VALUES: &'static str = "VALUES ($1, $2, $3)";
    const BINARY_KEYS: bool = false;
    const ROW_COMPARISON: bool = true;
    const BIGINT: &'static str = "BIGINT";

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn transient(e: &dyn sqlx::error::DatabaseError) -> bool {
        e.code().is_some_and(|c| error::transient_sqlstate(&c))
    }
}
