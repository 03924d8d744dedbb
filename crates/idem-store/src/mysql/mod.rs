//! Idempotency records in MySQL or MariaDB.
//!
//! Each decision is one statement InnoDB applies atomically per row. `begin` is an
//! `INSERT … ON DUPLICATE KEY UPDATE` whose assignments take the row over only when the key may
//! be acquired (expired, released, or in progress for the same request with its lease run
//! out), and report the new fence through `LAST_INSERT_ID(expr)`, which the server returns with
//! the statement's result: 0 means nothing was acquired. MySQL has no `RETURNING` for this
//! statement, and this is its documented way to hand a value computed in an upsert back to the
//! client. `complete`, `release` and `reopen` are `UPDATE`s conditioned on the lease and state.
//!
//! Purges find expired rows through an index on `purge_after` (the lease end plus the TTL, set
//! when a lease is granted or renewed), so completing a record touches no secondary index; a
//! purge deletes a row only once `expires_at` has passed too, since a late completion or a
//! reopen moves it past `purge_after`.
//!
//! Keys are `VARBINARY`, so they compare byte for byte: under the usual case-insensitive
//! collations `Order-1` and `order-1` would be one key.
//!
//! The statements on the records table, one record at a time and in batches, are in
//! `records`, the schema and its migrations in `migrate`, the operator's view (its dialect's
//! part) in `admin`, and the classification of errors by error number in `error`; what this
//! shares with PostgreSQL is in `crate::sql`.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Counters, Key, Lease, LeaseError, Record, RecordAdmin,
    StaleLease, Step, StepError, Store, StoreError, Timestamp,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Executor, MySqlConnection, MySqlPool};

use crate::batch::GroupCommit;
use crate::row::sql_int;
use crate::sql::{self, TableName};

mod admin;
mod error;
mod migrate;
mod records;

use error::error;
use records::{BatchSql, Statements, batch_sizes, keyed};

/// How a [`MySqlStore`] connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MySqlOptions {
    /// The records table (created on first use); letters, digits and `_`, optionally
    /// database-qualified (`idem.records`). Default `idem_records`.
    pub table: String,
    /// The most connections the pool opens. Default 16.
    pub max_connections: u32,
    /// How long an operation waits for a free connection (or a new one) before failing with
    /// [`StoreError::Unavailable`]. Default 5 s.
    pub acquire_timeout: Duration,
    /// How long a statement waits for a row lock (`innodb_lock_wait_timeout`, whole seconds,
    /// at least 1) before failing with [`StoreError::Unavailable`]: a `begin` of a key whose
    /// record a caller's open transaction holds waits at most this long. It applies to every
    /// statement on the store's connections. Default 5 s.
    pub lock_timeout: Duration,
    /// The most records one statement begins or completes (group commit). Calls that arrive
    /// while statements are in flight wait and then go together, up to this many per
    /// statement, on at most an eighth of the pool's connections for each kind; 1 sends every
    /// call on its own; at most 1024. Default 64.
    pub max_batch: usize,
}

impl Default for MySqlOptions {
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

/// Idempotency records in a MySQL or MariaDB table. Clones share one connection pool, which
/// reconnects by itself after an outage.
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    table: TableName,
    sql: Statements,
    /// `None` when every call goes on its own (`max_batch` 1).
    batches: Option<GroupCommit>,
    /// The statements for batches of `2^(i+1)` rows (a batch is padded up to the next size,
    /// so each connection prepares a handful of statements, not one per size).
    batch_sql: Arc<[BatchSql]>,
}

impl MySqlStore {
    /// Connects to `url` (`mysql://user:password@host/database`) with default options and
    /// applies pending migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, MySqlOptions::default()).await
    }

    /// Connects with `options` and applies pending migrations.
    pub async fn connect_with(url: &str, options: MySqlOptions) -> Result<Self, StoreError> {
        let connect: MySqlConnectOptions = url
            .parse()
            .map_err(|e| StoreError::backend("the MySQL URL is not valid", e))?;
        let table = TableName::parse(&options.table)?;
        // One direct connection first: it reports why a server cannot be reached (the pool
        // would only say it timed out), and it applies the migrations.
        let mut first = connect
            .connect()
            .await
            .map_err(|e| error("cannot connect to MySQL", e))?;
        let session = Arc::new(session_settings(&options));
        first
            .execute(AssertSqlSafe(session.as_str().to_owned()))
            .await
            .map_err(|e| error("cannot set up the MySQL session", e))?;
        migrate::migrate(&mut first, &table).await?;
        let _ = first.close().await;
        let pool = MySqlPoolOptions::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout)
            .after_connect(move |c, _| {
                let session = session.clone();
                Box::pin(async move {
                    c.execute(AssertSqlSafe(session.as_str().to_owned()))
                        .await?;
                    Ok(())
                })
            })
            .connect_lazy_with(connect);
        let batches = GroupCommit::new(options.max_connections, options.max_batch);
        let batch_sql = match &batches {
            Some(_) => batch_sizes(options.max_batch.min(crate::batch::MAX_JOBS))
                .map(|rows| BatchSql::new(&table, rows))
                .collect(),
            None => Arc::from(Vec::new()),
        };
        Ok(Self {
            sql: Statements::new(&table),
            table,
            pool,
            batches,
            batch_sql,
        })
    }

    /// The connection pool, for running business writes next to the records.
    pub fn pool(&self) -> &MySqlPool {
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
    /// # async fn demo(store: &idem_store::MySqlStore, key: &idem_core::Key, lease: &idem_core::Lease)
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
        tx: &mut MySqlConnection,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.settle_on(tx, key, lease, Some(response), now).await
    }

    /// Records a step inside the caller's transaction, as [`Self::complete_in`] completes: the
    /// step's own writes and its recovery point commit together, or neither does. If this
    /// returns an error, roll back ([`StepError::Refused`] with a stale lease means another
    /// attempt took the key over).
    pub async fn record_step_in(
        &self,
        tx: &mut MySqlConnection,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        self.record_step_on(tx, key, lease, step, now).await
    }

    async fn conn(&self) -> Result<sqlx::pool::PoolConnection<sqlx::MySql>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| error("no MySQL connection", e))
    }
}

/// What every connection sets first: the lock wait bound, and an `UPDATE`'s assignments
/// applied left to right, each seeing the ones before (`renew` computes `expires_at` from the
/// new lease end, and `purge_after` from that). MariaDB's `SIMULTANEOUS_ASSIGNMENT` mode, if a
/// server sets it, would evaluate them all against the old row; a test shows it turned off.
fn session_settings(options: &MySqlOptions) -> String {
    let wait = options.lock_timeout.as_secs().max(1);
    format!(
        "SET SESSION innodb_lock_wait_timeout = {wait}, \
         sql_mode = REPLACE(@@SESSION.sql_mode, 'SIMULTANEOUS_ASSIGNMENT', '')"
    )
}

impl Store for MySqlStore {
    fn kind(&self) -> &'static str {
        "mysql"
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
        self.settle_on(&mut c, key, lease, None, now).await
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
        let now_ms = sql_int(now.as_millis());
        // MySQL applies the assignments left to right: `expires_at` sees the new lease end,
        // and `purge_after` the new `expires_at`.
        let q = sqlx::query(self.sql.renew.clone())
            .bind(now_ms)
            .bind(sql_int(ends.as_millis()));
        let done = keyed(q, key)
            .bind(&lease.id.to_bytes()[..])
            .bind(sql_int(lease.fence))
            .bind(now_ms)
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
        let now_ms = sql_int(now.as_millis());
        let q = sqlx::query(self.sql.reopen.clone())
            .bind(now_ms)
            .bind(now_ms)
            .bind(now_ms);
        let done = keyed(q, key)
            .bind(sql_int(fence))
            .bind(now_ms)
            .execute(&self.pool)
            .await
            .map_err(|e| error("cannot reopen the record", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let row = keyed(sqlx::query(self.sql.get.clone()), key)
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
            .bind(sql_int(now.as_millis()))
            .bind(u64::try_from(limit).unwrap_or(u64::MAX))
            .execute(&self.pool)
            .await
            .map_err(|e| error("cannot purge expired records", e))?;
        Ok(done.rows_affected())
    }
}

impl Counters for MySqlStore {
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let done = keyed(sqlx::query(self.sql.advance.clone()), key)
            .bind(sql_int(idem_core::counter_step(by)?))
            .execute(&self.pool)
            .await
            .map_err(|e| {
                let exhausted = matches!(&e, sqlx::Error::Database(db)
                    if db.try_downcast_ref::<MySqlDatabaseError>().is_some_and(|m| m.number() == 1690));
                if exhausted {
                    StoreError::CounterExhausted
                } else {
                    error("cannot advance the counter", e)
                }
            })?;
        Ok(done.last_insert_id())
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        let done = keyed(sqlx::query(self.sql.raise.clone()), key)
            .bind(sql_int(to))
            .execute(&self.pool)
            .await
            .map_err(|e| error("cannot raise the counter", e))?;
        Ok(done.last_insert_id())
    }
}

impl sql::Dialect for sqlx::MySql {
    const SERVER: &'static str = "MySQL";
    const MIGRATIONS: &'static [sql::Migration] = migrate::MIGRATIONS;
    const TABLE_OPTIONS: &'static str = "ENGINE = InnoDB";
    const THREE_VALUES: &'static str = "VALUES (?, ?, ?)";
    const BINARY_KEYS: bool = true;
    // MariaDB reads the whole index up to the bound for `(a, b) > (?, ?)`.
    const ROW_COMPARISON: bool = false;
    const BIGINT: &'static str = "SIGNED";

    fn placeholder(_: usize) -> String {
        "?".to_owned()
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn transient(e: &dyn sqlx::error::DatabaseError) -> bool {
        error::transient(e)
    }
}
