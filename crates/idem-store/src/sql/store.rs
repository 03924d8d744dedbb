//! The store on a SQL server, written once for PostgreSQL and MySQL/MariaDB: its options,
//! connecting, and the [`Store`] and [`Counters`] calls, which run the statements of
//! `records` through the hooks of the server's [`Server`] dialect.

use std::fmt;
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Counters, Key, Lease, LeaseError, Record, RecordAdmin,
    StaleLease, Step, StepError, Store, StoreError, Timestamp,
};
use sqlx::pool::{PoolConnection, PoolOptions};
use sqlx::{ConnectOptions, Connection, Pool};

use super::driver::{Arg, On};
use super::records::{OptionsOf, Server, Statements, int};
use super::{TableName, error};
use crate::group_commit::GroupCommit;

/// How a SQL store ([`PostgresStore`](crate::PostgresStore) or
/// [`MySqlStore`](crate::MySqlStore)) connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlOptions {
    /// The records table (created on first use); letters, digits and `_`, optionally
    /// schema-qualified on PostgreSQL, database-qualified on MySQL (`idem.records`). Default
    /// `idem_records`.
    pub table: String,
    /// The most connections the pool opens. Default 16.
    pub max_connections: u32,
    /// How long an operation waits for a free connection (or a new one) before failing with
    /// [`StoreError::Unavailable`]. Default 5 s.
    pub acquire_timeout: Duration,
    /// How long a statement waits for a row lock before failing with
    /// [`StoreError::Unavailable`]: PostgreSQL's `lock_timeout`, MySQL's
    /// `innodb_lock_wait_timeout` (whole seconds, at least 1). A `begin` of a key whose record
    /// a caller's open transaction holds (same-transaction mode) waits at most this long
    /// instead of holding a pooled connection without bound. It applies to every statement on
    /// the store's connections, business writes run through [`SqlStore::pool`] included.
    /// Default 5 s.
    pub lock_timeout: Duration,
    /// The most records one statement begins or completes (group commit). Calls that arrive
    /// while statements are in flight wait and then go together, up to this many per
    /// statement, on at most an eighth of the pool's connections for each kind; 1 sends every
    /// call on its own; at most 1024. Default 64.
    pub max_batch: usize,
}

impl Default for SqlOptions {
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

/// Idempotency records in a table of a SQL server: [`PostgresStore`](crate::PostgresStore)
/// (`S` is `sqlx::Postgres`) or [`MySqlStore`](crate::MySqlStore) (`sqlx::MySql`, MySQL and
/// MariaDB). Clones share one connection pool.
///
/// The pool reconnects by itself: while the server is down every operation fails with
/// [`StoreError::Unavailable`] (the work does not run), and once it is back operations succeed
/// again without a restart.
// The bound is this crate's own trait: a SQL store is one of the servers it speaks.
#[allow(private_bounds)]
pub struct SqlStore<S: Server> {
    pub(crate) pool: Pool<S>,
    pub(crate) table: TableName,
    pub(crate) sql: Statements,
    /// `None` when every call goes on its own (`max_batch` 1).
    pub(crate) batches: Option<GroupCommit>,
    /// What the server's store keeps besides (PostgreSQL its locks, MySQL its batch
    /// statements).
    pub(crate) own: S::Own,
}

impl<S: Server> Clone for SqlStore<S> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
            batches: self.batches.clone(),
            own: self.own.clone(),
        }
    }
}

impl<S: Server> fmt::Debug for SqlStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlStore")
            .field("server", &S::SERVER)
            .field("pool", &self.pool)
            .field("table", &self.table)
            .field("batches", &self.batches)
            .field("own", &self.own)
            .finish_non_exhaustive()
    }
}

#[allow(private_bounds)]
impl<S: Server> SqlStore<S> {
    /// Connects to `url` (`postgres://user@host/db`, `mysql://user:password@host/database`)
    /// with default options and applies pending migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, SqlOptions::default()).await
    }

    /// Connects with `options` and applies pending migrations.
    pub async fn connect_with(url: &str, options: SqlOptions) -> Result<Self, StoreError> {
        let connect: OptionsOf<S> = url
            .parse()
            .map_err(|e| StoreError::backend(format!("the {} URL is not valid", S::SERVER), e))?;
        let table = TableName::parse(&options.table)?;
        let connect = S::session(connect, &options);
        // One direct connection first: it reports why a server cannot be reached (the pool
        // would only say it timed out), and it applies the migrations.
        let mut first = connect
            .connect()
            .await
            .map_err(|e| error::<S>(&format!("cannot connect to {}", S::SERVER), e))?;
        S::first(&mut first, &options).await?;
        S::migrate(&mut first, &table).await?;
        let _ = first.close().await;
        let pool = PoolOptions::<S>::new()
            .max_connections(options.max_connections.max(1))
            .acquire_timeout(options.acquire_timeout);
        let pool = S::pooled(pool, &options).connect_lazy_with(connect);
        let batches = GroupCommit::new(options.max_connections, options.max_batch);
        Ok(Self {
            sql: Statements::new::<S>(&table),
            own: S::own(&table, &options, batches.is_some()),
            table,
            pool,
            batches,
        })
    }

    /// The connection pool, for running business writes next to the records.
    pub fn pool(&self) -> &Pool<S> {
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
    ///
    /// The same on MySQL or MariaDB:
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
        tx: &mut S::Connection,
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
        tx: &mut S::Connection,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        self.record_step_on(tx, key, lease, step, now).await
    }

    /// A connection of the pool.
    pub(crate) async fn conn(&self) -> Result<PoolConnection<S>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| error::<S>(&format!("no {} connection", S::SERVER), e))
    }
}

impl<S: Server> Store for SqlStore<S> {
    fn kind(&self) -> &'static str {
        S::KIND
    }

    fn admin(&self) -> Option<&dyn RecordAdmin> {
        Some(self)
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        crate::group_commit::begin(self, req, now).await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        crate::group_commit::complete(self, key, lease, response, now).await
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
        let now_ms = int(now.as_millis());
        let id = lease.id.to_bytes();
        let [scope, namespace, client_key] = Arg::key(key);
        let ends = int(renewed.expires_at.as_millis());
        let args = [
            now_ms,
            ends,
            scope,
            namespace,
            client_key,
            Arg::Bytes(&id),
            int(lease.fence),
            now_ms,
        ];
        let done = S::run(On::Pool(&self.pool), &self.sql.renew, &args)
            .await
            .map_err(|e| error::<S>("cannot renew the lease", e))?;
        (done == 1)
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
        let now_ms = int(now.as_millis());
        let [scope, namespace, client_key] = Arg::key(key);
        let args = [
            now_ms,
            now_ms,
            now_ms,
            scope,
            namespace,
            client_key,
            int(fence),
            now_ms,
        ];
        let done = S::run(On::Pool(&self.pool), &self.sql.reopen, &args)
            .await
            .map_err(|e| error::<S>("cannot reopen the record", e))?;
        Ok(done == 1)
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.read(On::Pool(&self.pool), key, now).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        if limit == 0 {
            return Ok(0);
        }
        let now_ms = int(now.as_millis());
        let most = Arg::Int(i64::try_from(limit).unwrap_or(i64::MAX));
        let records = S::run(
            On::Pool(&self.pool),
            &self.sql.purge,
            &[now_ms, now_ms, most],
        )
        .await
        .map_err(|e| error::<S>("cannot purge expired records", e))?;
        let rest = u64::try_from(limit)
            .unwrap_or(u64::MAX)
            .saturating_sub(records);
        if rest == 0 {
            return Ok(records);
        }
        Ok(records + S::purge_more(self, rest).await?)
    }
}

impl<S: Server> Counters for SqlStore<S> {
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        S::advance(self, key, idem_core::counter_step(by)?).await
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        S::raise(self, key, to).await
    }
}
