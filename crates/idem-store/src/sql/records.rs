//! The records path of the SQL stores, written once for PostgreSQL and MySQL/MariaDB: the
//! statements both spell alike, the reread loops of `begin`, the settles and `record_step`, and
//! the one-record forms group commit falls back to. What a server does its own way is a hook
//! of its [`Server`] dialect: the statements it spells differently (`begin`, `renew`, the
//! purge, the counters), how `begin` reads the fence back (`RETURNING` on PostgreSQL,
//! `LAST_INSERT_ID` on MySQL), the batched `begin` and `complete`, and connecting.

use std::fmt;
use std::future::Future;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, Step, StepError, StoreError,
    Timestamp,
};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::driver::{Arg, Driver, On};
use super::{COLUMNS, SqlOptions, SqlStore, TableName, error, refused_begin, repeated_settle};
use crate::group_commit::{Acquired, BeginJob, CompleteJob, Fresh, GroupCommit, Many, ManyAtOnce};
use crate::reread;
use crate::row::sql_int;

/// How a connection to server `S` is set up.
pub(crate) type OptionsOf<S> = <<S as sqlx::Database>::Connection as sqlx::Connection>::Options;

/// A SQL server a [`SqlStore`] keeps its records on: what it does its own way.
pub(crate) trait Server: Driver + Sized {
    /// What [`Store::kind`](idem_core::Store::kind) answers.
    const KIND: &'static str;
    /// What ends a read of the row that a settle or `record_step` decides from: a locking read
    /// where a caller's transaction would otherwise read its own old snapshot.
    const LOCKING_READ: &'static str;

    /// What the store keeps beside the records (the server's locks, its batch statements).
    type Own: Clone + fmt::Debug + Send + Sync + 'static;

    /// The statements the server spells its own way, for the records table `t`.
    fn spelling(t: &TableName) -> Spelling;

    /// The connection options with the session settings the store needs, if the server takes
    /// them with the options.
    fn session(connect: OptionsOf<Self>, options: &SqlOptions) -> OptionsOf<Self>;

    /// What a new connection runs first, if the server takes its session settings as a
    /// statement.
    fn first(
        c: &mut Self::Connection,
        options: &SqlOptions,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The pool's options, with what each of its connections runs first.
    fn pooled(pool: PoolOptions<Self>, options: &SqlOptions) -> PoolOptions<Self>;

    /// Applies the pending migrations, under the server's migration lock.
    fn migrate(
        c: &mut Self::Connection,
        table: &TableName,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// What the store keeps beside the records; `batching` if group commit is on.
    fn own(table: &TableName, options: &SqlOptions, batching: bool) -> Self::Own;

    /// Runs `begin`'s upsert (`Spelling::begin`) for `fresh`, the record a fresh acquisition
    /// writes under `lease`: the fence the record was acquired with, or `None` if nothing was.
    fn acquire(
        c: &mut Self::Connection,
        statement: &SqlStr,
        lease: &Lease,
        fresh: &Record,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send;

    /// Adds `by` to a counter (`Spelling::advance`) and answers its new value.
    fn advance(
        store: &SqlStore<Self>,
        key: &Key,
        by: u64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Raises a counter to at least `to` (`Spelling::raise`) and answers its value.
    fn raise(
        store: &SqlStore<Self>,
        key: &Key,
        to: u64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// After a purge deleted fewer records than its budget: deletes up to `rest` of what else
    /// the server's store purges (old lock rows), and answers how many.
    fn purge_more(
        store: &SqlStore<Self>,
        rest: u64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// `begin` for many records at once (group commit).
    fn begin_many(
        store: &SqlStore<Self>,
        jobs: &[BeginJob],
        fresh: &[Fresh],
    ) -> impl Future<Output = Many<Acquired>> + Send;

    /// `complete` for many records at once (group commit).
    fn complete_many(
        store: &SqlStore<Self>,
        jobs: &[CompleteJob],
    ) -> impl Future<Output = Many<bool>> + Send;
}

/// The statements a server spells its own way, with the values each takes in order.
pub(crate) struct Spelling {
    /// Bound by [`Server::acquire`].
    pub(crate) begin: String,
    /// `now`, the new lease end, the key, the lease id, the fence, `now`.
    pub(crate) renew: String,
    /// `now`, `now`, the most rows to delete.
    pub(crate) purge: String,
    /// Bound by [`Server::advance`].
    pub(crate) advance: String,
    /// Bound by [`Server::raise`].
    pub(crate) raise: String,
}

/// The statements on the records table, prepared once per connection.
#[derive(Clone, Debug)]
pub(crate) struct Statements {
    pub(crate) begin: SqlStr,
    load: SqlStr,
    complete: SqlStr,
    release: SqlStr,
    pub(crate) renew: SqlStr,
    step: SqlStr,
    pub(crate) reopen: SqlStr,
    pub(crate) get: SqlStr,
    pub(crate) purge: SqlStr,
    pub(crate) advance: SqlStr,
    pub(crate) raise: SqlStr,
}

/// `expires_at` for a record settled at `now` (bound twice): `now + ttl_ms`, capped at
/// `i64::MAX`.
const SETTLED_EXPIRY: &str = "LEAST(ttl_ms, 9223372036854775807 - ?) + ?";

/// The conditions on the key, bound as [`Arg::key`].
const KEY: &str = "scope = ? AND namespace = ? AND client_key = ?";

impl Statements {
    pub(crate) fn new<S: Server>(t: &TableName) -> Self {
        let s = |sql: String| AssertSqlSafe(sql).into_sql_str();
        // The statements both servers spell alike, written with `?` and numbered for the
        // server's placeholders; the values go in the order of the `?`.
        let alike = |sql: String| s(numbered::<S>(&sql));
        let own = S::spelling(t);
        let lease_held = "lease_id = ? AND fence = ? AND status = 'in_progress' AND expires_at > ?";
        Self {
            begin: s(own.begin),
            // The key.
            load: alike(format!(
                "SELECT {COLUMNS} FROM {t} WHERE {KEY}{}",
                S::LOCKING_READ
            )),
            // The response, `now` three times, the key, the lease id, the fence, `now`.
            complete: alike(format!(
                "UPDATE {t} SET status = 'completed', response = ?, updated_at = ?,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {KEY} AND {lease_held}"
            )),
            // `now` three times, the key, the lease id, the fence, `now`.
            release: alike(format!(
                "UPDATE {t} SET status = 'released', response = NULL, updated_at = ?,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {KEY} AND {lease_held}"
            )),
            renew: s(own.renew),
            // The steps after it, `now`, the key, the lease id, the fence, `now`, how long the
            // steps were as read (`reread::StepWrite`).
            step: alike(format!(
                "UPDATE {t} SET steps = ?, updated_at = GREATEST(?, updated_at + 1)
                 WHERE {KEY} AND {lease_held} AND COALESCE(octet_length(steps), 0) = ?"
            )),
            // `now` three times, the key, the fence, `now`.
            reopen: alike(format!(
                "UPDATE {t} SET status = 'released', response = NULL, steps = NULL, updated_at = ?,
                     expires_at = {SETTLED_EXPIRY}
                 WHERE {KEY} AND fence = ? AND status = 'completed' AND expires_at > ?"
            )),
            // The key, `now`.
            get: alike(format!(
                "SELECT {COLUMNS} FROM {t} WHERE {KEY} AND expires_at > ?"
            )),
            purge: s(own.purge),
            advance: s(own.advance),
            raise: s(own.raise),
        }
    }
}

/// `sql` with each `?` replaced by the dialect's placeholder for the value in its place.
fn numbered<D: Driver>(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    for (n, part) in sql.split('?').enumerate() {
        if n > 0 {
            out.push_str(&D::placeholder(n));
        }
        out.push_str(part);
    }
    out
}

/// A time, a fence or a length as a SQL integer.
pub(crate) fn int(v: u64) -> Arg<'static> {
    Arg::Int(sql_int(v))
}

#[allow(private_bounds)]
impl<S: Server> SqlStore<S> {
    /// The record under `key`, read on `c` as the settles and `record_step` decide from it.
    async fn load(&self, c: &mut S::Connection, key: &Key) -> Result<Option<Record>, StoreError> {
        let row = S::row(On::Conn(c), &self.sql.load, &Arg::key(key))
            .await
            .map_err(|e| error::<S>("cannot read the record", e))?;
        row.map(|r| S::record(&r, key)).transpose()
    }

    /// The record under `key` if it is live at `now`.
    pub(crate) async fn read(
        &self,
        on: On<'_, S>,
        key: &Key,
        now: Timestamp,
    ) -> Result<Option<Record>, StoreError> {
        let [scope, namespace, client_key] = Arg::key(key);
        let args = [scope, namespace, client_key, int(now.as_millis())];
        let row = S::row(on, &self.sql.get, &args)
            .await
            .map_err(|e| error::<S>("cannot read the record", e))?;
        row.map(|r| S::record(&r, key)).transpose()
    }

    /// `begin` on one connection (of the pool, or a caller's transaction): the upsert, and if
    /// it acquired nothing, the row as read decides.
    pub(crate) async fn begin_on(
        &self,
        c: &mut S::Connection,
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
            if let Some(fence) = S::acquire(c, &self.sql.begin, &lease, &fresh, now).await? {
                return Ok(BeginOutcome::Acquired(Lease { fence, ..lease }));
            }
            let existing = self.load(c, &req.key).await?;
            if let Some(outcome) = refused_begin(existing.as_ref(), req, now) {
                return Ok(outcome);
            }
        }
        Err(reread::kept_changing())
    }

    /// Runs a lease-conditioned update (`complete` if there is a `response`, `release`
    /// otherwise); if it changed nothing, reads the row to tell a repeated call by the same
    /// lease (`Ok`) from a stale lease.
    pub(crate) async fn settle_on(
        &self,
        c: &mut S::Connection,
        key: &Key,
        lease: &Lease,
        response: Option<Bytes>,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let now_ms = int(now.as_millis());
        let id = lease.id.to_bytes();
        let [scope, namespace, client_key] = Arg::key(key);
        let held = [
            scope,
            namespace,
            client_key,
            Arg::Bytes(&id),
            int(lease.fence),
            now_ms,
        ];
        let done = match &response {
            Some(r) => {
                let args = [&[Arg::Bytes(r), now_ms, now_ms, now_ms][..], &held].concat();
                S::run(On::Conn(&mut *c), &self.sql.complete, &args).await
            }
            None => {
                let args = [&[now_ms, now_ms, now_ms][..], &held].concat();
                S::run(On::Conn(&mut *c), &self.sql.release, &args).await
            }
        }
        .map_err(|e| error::<S>("cannot settle the record", e))?;
        if done == 1 {
            return Ok(());
        }
        repeated_settle(self.load(c, key).await?, lease, response, now)
    }

    /// `record_step` on one connection (of the pool, or a caller's transaction): read the
    /// row, decide, write if the steps are still as read.
    pub(crate) async fn record_step_on(
        &self,
        c: &mut S::Connection,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        let now_ms = int(now.as_millis());
        let id = lease.id.to_bytes();
        for _ in 0..reread::ROUNDS {
            let Some(write) = reread::step_write(self.load(c, key).await?, lease, step, now)?
            else {
                return Ok(());
            };
            let [scope, namespace, client_key] = Arg::key(key);
            let read_len = Arg::Int(i64::try_from(write.read_len).unwrap_or(i64::MAX));
            let args = [
                Arg::Bytes(&write.steps),
                now_ms,
                scope,
                namespace,
                client_key,
                Arg::Bytes(&id),
                int(lease.fence),
                now_ms,
                read_len,
            ];
            let done = S::run(On::Conn(&mut *c), &self.sql.step, &args)
                .await
                .map_err(|e| error::<S>("cannot record the step", e))?;
            if done == 1 {
                return Ok(());
            }
        }
        Err(reread::kept_changing().into())
    }
}

impl<S: Server> ManyAtOnce for SqlStore<S> {
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
        self.settle_on(&mut c, &job.key, &job.lease, Some(job.response), job.now)
            .await
    }

    async fn begin_many(&self, jobs: &[BeginJob], fresh: &[Fresh]) -> Many<Acquired> {
        S::begin_many(self, jobs, fresh).await
    }

    async fn complete_many(&self, jobs: &[CompleteJob]) -> Many<bool> {
        S::complete_many(self, jobs).await
    }
}

#[cfg(test)]
mod tests {
    /// The statements both servers spell alike take `$1`, `$2`, … on PostgreSQL, in order.
    #[cfg(feature = "postgres")]
    #[test]
    fn placeholders_are_numbered_in_order() {
        assert_eq!(
            super::numbered::<sqlx::Postgres>("a = ? AND b = ? OR c > ?"),
            "a = $1 AND b = $2 OR c > $3"
        );
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_keeps_its_question_marks() {
        assert_eq!(
            super::numbered::<sqlx::MySql>("a = ? AND b = ?"),
            "a = ? AND b = ?"
        );
    }
}
