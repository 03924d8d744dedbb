//! The statements on the records and counters tables, one record at a time and in batches
//! (group commit: many rows in one statement, through arrays bound as `unnest` columns).

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, Step, StepError, StoreError,
    Timestamp,
};
use sqlx::{AssertSqlSafe, PgConnection, SqlSafeStr, SqlStr};

use super::{PostgresStore, error};
use crate::batch::{Acquired, BeginJob, CompleteJob, Fresh, GroupCommit, Many, ManyAtOnce};
use crate::reread;
use crate::row::sql_int;
use crate::sql::{self, COLUMNS, TableName};

#[derive(Clone, Debug)]
pub(super) struct Statements {
    pub(super) begin: SqlStr,
    pub(super) begin_many: SqlStr,
    pub(super) complete_many: SqlStr,
    pub(super) load: SqlStr,
    pub(super) complete: SqlStr,
    pub(super) release: SqlStr,
    pub(super) renew: SqlStr,
    pub(super) step: SqlStr,
    pub(super) reopen: SqlStr,
    pub(super) get: SqlStr,
    pub(super) purge: SqlStr,
    pub(super) advance: SqlStr,
    pub(super) raise: SqlStr,
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

/// `expires_at` for a record settled at `$now`: `now + ttl_ms`, capped at `i64::MAX`.
const SETTLED_EXPIRY: &str = "LEAST(ttl_ms, 9223372036854775807 - $4) + $4";

impl Statements {
    pub(super) fn new(t: &TableName) -> Self {
        let s = |sql: String| AssertSqlSafe(sql).into_sql_str();
        let key = "scope = $1 AND namespace = $2 AND client_key = $3";
        Self {
            // A fresh row has the first fence ($10); an existing one is taken over only when it may be
            // acquired: expired, released, or in progress for the same request with its lease
            // run out (`Record::begin`).
            begin: s(format!(
                "INSERT INTO {t} AS r (scope, namespace, client_key, fingerprint, status, fence,
                     lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                     expires_at, purge_after)
                 VALUES ($1, $2, $3, $5, 'in_progress', $10, $6, $7, NULL, $8, $4, $4, $9, $9)
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
            // $7 the steps after it, $8 how long they were as read (`reread::StepWrite`).
            step: s(format!(
                "UPDATE {t} SET steps = $7, updated_at = $4
                 WHERE {key} AND lease_id = $5 AND fence = $6 AND status = 'in_progress'
                   AND expires_at > $4 AND COALESCE(octet_length(steps), 0) = $8"
            )),
            reopen: s(format!(
                "UPDATE {t} SET status = 'released', response = NULL, steps = NULL, updated_at = $4,
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
    pub(super) async fn load(
        &self,
        c: &mut PgConnection,
        key: &Key,
    ) -> Result<Option<Record>, StoreError> {
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
    pub(super) async fn begin_on(
        &self,
        c: &mut PgConnection,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        // The record a fresh acquisition writes; its fence comes from the database.
        let (lease, fresh) = Record::acquired(
            req,
            now,
            Lease::first_fence(now),
            idem_core::LeaseId::generate(),
        );
        for _ in 0..reread::ROUNDS {
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
                .bind(sql_int(fresh.fence))
                .fetch_optional(&mut *c)
                .await
                .map_err(|e| error("cannot begin the record", e))?;
            if let Some(fence) = fence {
                let fence = u64::try_from(fence)
                    .map_err(|_| StoreError::Corrupt("the stored fence is negative".into()))?;
                return Ok(BeginOutcome::Acquired(Lease { fence, ..lease }));
            }
            let existing = self.load(c, &req.key).await?;
            if let Some(outcome) = sql::refused_begin(existing.as_ref(), req, now) {
                return Ok(outcome);
            }
        }
        Err(reread::kept_changing())
    }

    /// Runs a lease-conditioned update; if it changed nothing, reads the row to tell a
    /// repeated call by the same lease (`Ok`) from a stale lease.
    pub(super) async fn settle_on(
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
        sql::repeated_settle(self.load(c, key).await?, lease, response, now)
    }

    /// `record_step` on one connection (of the pool, or a caller's transaction): read the
    /// row, decide, write if the steps are still as read.
    pub(super) async fn record_step_on(
        &self,
        c: &mut PgConnection,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        for _ in 0..reread::ROUNDS {
            let Some(write) = reread::step_write(self.load(c, key).await?, lease, step, now)?
            else {
                return Ok(());
            };
            let done = sqlx::query(self.sql.step.clone())
                .bind(key.scope().as_str())
                .bind(key.namespace().as_str())
                .bind(key.client_key().as_str())
                .bind(sql_int(now.as_millis()))
                .bind(&lease.id.to_bytes()[..])
                .bind(sql_int(lease.fence))
                .bind(write.steps)
                .bind(i64::try_from(write.read_len).unwrap_or(i64::MAX))
                .execute(&mut *c)
                .await
                .map_err(|e| error("cannot record the step", e))?;
            if done.rows_affected() == 1 {
                return Ok(());
            }
        }
        Err(reread::kept_changing().into())
    }
}

impl ManyAtOnce for PostgresStore {
    fn group_commit(&self) -> Option<&GroupCommit> {
        self.batches.as_ref()
    }

    async fn begin_alone(
        &self,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let mut c = self.conn().await?;
        self.begin_on(&mut c, req, now).await
    }

    async fn complete_alone(&self, job: CompleteJob) -> Result<(), LeaseError> {
        let mut c = self.conn().await?;
        let (key, lease) = (&job.key, &job.lease);
        self.settle_on(
            &mut c,
            &self.sql.complete,
            key,
            lease,
            Some(job.response),
            job.now,
        )
        .await
    }

    async fn begin_many(&self, jobs: &[BeginJob], fresh: &[Fresh]) -> Many<Acquired> {
        let column = |f: fn(&BeginJob, &Fresh) -> i64| -> Vec<i64> {
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
            .bind(column(|_, (_, r)| sql_int(r.fence)))
            .fetch_all(&mut *c)
            .await
            .ok())
    }

    /// The rows go in key order, as the batched `begin` takes them, so that batches meeting
    /// on keys lock them in one order.
    async fn complete_many(&self, jobs: &[CompleteJob]) -> Many<bool> {
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
