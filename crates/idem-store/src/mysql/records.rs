//! MySQL's hooks on the records path: the statements it spells its own way (`begin` an upsert
//! that hands the fence back through `LAST_INSERT_ID(expr)`, the purge, the counters), the
//! batched forms (group commit: one multi-row statement per batch size, a batch padded up to
//! the next, and what it did read back in its transaction), and the session settings of its
//! connections.

use std::sync::Arc;

use idem_core::{Bytes, Key, Lease, LeaseId, Record, StoreError, Timestamp};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, Connection, Executor, MySql, MySqlConnection, SqlSafeStr, SqlStr};

use super::{MySqlStore, Own, error, migrate, session_settings};
use crate::group_commit::{Acquired, BeginJob, CompleteJob, Fresh, Many};
use crate::row::sql_int;
use crate::sql::{self, COLUMNS, Spelling, SqlOptions, TableName};

/// The statements for batches of one size.
#[derive(Debug)]
pub(super) struct BatchSql {
    rows: usize,
    begin: SqlStr,
    acquired: SqlStr,
    complete: SqlStr,
    completed: SqlStr,
}

/// The rest of a row `begin` took over: set once `lease_id` holds the new lease's id (the
/// assignments before decide that), each column taking the new value. The steps go first,
/// while `expires_at` is still the old row's: an expired row's are dropped, a live one's stay
/// for the new attempt to resume.
const TAKEN_OVER: &str =
    "steps = IF(lease_id = VALUES(lease_id) AND expires_at <= VALUES(created_at), NULL, steps),
    fingerprint = IF(lease_id = VALUES(lease_id), VALUES(fingerprint), fingerprint),
    status = IF(lease_id = VALUES(lease_id), 'in_progress', status),
    lease_expires_at = IF(lease_id = VALUES(lease_id), VALUES(lease_expires_at), lease_expires_at),
    response = IF(lease_id = VALUES(lease_id), NULL, response),
    ttl_ms = IF(lease_id = VALUES(lease_id), VALUES(ttl_ms), ttl_ms),
    created_at = IF(lease_id = VALUES(lease_id), VALUES(created_at), created_at),
    updated_at = IF(lease_id = VALUES(lease_id), VALUES(updated_at), updated_at),
    expires_at = IF(lease_id = VALUES(lease_id), VALUES(expires_at), expires_at),
    purge_after = IF(lease_id = VALUES(lease_id), VALUES(purge_after), purge_after)";

/// The fence of a takeover: `Lease::next_fence` of the row's.
const NEXT_FENCE: &str = "fence + IF((fence + 1) % 1000 = 0, 2, 1)";

/// The statements MySQL spells its own way.
fn spelling(t: &TableName) -> Spelling {
    let key = "scope = ? AND namespace = ? AND client_key = ?";
    // Set first, to our new lease id only if the key may be acquired; every later assignment
    // checks it, so they all see one decision (MySQL applies the assignments left to right,
    // each seeing the ones before).
    let ours = "lease_id = VALUES(lease_id)";
    Spelling {
        begin: format!(
            "INSERT INTO {t} (scope, namespace, client_key, fingerprint, status, fence,
                 lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                 expires_at, purge_after)
             VALUES (?, ?, ?, ?, 'in_progress', LAST_INSERT_ID(?), ?, ?, NULL, ?, ?, ?, ?,
                 ?)
             ON DUPLICATE KEY UPDATE
                 lease_id = IF(expires_at <= ? OR (status = 'released'
                         AND (steps IS NULL OR fingerprint = VALUES(fingerprint)))
                     OR (status = 'in_progress' AND fingerprint = VALUES(fingerprint)
                         AND lease_expires_at <= ?),
                     VALUES(lease_id), lease_id),
                 fence = IF({ours}, LAST_INSERT_ID({NEXT_FENCE}), fence + LAST_INSERT_ID(0)),
                 {TAKEN_OVER}"
        ),
        // MySQL applies the assignments left to right: `expires_at` sees the new lease end, and
        // `purge_after` the new `expires_at`.
        renew: format!(
            "UPDATE {t} SET updated_at = ?, lease_expires_at = ?,
                 expires_at = LEAST(ttl_ms, 9223372036854775807 - lease_expires_at)
                     + lease_expires_at,
                 purge_after = GREATEST(purge_after, expires_at)
             WHERE {key} AND lease_id = ? AND fence = ? AND status = 'in_progress'
               AND expires_at > ?"
        ),
        purge: format!(
            "DELETE FROM {t} WHERE purge_after <= ? AND expires_at <= ?
             ORDER BY purge_after LIMIT ?"
        ),
        // The new value comes back through LAST_INSERT_ID(expr), as in `begin`; a sum
        // past i64::MAX fails with an out-of-range error (1690).
        advance: format!(
            "INSERT INTO {t}_counters (scope, namespace, client_key, value)
             VALUES (?, ?, ?, LAST_INSERT_ID(?))
             ON DUPLICATE KEY UPDATE value = LAST_INSERT_ID(value + VALUES(value))"
        ),
        raise: format!(
            "INSERT INTO {t}_counters (scope, namespace, client_key, value)
             VALUES (?, ?, ?, LAST_INSERT_ID(?))
             ON DUPLICATE KEY UPDATE
                 value = LAST_INSERT_ID(GREATEST(value, VALUES(value)))"
        ),
    }
}

type Query<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

/// Binds a record's key (the three `?` of `scope = ? AND namespace = ? AND client_key = ?`).
fn keyed<'q>(q: Query<'q>, key: &'q Key) -> Query<'q> {
    q.bind(key.scope().as_str().as_bytes())
        .bind(key.namespace().as_str().as_bytes())
        .bind(key.client_key().as_str().as_bytes())
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
            // same order. What was acquired is read back by lease id (`acquired`), in the same
            // transaction: a row holds our lease id only if this statement gave it.
            begin: s(format!(
                "INSERT INTO {t} (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 VALUES {}
                 ON DUPLICATE KEY UPDATE
                     lease_id = IF(expires_at <= VALUES(created_at) OR (status = 'released'
                             AND (steps IS NULL OR fingerprint = VALUES(fingerprint)))
                         OR (status = 'in_progress' AND fingerprint = VALUES(fingerprint)
                             AND lease_expires_at <= VALUES(created_at)),
                         VALUES(lease_id), lease_id),
                     fence = IF({ours}, {NEXT_FENCE}, fence),
                     {TAKEN_OVER}",
                list(
                    "(?, ?, ?, ?, 'in_progress', ?, ?, ?, NULL, ?, ?, ?, ?, ?)",
                    ", "
                )
            )),
            // Run in the upsert's transaction, which holds every row of the batch locked
            // (inserted or found): a locking read sees each row as the upsert left it.
            acquired: s(format!(
                "SELECT lease_id, fence FROM {t} WHERE (scope, namespace, client_key) IN ({})
                 FOR UPDATE",
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
            // The rows of a `complete` that did not change every row, read in its transaction
            // as it left them (key last: `sql::raw` reads the columns from the first).
            completed: s(format!(
                "SELECT {COLUMNS}, scope, namespace, client_key FROM {t}
                 WHERE (scope, namespace, client_key) IN ({}) FOR UPDATE",
                list("(?, ?, ?)", ", ")
            )),
        }
    }
}

/// The statements for a batch of `n` rows, and how many rows they take.
fn sized(store: &MySqlStore, n: usize) -> Option<&BatchSql> {
    store.own.batch_sql.iter().find(|s| s.rows >= n)
}

impl sql::Server for MySql {
    const KIND: &'static str = "mysql";
    // A locking read: inside a caller's transaction (same-transaction mode) a plain read would
    // see the transaction's old snapshot, not the row the update just saw.
    const LOCKING_READ: &'static str = " LOCK IN SHARE MODE";
    type Own = Own;

    fn spelling(t: &TableName) -> Spelling {
        spelling(t)
    }

    fn session(connect: MySqlConnectOptions, _: &SqlOptions) -> MySqlConnectOptions {
        connect
    }

    async fn first(c: &mut MySqlConnection, options: &SqlOptions) -> Result<(), StoreError> {
        c.execute(AssertSqlSafe(session_settings(options)))
            .await
            .map_err(|e| error("cannot set up the MySQL session", e))?;
        Ok(())
    }

    fn pooled(pool: PoolOptions<Self>, options: &SqlOptions) -> PoolOptions<Self> {
        let session = Arc::new(session_settings(options));
        pool.after_connect(move |c, _| {
            let session = session.clone();
            Box::pin(async move {
                c.execute(AssertSqlSafe(session.as_str().to_owned()))
                    .await?;
                Ok(())
            })
        })
    }

    async fn migrate(c: &mut MySqlConnection, table: &TableName) -> Result<(), StoreError> {
        migrate::migrate(c, table).await
    }

    fn own(table: &TableName, options: &SqlOptions, batching: bool) -> Own {
        let batch_sql = if batching {
            batch_sizes(options.max_batch.min(crate::group_commit::MAX_JOBS))
                .map(|rows| BatchSql::new(table, rows))
                .collect()
        } else {
            Arc::from(Vec::new())
        };
        Own { batch_sql }
    }

    /// The fence comes back through `LAST_INSERT_ID(expr)`, with the statement's result: 0
    /// means nothing was acquired.
    async fn acquire(
        c: &mut MySqlConnection,
        statement: &SqlStr,
        lease: &Lease,
        fresh: &Record,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let now_ms = sql_int(now.as_millis());
        let done = keyed(sqlx::query(statement.clone()), &fresh.key)
            .bind(&fresh.fingerprint.as_bytes()[..])
            .bind(sql_int(fresh.fence))
            .bind(&lease.id.to_bytes()[..])
            .bind(sql_int(lease.expires_at.as_millis()))
            .bind(sql_int(fresh.ttl_ms))
            .bind(now_ms)
            .bind(now_ms)
            .bind(sql_int(fresh.expires_at.as_millis()))
            .bind(sql_int(fresh.expires_at.as_millis()))
            .bind(now_ms)
            .bind(now_ms)
            .execute(c)
            .await
            .map_err(|e| error("cannot begin the record", e))?;
        let fence = done.last_insert_id();
        Ok((fence > 0).then_some(fence))
    }

    async fn advance(store: &MySqlStore, key: &Key, by: u64) -> Result<u64, StoreError> {
        let done = keyed(sqlx::query(store.sql.advance.clone()), key)
            .bind(sql_int(by))
            .execute(&store.pool)
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

    async fn raise(store: &MySqlStore, key: &Key, to: u64) -> Result<u64, StoreError> {
        let done = keyed(sqlx::query(store.sql.raise.clone()), key)
            .bind(sql_int(to))
            .execute(&store.pool)
            .await
            .map_err(|e| error("cannot raise the counter", e))?;
        Ok(done.last_insert_id())
    }

    /// The records are all a purge deletes.
    async fn purge_more(_: &MySqlStore, _: u64) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// One multi-row upsert, in key order (the primary key compares bytes) so that batches
    /// lock rows in one order, then one read of which rows hold our lease ids, in one
    /// transaction.
    async fn begin_many(store: &MySqlStore, jobs: &[BeginJob], fresh: &[Fresh]) -> Many<Acquired> {
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|a, b| jobs[*a].req.key.cmp(&jobs[*b].req.key));
        let (Some(sized), Some(&last)) = (sized(store, jobs.len()), order.last()) else {
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
                .bind(sql_int(record.fence))
                .bind(&id[..])
                .bind(sql_int(lease.expires_at.as_millis()))
                .bind(sql_int(record.ttl_ms))
                .bind(now)
                .bind(now)
                .bind(sql_int(record.expires_at.as_millis()))
                .bind(sql_int(record.expires_at.as_millis()));
        }
        let read = rows().fold(sqlx::query(sized.acquired.clone()), |q, i| {
            keyed(q, &jobs[i].req.key)
        });
        // The upsert and the read in one transaction. Each as a statement of its own, a
        // `begin` of another caller could take a row over between them (its clock past the
        // lease just given), and the read would then miss a row this batch did take: its caller
        // would be left to a second `begin` of its own, having acquired with the first.
        let mut c = store.conn().await?;
        let Ok(mut tx) = c.begin().await else {
            return Ok(None);
        };
        // Until the commit, a failure leaves nothing behind: every job is then decided on
        // its own.
        if q.execute(&mut *tx).await.is_err() {
            return abandon(tx).await;
        }
        let Ok(rows) = read.fetch_all(&mut *tx).await else {
            return abandon(tx).await;
        };
        let taken: Option<Vec<Acquired>> = rows
            .iter()
            .map(|r| {
                Some((
                    sqlx::Row::try_get(r, 0).ok()?,
                    sqlx::Row::try_get(r, 1).ok()?,
                ))
            })
            .collect();
        let Some(taken) = taken else {
            return abandon(tx).await;
        };
        // A commit that failed may have been applied: the rows taken may be this batch's
        // callers', so none may begin again; each fails, as a lone `begin` whose answer was
        // lost does.
        tx.commit()
            .await
            .map_err(|e| error("cannot commit a batch of begins", e))?;
        Ok(Some(taken))
    }

    /// One statement; MySQL reports only how many rows it changed. When that is every job,
    /// each is done; otherwise the rows are read in the statement's transaction, and a job is
    /// done if its row, as the statement left it, is completed by its lease with its response
    /// (`complete` would answer it `Ok`). Read later, on its own, a row this statement did
    /// complete could have moved on (reopened, or expired and taken over): its caller would be
    /// told its lease is stale after completing the record.
    async fn complete_many(store: &MySqlStore, jobs: &[CompleteJob]) -> Many<bool> {
        let (Some(sized), Some(last)) = (sized(store, jobs.len()), jobs.last()) else {
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
        let mut c = store.conn().await?;
        let Ok(mut tx) = c.begin().await else {
            return Ok(None);
        };
        // Until the commit, a failure leaves nothing behind: every job is settled on its own.
        let Ok(done) = q.execute(&mut *tx).await else {
            return abandon(tx).await;
        };
        let done = if u64::try_from(jobs.len()).is_ok_and(|n| done.rows_affected() == n) {
            vec![true; jobs.len()]
        } else {
            let read = rows().fold(sqlx::query(sized.completed.clone()), |q, job| {
                keyed(q, &job.key)
            });
            let Ok(read) = read.fetch_all(&mut *tx).await else {
                return abandon(tx).await;
            };
            jobs.iter()
                .map(|job| {
                    read.iter()
                        .find(|r| holds_key(r, &job.key))
                        .and_then(|r| sql::raw(r).ok()?.into_record(&job.key).ok())
                        .is_some_and(|record| {
                            let response = Some(job.response.clone());
                            sql::repeated_settle(Some(record), &job.lease, response, job.now)
                                .is_ok()
                        })
                })
                .collect()
        };
        // A commit that failed may have been applied: no job may be settled again (one this
        // statement completed would be refused), so each fails, as a lone `complete` whose
        // answer was lost does.
        tx.commit()
            .await
            .map_err(|e| error("cannot commit a batch of completions", e))?;
        Ok(Some(done))
    }
}

/// Ends a batch's transaction that failed before its commit, so that nothing of it stays: its
/// row locks go now, before its jobs go on their own, not when the connection is next used.
/// (If the connection is lost, the server rolls back.)
async fn abandon<T>(tx: sqlx::Transaction<'_, sqlx::MySql>) -> Many<T> {
    let _ = tx.rollback().await;
    Ok(None)
}

/// Whether a row read with its key in the last three columns is `key`'s.
fn holds_key(r: &sqlx::mysql::MySqlRow, key: &Key) -> bool {
    let part = |i: usize| sqlx::Row::try_get::<Vec<u8>, _>(r, i).ok();
    part(11).as_deref() == Some(key.scope().as_str().as_bytes())
        && part(12).as_deref() == Some(key.namespace().as_str().as_bytes())
        && part(13).as_deref() == Some(key.client_key().as_str().as_bytes())
}
