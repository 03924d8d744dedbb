//! PostgreSQL's hooks on the records path: the statements it spells its own way (`begin` an
//! upsert whose `RETURNING` hands the fence back, the purge by `ctid`, the counters), the batched
//! forms (group commit: many rows in one statement, through arrays bound as `unnest` columns),
//! and the session settings of its connections.

use idem_core::{Key, Lease, Record, StoreError, Timestamp};
use sqlx::pool::PoolOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, SqlSafeStr, SqlStr};

use super::{Own, PostgresStore, error, locks, migrate};
use crate::group_commit::{Acquired, BeginJob, CompleteJob, Fresh, Many};
use crate::row::sql_int;
use crate::sql::{self, Spelling, SqlOptions, TableName};

/// The statements PostgreSQL spells its own way.
fn spelling(t: &TableName) -> Spelling {
    Spelling {
        // A fresh row has the first fence ($10); an existing one is taken over only when it
        // may be acquired: expired, released, or in progress for the same request with its
        // lease run out (`Record::begin`).
        begin: format!(
            "INSERT INTO {t} AS r (scope, namespace, client_key, fingerprint, status, fence,
                 lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                 expires_at, purge_after)
             VALUES ($1, $2, $3, $5, 'in_progress', $10, $6, $7, NULL, $8, $4, $4, $9, $9)
             {TAKE_OVER}
             RETURNING fence"
        ),
        // $2: the new lease end. Retention runs on from it, and the purge index follows if it
        // must move later.
        renew: format!(
            "UPDATE {t} SET updated_at = $1, lease_expires_at = $2,
                 expires_at = LEAST(ttl_ms, 9223372036854775807 - $2) + $2,
                 purge_after = GREATEST(purge_after, LEAST(ttl_ms, 9223372036854775807 - $2) + $2)
             WHERE scope = $3 AND namespace = $4 AND client_key = $5 AND lease_id = $6
               AND fence = $7 AND status = 'in_progress' AND expires_at > $8"
        ),
        // The condition is repeated outside: a row a concurrent `begin` took over while this
        // waited for its lock is rechecked against it and kept.
        purge: format!(
            "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                 SELECT ctid FROM {t} WHERE purge_after <= $1 AND expires_at <= $2 LIMIT $3))
               AND purge_after <= $1 AND expires_at <= $2"
        ),
        // No row back: the sum would pass i64::MAX.
        advance: format!(
            "INSERT INTO {t}_counters AS c (scope, namespace, client_key, value)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (scope, namespace, client_key) DO UPDATE
                 SET value = c.value + EXCLUDED.value
                 WHERE c.value <= 9223372036854775807 - EXCLUDED.value
             RETURNING value"
        ),
        raise: format!(
            "INSERT INTO {t}_counters AS c (scope, namespace, client_key, value)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (scope, namespace, client_key) DO UPDATE
                 SET value = GREATEST(c.value, EXCLUDED.value)
             RETURNING value"
        ),
    }
}

/// How `begin` takes an existing row over: only when it may be acquired (expired, released
/// without steps or for the same request, or in progress for the same request with its lease
/// run out, as `Record::begin` decides), `now` being the new row's `created_at`. The steps of
/// a live row stay, for the new attempt to resume. The fence is `Lease::next_fence` of the
/// row's, a fresh row's `Lease::first_fence`.
const TAKE_OVER: &str = "ON CONFLICT (scope, namespace, client_key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, status = 'in_progress',
        fence = r.fence + CASE WHEN (r.fence + 1) % 1000 = 0 THEN 2 ELSE 1 END,
        lease_id = EXCLUDED.lease_id,
        lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
        ttl_ms = EXCLUDED.ttl_ms, created_at = EXCLUDED.created_at,
        updated_at = EXCLUDED.updated_at, expires_at = EXCLUDED.expires_at,
        purge_after = EXCLUDED.purge_after,
        steps = CASE WHEN r.expires_at <= EXCLUDED.created_at THEN NULL ELSE r.steps END
    WHERE r.expires_at <= EXCLUDED.created_at
       OR (r.status = 'released' AND (r.steps IS NULL OR r.fingerprint = EXCLUDED.fingerprint))
       OR (r.status = 'in_progress' AND r.fingerprint = EXCLUDED.fingerprint
           AND r.lease_expires_at <= EXCLUDED.created_at)";

/// The batched statements (group commit).
#[derive(Clone, Debug)]
pub(super) struct Batches {
    begin: SqlStr,
    complete: SqlStr,
}

impl Batches {
    pub(super) fn new(t: &TableName) -> Self {
        let s = |sql: String| AssertSqlSafe(sql).into_sql_str();
        Self {
            begin: s(format!(
                "INSERT INTO {t} AS r (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 SELECT i.scope, i.namespace, i.client_key, i.fingerprint, 'in_progress',
                     i.fence, i.lease_id, i.lease_expires_at, NULL, i.ttl_ms, i.now, i.now,
                     i.expires_at, i.expires_at
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[],
                     $6::bytea[], $7::int8[], $8::int8[], $9::int8[], $10::int8[])
                     AS i(scope, namespace, client_key, now, fingerprint, lease_id,
                          lease_expires_at, ttl_ms, expires_at, fence)
                 ORDER BY i.scope, i.namespace, i.client_key
                 {TAKE_OVER}
                 RETURNING lease_id, fence"
            )),

            complete: s(format!(
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
        }
    }
}

impl sql::Server for Postgres {
    const KIND: &'static str = "postgres";
    const LOCKING_READ: &'static str = "";
    type Own = Own;

    fn spelling(t: &TableName) -> Spelling {
        spelling(t)
    }

    // Read committed whatever the server's default: under repeatable read a contended upsert
    // fails with a serialization error instead of waiting and deciding.
    fn session(connect: PgConnectOptions, options: &SqlOptions) -> PgConnectOptions {
        connect.options([
            (
                "lock_timeout",
                format!("{}ms", options.lock_timeout.as_millis().max(1)),
            ),
            ("default_transaction_isolation", "read committed".to_owned()),
        ])
    }

    async fn first(_: &mut PgConnection, _: &SqlOptions) -> Result<(), StoreError> {
        Ok(())
    }

    fn pooled(pool: PoolOptions<Self>, _: &SqlOptions) -> PoolOptions<Self> {
        pool
    }

    async fn migrate(c: &mut PgConnection, table: &TableName) -> Result<(), StoreError> {
        migrate::migrate(c, table).await
    }

    fn own(table: &TableName, _: &SqlOptions, _: bool) -> Own {
        Own {
            locks: locks::PgLocks::new(table),
            batches: Batches::new(table),
        }
    }

    /// The fence comes back with the row the upsert wrote (`RETURNING`); no row, nothing
    /// acquired.
    async fn acquire(
        c: &mut PgConnection,
        statement: &SqlStr,
        lease: &Lease,
        fresh: &Record,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let key = &fresh.key;
        let fence: Option<i64> = sqlx::query_scalar(statement.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(now.as_millis()))
            .bind(&fresh.fingerprint.as_bytes()[..])
            .bind(&lease.id.to_bytes()[..])
            .bind(sql_int(lease.expires_at.as_millis()))
            .bind(sql_int(fresh.ttl_ms))
            .bind(sql_int(fresh.expires_at.as_millis()))
            .bind(sql_int(fresh.fence))
            .fetch_optional(c)
            .await
            .map_err(|e| error("cannot begin the record", e))?;
        fence
            .map(|f| {
                u64::try_from(f)
                    .map_err(|_| StoreError::Corrupt("the stored fence is negative".into()))
            })
            .transpose()
    }

    async fn advance(store: &PostgresStore, key: &Key, by: u64) -> Result<u64, StoreError> {
        let value: Option<i64> = sqlx::query_scalar(store.sql.advance.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(by))
            .fetch_optional(&store.pool)
            .await
            .map_err(|e| error("cannot advance the counter", e))?;
        value
            .and_then(|v| u64::try_from(v).ok())
            .ok_or(StoreError::CounterExhausted)
    }

    async fn raise(store: &PostgresStore, key: &Key, to: u64) -> Result<u64, StoreError> {
        let value: i64 = sqlx::query_scalar(store.sql.raise.clone())
            .bind(key.scope().as_str())
            .bind(key.namespace().as_str())
            .bind(key.client_key().as_str())
            .bind(sql_int(to))
            .fetch_one(&store.pool)
            .await
            .map_err(|e| error("cannot raise the counter", e))?;
        u64::try_from(value).map_err(|_| StoreError::Corrupt("a negative counter".into()))
    }

    /// Lock rows unused for an hour go with the same budget.
    async fn purge_more(store: &PostgresStore, rest: u64) -> Result<u64, StoreError> {
        let mut c = store.conn().await?;
        store
            .locks()
            .purge(&mut c, i64::try_from(rest).unwrap_or(i64::MAX))
            .await
    }

    async fn begin_many(
        store: &PostgresStore,
        jobs: &[BeginJob],
        fresh: &[Fresh],
    ) -> Many<Acquired> {
        let column = |f: fn(&BeginJob, &Fresh) -> i64| -> Vec<i64> {
            jobs.iter().zip(fresh).map(|(j, r)| f(j, r)).collect()
        };
        let mut c = store.conn().await?;
        Ok(sqlx::query_as(store.own.batches.begin.clone())
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
            .bind(column(|_, (_, r)| sql_int(r.fence)))
            .fetch_all(&mut *c)
            .await
            .ok())
    }

    /// The rows go in key order, as the batched `begin` takes them, so that batches meeting
    /// on keys lock them in one order.
    async fn complete_many(store: &PostgresStore, jobs: &[CompleteJob]) -> Many<bool> {
        let asked = jobs;
        let mut sorted: Vec<&CompleteJob> = jobs.iter().collect();
        sorted.sort_by(|a, b| a.key.cmp(&b.key));
        let jobs = &sorted[..];
        let mut c = store.conn().await?;
        let done: Option<Vec<Vec<u8>>> = sqlx::query_scalar(store.own.batches.complete.clone())
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
