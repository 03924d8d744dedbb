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

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, LeaseId, Record, StaleLease, Store,
    StoreError, Timestamp,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPoolOptions};
use sqlx::{
    AssertSqlSafe, ConnectOptions, Connection, Executor, MySqlConnection, MySqlPool, SqlSafeStr,
    SqlStr,
};

use crate::batch::{BeginJob, CompleteJob, GroupCommit, ManyAtOnce};
use crate::row::sql_int;
use crate::sql::{self, Migration, TableName};

/// The schema, one migration per version; applied in order, each once.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "records table and purge index",
        statements: &["CREATE TABLE IF NOT EXISTS {table} (
        scope            VARBINARY(255) NOT NULL,
        namespace        VARBINARY(255) NOT NULL,
        client_key       VARBINARY(255) NOT NULL,
        fingerprint      BINARY(32)     NOT NULL,
        status           VARCHAR(16) CHARACTER SET ascii NOT NULL,
        fence            BIGINT         NOT NULL,
        lease_id         BINARY(16)     NOT NULL,
        lease_expires_at BIGINT         NOT NULL,
        response         LONGBLOB       NULL,
        ttl_ms           BIGINT         NOT NULL,
        created_at       BIGINT         NOT NULL,
        updated_at       BIGINT         NOT NULL,
        expires_at       BIGINT         NOT NULL,
        purge_after      BIGINT         NOT NULL,
        PRIMARY KEY (scope, namespace, client_key),
        KEY purge_after (purge_after)
    ) ENGINE = InnoDB"],
    },
    Migration {
        version: 2,
        description: "counters",
        statements: &["CREATE TABLE IF NOT EXISTS {table}_counters (
        scope      VARBINARY(255) NOT NULL,
        namespace  VARBINARY(255) NOT NULL,
        client_key VARBINARY(255) NOT NULL,
        value      BIGINT         NOT NULL,
        PRIMARY KEY (scope, namespace, client_key)
    ) ENGINE = InnoDB"],
    },
];

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
    sql: Statements,
    /// `None` when every call goes on its own (`max_batch` 1).
    batches: Option<GroupCommit>,
    /// The statements for batches of `2^(i+1)` rows (a batch is padded up to the next size,
    /// so each connection prepares a handful of statements, not one per size).
    batch_sql: Arc<[BatchSql]>,
}

/// The statements for batches of one size.
#[derive(Debug)]
struct BatchSql {
    rows: usize,
    begin: SqlStr,
    acquired: SqlStr,
    complete: SqlStr,
}

#[derive(Clone, Debug)]
struct Statements {
    begin: SqlStr,
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

/// The rest of a row `begin` took over: set once `lease_id` holds the new lease's id (the
/// assignments before decide that), each column taking the new value.
const TAKEN_OVER: &str =
    "fingerprint = IF(lease_id = VALUES(lease_id), VALUES(fingerprint), fingerprint),
    status = IF(lease_id = VALUES(lease_id), 'in_progress', status),
    lease_expires_at = IF(lease_id = VALUES(lease_id), VALUES(lease_expires_at), lease_expires_at),
    response = IF(lease_id = VALUES(lease_id), NULL, response),
    ttl_ms = IF(lease_id = VALUES(lease_id), VALUES(ttl_ms), ttl_ms),
    created_at = IF(lease_id = VALUES(lease_id), VALUES(created_at), created_at),
    updated_at = IF(lease_id = VALUES(lease_id), VALUES(updated_at), updated_at),
    expires_at = IF(lease_id = VALUES(lease_id), VALUES(expires_at), expires_at),
    purge_after = IF(lease_id = VALUES(lease_id), VALUES(purge_after), purge_after)";

/// `expires_at` for a record settled at `?` (bound twice): `now + ttl_ms`, capped.
const SETTLED_EXPIRY: &str = "LEAST(ttl_ms, 9223372036854775807 - ?) + ?";

impl Statements {
    fn new(t: &TableName) -> Self {
        let s = |sql: String| AssertSqlSafe(sql).into_sql_str();
        let key = "scope = ? AND namespace = ? AND client_key = ?";
        // Set first, to our new lease id only if the key may be acquired; every later
        // assignment checks it, so they all see one decision (MySQL applies the assignments
        // left to right, each seeing the ones before).
        let ours = "lease_id = VALUES(lease_id)";
        Self {
            begin: s(format!(
                "INSERT INTO {t} (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 VALUES (?, ?, ?, ?, 'in_progress', LAST_INSERT_ID(1), ?, ?, NULL, ?, ?, ?, ?,
                     ?)
                 ON DUPLICATE KEY UPDATE
                     lease_id = IF(expires_at <= ? OR status = 'released'
                         OR (status = 'in_progress' AND fingerprint = VALUES(fingerprint)
                             AND lease_expires_at <= ?),
                         VALUES(lease_id), lease_id),
                     fence = IF({ours}, LAST_INSERT_ID(fence + 1), fence + LAST_INSERT_ID(0)),
                     {TAKEN_OVER}"
            )),
            // A locking read: inside a caller's transaction (same-transaction mode) a plain
            // read would see the transaction's old snapshot, not the row the update just saw.
            load: s(format!(
                "SELECT {COLUMNS} FROM {t} WHERE {key} LOCK IN SHARE MODE"
            )),
            complete: s(format!(
                "UPDATE {t} SET status = 'completed', response = ?, updated_at = ?,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {key} AND lease_id = ? AND fence = ? AND status = 'in_progress'
                   AND expires_at > ?"
            )),
            release: s(format!(
                "UPDATE {t} SET status = 'released', response = NULL, updated_at = ?,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {key} AND lease_id = ? AND fence = ? AND status = 'in_progress'
                   AND expires_at > ?"
            )),
            renew: s(format!(
                "UPDATE {t} SET updated_at = ?, lease_expires_at = ?,
                     expires_at = LEAST(ttl_ms, 9223372036854775807 - lease_expires_at)
                         + lease_expires_at,
                     purge_after = GREATEST(purge_after, expires_at)
                 WHERE {key} AND lease_id = ? AND fence = ? AND status = 'in_progress'
                   AND expires_at > ?"
            )),
            reopen: s(format!(
                "UPDATE {t} SET status = 'released', response = NULL, updated_at = ?,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {key} AND fence = ? AND status = 'completed' AND expires_at > ?"
            )),
            get: s(format!(
                "SELECT {COLUMNS} FROM {t} WHERE {key} AND expires_at > ?"
            )),
            // The new value comes back through LAST_INSERT_ID(expr), as in `begin`; a sum
            // past i64::MAX fails with an out-of-range error (1690).
            advance: s(format!(
                "INSERT INTO {t}_counters (scope, namespace, client_key, value)
                 VALUES (?, ?, ?, LAST_INSERT_ID(?))
                 ON DUPLICATE KEY UPDATE value = LAST_INSERT_ID(value + VALUES(value))"
            )),
            raise: s(format!(
                "INSERT INTO {t}_counters (scope, namespace, client_key, value)
                 VALUES (?, ?, ?, LAST_INSERT_ID(?))
                 ON DUPLICATE KEY UPDATE
                     value = LAST_INSERT_ID(GREATEST(value, VALUES(value)))"
            )),
            purge: s(format!(
                "DELETE FROM {t} WHERE purge_after <= ? AND expires_at <= ?
                 ORDER BY purge_after LIMIT ?"
            )),
        }
    }
}

type Query<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

/// Binds a record's key (the three `?` of `scope = ? AND namespace = ? AND client_key = ?`).
fn keyed<'q>(q: Query<'q>, key: &'q Key) -> Query<'q> {
    q.bind(key.scope().as_str().as_bytes())
        .bind(key.namespace().as_str().as_bytes())
        .bind(key.client_key().as_str().as_bytes())
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
        migrate(&mut first, &table).await?;
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

    async fn conn(&self) -> Result<sqlx::pool::PoolConnection<sqlx::MySql>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| error("no MySQL connection", e))
    }

    async fn load(&self, c: &mut MySqlConnection, key: &Key) -> Result<Option<Record>, StoreError> {
        let row = keyed(sqlx::query(self.sql.load.clone()), key)
            .fetch_optional(c)
            .await
            .map_err(|e| error("cannot read the record", e))?;
        row.map(|r| sql::raw(&r)?.into_record(key)).transpose()
    }

    /// `begin` on one connection (of the pool, or a caller's transaction).
    async fn begin_on(
        &self,
        c: &mut MySqlConnection,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let (lease, fresh) = Record::acquired(req, now, 1, idem_core::LeaseId::generate());
        let now_ms = sql_int(now.as_millis());
        for _ in 0..8 {
            let done = keyed(sqlx::query(self.sql.begin.clone()), &req.key)
                .bind(&fresh.fingerprint.as_bytes()[..])
                .bind(&lease.id.to_bytes()[..])
                .bind(sql_int(lease.expires_at.as_millis()))
                .bind(sql_int(fresh.ttl_ms))
                .bind(now_ms)
                .bind(now_ms)
                .bind(sql_int(fresh.expires_at.as_millis()))
                .bind(sql_int(fresh.expires_at.as_millis()))
                .bind(now_ms)
                .bind(now_ms)
                .execute(&mut *c)
                .await
                .map_err(|e| error("cannot begin the record", e))?;
            let fence = done.last_insert_id();
            if fence > 0 {
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
        c: &mut MySqlConnection,
        key: &Key,
        lease: &Lease,
        response: Option<Bytes>,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let now_ms = sql_int(now.as_millis());
        let q = match &response {
            Some(r) => sqlx::query(self.sql.complete.clone()).bind(&r[..]),
            None => sqlx::query(self.sql.release.clone()),
        };
        let q = q.bind(now_ms).bind(now_ms).bind(now_ms);
        let done = keyed(q, key)
            .bind(&lease.id.to_bytes()[..])
            .bind(sql_int(lease.fence))
            .bind(now_ms)
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

/// The batch sizes for batches of up to `max` rows: 2, 4, 8, … up to the first at least `max`.
fn batch_sizes(max: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(2usize), move |n| {
        (*n < max).then(|| n.saturating_mul(2))
    })
}

impl BatchSql {
    fn new(t: &TableName, rows: usize) -> Self {
        let s = |sql: String| AssertSqlSafe(sql).into_sql_str();
        let list = |one: &str, sep: &str| vec![one; rows].join(sep);
        let ours = "lease_id = VALUES(lease_id)";
        Self {
            rows,
            // `begin` for many rows: the same decision as `begin` per row, `now` being each
            // row's `created_at`. Rows go in key order, so two batches lock shared keys in the
            // same order. What was acquired is read back by lease id (`acquired`): a row holds
            // our lease id only if this statement gave it.
            begin: s(format!(
                "INSERT INTO {t} (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 VALUES {}
                 ON DUPLICATE KEY UPDATE
                     lease_id = IF(expires_at <= VALUES(created_at) OR status = 'released'
                         OR (status = 'in_progress' AND fingerprint = VALUES(fingerprint)
                             AND lease_expires_at <= VALUES(created_at)),
                         VALUES(lease_id), lease_id),
                     fence = IF({ours}, fence + 1, fence),
                     {TAKEN_OVER}",
                list(
                    "(?, ?, ?, ?, 'in_progress', 1, ?, ?, NULL, ?, ?, ?, ?, ?)",
                    ", "
                )
            )),
            acquired: s(format!(
                "SELECT lease_id, fence FROM {t} WHERE (scope, namespace, client_key) IN ({})",
                list("(?, ?, ?)", ", ")
            )),
            // `complete` for many rows: the rows are found by key, lease and fence, and each
            // row's values picked by its lease id (unique to the batch, as its keys are).
            complete: s(format!(
                "UPDATE {t} SET status = 'completed',
                     response = CASE lease_id {}
                     END,
                     updated_at = CASE lease_id {}
                     END,
                     expires_at = LEAST(ttl_ms, 9223372036854775807 - updated_at) + updated_at
                 WHERE (scope, namespace, client_key, lease_id, fence) IN ({})
                   AND status = 'in_progress' AND expires_at > CASE lease_id {} END",
                list("WHEN ? THEN ?", " "),
                list("WHEN ? THEN ?", " "),
                list("(?, ?, ?, ?, ?)", ", "),
                list("WHEN ? THEN ?", " "),
            )),
        }
    }
}

impl MySqlStore {
    /// The statements for a batch of `n` rows, and how many rows they take.
    fn sized(&self, n: usize) -> Option<&BatchSql> {
        self.batch_sql.iter().find(|s| s.rows >= n)
    }
}

impl ManyAtOnce for MySqlStore {
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
        self.settle_on(&mut c, key, lease, Some(response), now)
            .await
    }

    /// One multi-row upsert, in key order (the primary key compares bytes) so that batches
    /// lock rows in one order, then one read of which rows hold our lease ids.
    async fn begin_many(
        &self,
        jobs: &[BeginJob],
        fresh: &[(Lease, Record)],
    ) -> Result<Option<Vec<crate::batch::Acquired>>, StoreError> {
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|a, b| jobs[*a].req.key.cmp(&jobs[*b].req.key));
        let (Some(sized), Some(&last)) = (self.sized(jobs.len()), order.last()) else {
            return Ok(None);
        };
        // Padded with the last row again, under a lease id no lease has (zero): its second
        // upsert finds the fresh lease the first gave, which may not be taken over, and since
        // the ids differ it changes nothing. (Under its own id it would pass for the holder
        // and raise the fence.)
        let padding = sized.rows - order.len();
        let rows = || {
            order
                .iter()
                .copied()
                .chain(std::iter::repeat_n(last, padding))
        };
        let mut q = sqlx::query(sized.begin.clone());
        for (n, i) in rows().enumerate() {
            let (lease, record) = &fresh[i];
            let id = if n < order.len() {
                lease.id.to_bytes()
            } else {
                [0; 16]
            };
            let now = sql_int(jobs[i].now.as_millis());
            q = keyed(q, &jobs[i].req.key)
                .bind(&record.fingerprint.as_bytes()[..])
                .bind(&id[..])
                .bind(sql_int(lease.expires_at.as_millis()))
                .bind(sql_int(record.ttl_ms))
                .bind(now)
                .bind(now)
                .bind(sql_int(record.expires_at.as_millis()))
                .bind(sql_int(record.expires_at.as_millis()));
        }
        let mut c = self.conn().await?;
        if q.execute(&mut *c).await.is_err() {
            return Ok(None);
        }
        let mut read = sqlx::query(sized.acquired.clone());
        for i in rows() {
            read = keyed(read, &jobs[i].req.key);
        }
        let Ok(rows) = read.fetch_all(&mut *c).await else {
            return Ok(None);
        };
        Ok(rows
            .iter()
            .map(|r| {
                Some((
                    sqlx::Row::try_get(r, 0).ok()?,
                    sqlx::Row::try_get(r, 1).ok()?,
                ))
            })
            .collect())
    }

    /// One statement; MySQL reports only how many rows it changed, so only when that is every
    /// job is each known to be done.
    async fn complete_many(&self, jobs: &[CompleteJob]) -> Result<Option<Vec<bool>>, StoreError> {
        let (Some(sized), Some(last)) = (self.sized(jobs.len()), jobs.last()) else {
            return Ok(None);
        };
        // Padded with a row that matches none: the last key under lease id zero and fence 0
        // (fences start at 1), with an empty response, so padding adds no bytes.
        let pad = CompleteJob {
            key: last.key.clone(),
            lease: Lease {
                id: LeaseId::from_bytes([0; 16]),
                fence: 0,
                ..last.lease
            },
            response: Bytes::new(),
            now: last.now,
        };
        let rows = || jobs.iter().chain(std::iter::repeat(&pad)).take(sized.rows);
        let mut q = sqlx::query(sized.complete.clone());
        for job in rows() {
            q = q.bind(&job.lease.id.to_bytes()[..]).bind(&job.response[..]);
        }
        for job in rows() {
            q = q
                .bind(&job.lease.id.to_bytes()[..])
                .bind(sql_int(job.now.as_millis()));
        }
        for job in rows() {
            q = keyed(q, &job.key)
                .bind(&job.lease.id.to_bytes()[..])
                .bind(sql_int(job.lease.fence));
        }
        for job in rows() {
            q = q
                .bind(&job.lease.id.to_bytes()[..])
                .bind(sql_int(job.now.as_millis()));
        }
        let mut c = self.conn().await?;
        let Ok(done) = q.execute(&mut *c).await else {
            return Ok(None);
        };
        let all = u64::try_from(jobs.len()).is_ok_and(|n| done.rows_affected() == n);
        Ok(Some(vec![all; jobs.len()]))
    }
}

/// Whether every migration is applied (false if that cannot be read).
async fn current(c: &mut MySqlConnection, table: &TableName) -> bool {
    let applied: Result<Vec<i64>, _> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {}",
        table.migrations_table()
    )))
    .fetch_all(&mut *c)
    .await;
    applied.is_ok_and(|a| sql::pending(MIGRATIONS, &a).is_ok_and(|p| p.is_empty()))
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

/// Applies pending migrations while holding a named lock, so that processes starting together
/// apply each migration once. (MySQL commits DDL at once, so each step is also written to be
/// safe to repeat.)
async fn migrate(c: &mut MySqlConnection, table: &TableName) -> Result<(), StoreError> {
    // Up to date already: nothing to lock or create, so a service may run as a user without
    // the right to change the schema (after `idem migrate` ran as one with it).
    if current(c, table).await {
        return Ok(());
    }
    let fail = |e| error("cannot apply the MySQL schema", e);
    // MySQL takes lock names of at most 64 characters: a digest of the table's name.
    let lock = format!(
        "idem:{}",
        &idem_core::Fingerprint::of_bytes(table.to_string().as_bytes()).to_hex()[..32]
    );
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
        .bind(&lock)
        .fetch_one(&mut *c)
        .await
        .map_err(fail)?;
    if locked != Some(1) {
        return Err(StoreError::Unavailable {
            message: "another process held the migration lock for a minute".into(),
            source: None,
        });
    }
    let result = apply(c, table).await;
    let released = sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut *c)
        .await;
    result?;
    released.map(drop).map_err(fail)
}

async fn apply(c: &mut MySqlConnection, table: &TableName) -> Result<(), StoreError> {
    let fail = |e| error("cannot apply the MySQL schema", e);
    let versions = table.migrations_table();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {versions} (
             version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at BIGINT NOT NULL)
         ENGINE = InnoDB"
    )))
    .execute(&mut *c)
    .await
    .map_err(fail)?;
    let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {versions} ORDER BY version"
    )))
    .fetch_all(&mut *c)
    .await
    .map_err(fail)?;
    for m in sql::pending(MIGRATIONS, &applied)? {
        for statement in m.statements {
            sqlx::query(AssertSqlSafe(table.fill(statement)))
                .execute(&mut *c)
                .await
                .map_err(fail)?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {versions} (version, description, applied_at) VALUES (?, ?, ?)"
        )))
        .bind(m.version)
        .bind(m.description)
        .bind(sql_int(Timestamp::now().as_millis()))
        .execute(&mut *c)
        .await
        .map_err(fail)?;
    }
    Ok(())
}

/// MySQL error numbers that mean the server is busy, shutting down or failing over, not that
/// the statement is wrong: too many connections (1040), shutdown in progress (1053), lock wait
/// timeout (1205), deadlock (1213), read-only (1290, 1836), connection killed (1927). A lost
/// connection is an I/O error, classified as such.
const TRANSIENT: &[u16] = &[1040, 1053, 1205, 1213, 1290, 1836, 1927];

/// Classifies a database error by its error number, never by its message.
fn error(what: &str, e: sqlx::Error) -> StoreError {
    let transient = match &e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|m| TRANSIENT.contains(&m.number())),
        other => sql::is_transient(other),
    };
    // The driver's text names the failure, never the values bound to a statement.
    let message = format!("{what}: {e}");
    if transient {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
}

impl Store for MySqlStore {
    fn kind(&self) -> &'static str {
        "mysql"
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
