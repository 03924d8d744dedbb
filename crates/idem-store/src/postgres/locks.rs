//! Locks in PostgreSQL: a lease-based lock with fencing across processes, and
//! transaction-scoped advisory locks for work inside one transaction.
//!
//! **Lease locks** live in `<table>_locks`, one row per name, kept after release (the row
//! carries the fence). Each operation is one statement with the server's clock
//! (`clock_timestamp()`), so clients' clocks never decide who holds a lock: acquiring is an
//! `INSERT … ON CONFLICT DO UPDATE … WHERE <free, or ours>` that computes the fence in the same
//! step, `max(fence + 1, now in µs)`; renew and release are `UPDATE`s conditioned on the owner
//! and fence. A release sends `NOTIFY` on `<table name>_locks` with the lock's name; the store
//! listens on a connection of its pool (taken when the first waiter listens, given back when none has
//! for a while) and wakes its waiters. Rows unused for an hour past their lease are deleted by
//! `purge_expired`.
//!
//! **Advisory locks** ([`PostgresStore::xact_lock`], [`PostgresStore::try_xact_lock`]) are
//! PostgreSQL's own `pg_advisory_xact_lock`: held until the caller's transaction ends, so
//! they need no lease and cannot outlive a crashed holder, but they protect only work done
//! inside that transaction, on that database.

use std::sync::Arc;
use std::time::Duration;

use idem_core::lock::{LOCK_STATE_RETENTION, lease_millis};
use idem_core::{
    Acquire, Held, HeldLock, LockError, LockName, LockStore, OwnerDigest, ReleaseListener,
    StoreError, Timestamp,
};
use sqlx::postgres::PgListener;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};

use super::{PostgresStore, error};
use crate::lock_wakeup::{FeedTask, ReleaseFeed};
use crate::row::{held_lock, sql_int};
use crate::sql::TableName;

/// The server's clock in microseconds, and in milliseconds.
const NOW_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";
const NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
/// [`LOCK_STATE_RETENTION`] in milliseconds.
const RETENTION_MS: u64 = LOCK_STATE_RETENTION.as_secs() * 1000;

/// The lock statements and the release feed, shared by a store's clones.
#[derive(Clone, Debug)]
pub(crate) struct PgLocks {
    acquire: SqlStr,
    holder: SqlStr,
    renew: SqlStr,
    release: SqlStr,
    held: SqlStr,
    purge: SqlStr,
    channel: String,
    feed: ReleaseFeed,
}

impl PgLocks {
    pub(crate) fn new(table: &TableName) -> Self {
        let s = |sql: String| AssertSqlSafe(table.fill(&sql)).into_sql_str();
        let channel = table.fill("{name}_locks");
        Self {
            // $1 name, $2 owner, $3 lease ms. A fresh row's fence is the clock; a row that is
            // free (or held by this owner, whose holding it extends) is taken in place. The
            // clock is read where each value is used, not once up front: a statement that
            // waited for the row's lock (behind a release, say) decides by the time after it.
            acquire: s(format!(
                "INSERT INTO {{table}}_locks AS l (name, owner, fence, expires_at)
                 VALUES ($1, $2, {NOW_US}, {NOW_MS} + $3)
                 ON CONFLICT (name) DO UPDATE SET
                     fence = CASE
                         WHEN l.owner = EXCLUDED.owner AND l.expires_at > {NOW_MS}
                         THEN l.fence
                         ELSE GREATEST(l.fence + 1, {NOW_US}) END,
                     owner = EXCLUDED.owner,
                     expires_at = {NOW_MS} + $3
                 WHERE l.expires_at <= {NOW_MS} OR l.owner = EXCLUDED.owner
                 RETURNING fence, expires_at"
            )),
            holder: s("SELECT expires_at FROM {table}_locks WHERE name = $1".to_owned()),
            // $1 name, $2 owner, $3 fence, $4 lease ms.
            renew: s(format!(
                "UPDATE {{table}}_locks SET expires_at = {NOW_MS} + $4
                 WHERE name = $1 AND owner = $2 AND fence = $3 AND expires_at > {NOW_MS}
                 RETURNING expires_at"
            )),
            // $1 name, $2 owner, $3 fence, $4 channel. Waiters are told on commit; a repeated
            // release tells them again, which costs them one attempt.
            release: s(format!(
                "WITH u AS (UPDATE {{table}}_locks SET expires_at = LEAST(expires_at, {NOW_MS})
                       WHERE name = $1 AND owner = $2 AND fence = $3
                       RETURNING name)
                 SELECT pg_notify($4, name) FROM u"
            )),
            // $1 limit. By the server's clock, as every lock decision; by byte order, as
            // `LockName` sorts, whatever the database's collation.
            held: s(format!(
                "SELECT name, fence, expires_at FROM {{table}}_locks
                 WHERE expires_at > {NOW_MS} ORDER BY name COLLATE \"C\" LIMIT $1"
            )),
            // $1 limit. By the server's clock, as every lock decision.
            purge: s(format!(
                "DELETE FROM {{table}}_locks WHERE name = ANY(ARRAY(
                    SELECT name FROM {{table}}_locks WHERE expires_at < {NOW_MS} - {RETENTION_MS}
                    LIMIT $1))
                  AND expires_at < {NOW_MS} - {RETENTION_MS}"
            )),
            channel,
            feed: ReleaseFeed::new(),
        }
    }

    /// Deletes up to `limit` lock rows unused for [`LOCK_STATE_RETENTION`], by the server's
    /// clock.
    pub(crate) async fn purge(&self, c: &mut PgConnection, limit: i64) -> Result<u64, StoreError> {
        let done = sqlx::query(self.purge.clone())
            .bind(limit)
            .execute(c)
            .await
            .map_err(|e| error("cannot purge old locks", e))?;
        Ok(done.rows_affected())
    }
}

fn timestamp(ms: i64) -> Timestamp {
    Timestamp::from_millis(u64::try_from(ms).unwrap_or(0))
}

impl PostgresStore {
    /// Takes PostgreSQL's advisory lock for `name` inside the caller's transaction `tx`,
    /// waiting for it (up to the store's `lock_timeout` on the store's own connections); it is
    /// released when the transaction commits or rolls back.
    ///
    /// For work that is entirely inside that transaction: two transactions holding the same
    /// name never overlap. No lease, no fence: a holder that crashes lets go with its
    /// connection. Names are hashed to the 64-bit key the server locks.
    pub async fn xact_lock(tx: &mut PgConnection, name: &LockName) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(name.as_str())
            .execute(tx)
            .await
            .map_err(|e| error("cannot take the advisory lock", e))?;
        Ok(())
    }

    /// As [`PostgresStore::xact_lock`] without waiting: whether the lock was taken.
    pub async fn try_xact_lock(tx: &mut PgConnection, name: &LockName) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(name.as_str())
            .fetch_one(tx)
            .await
            .map_err(|e| error("cannot take the advisory lock", e))
    }
}

impl LockStore for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        let locks = self.locks();
        let mut c = self.conn().await?;
        let won: Option<(i64, i64)> = sqlx::query_as(locks.acquire.clone())
            .bind(name.as_str())
            .bind(&owner.0[..])
            .bind(sql_int(lease_millis(lease)))
            .fetch_optional(&mut *c)
            .await
            .map_err(|e| error("cannot acquire the lock", e))?;
        if let Some((fence, expires)) = won {
            return Ok(Acquire::Acquired(Held {
                fence: u64::try_from(fence).unwrap_or(0),
                expires_at: timestamp(expires),
            }));
        }
        // Held by another owner. Its lease end is read separately; if it was released in
        // between, the caller simply tries again at once.
        let until: Option<i64> = sqlx::query_scalar(locks.holder.clone())
            .bind(name.as_str())
            .fetch_optional(&mut *c)
            .await
            .map_err(|e| error("cannot read the lock", e))?;
        Ok(Acquire::Busy {
            until: timestamp(until.unwrap_or(0)),
        })
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<Held, LockError> {
        let expires: Option<i64> = sqlx::query_scalar(self.locks().renew.clone())
            .bind(name.as_str())
            .bind(&owner.0[..])
            .bind(sql_int(fence))
            .bind(sql_int(lease_millis(lease)))
            .fetch_optional(self.pool())
            .await
            .map_err(|e| error("cannot renew the lock", e))?;
        let expires = expires.ok_or(LockError::NotOwner)?;
        Ok(Held {
            fence,
            expires_at: timestamp(expires),
        })
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        let locks = self.locks();
        let rows = sqlx::query(locks.release.clone())
            .bind(name.as_str())
            .bind(&owner.0[..])
            .bind(sql_int(fence))
            .bind(&locks.channel)
            .fetch_all(self.pool())
            .await
            .map_err(|e| error("cannot release the lock", e))?;
        if rows.is_empty() {
            return Err(LockError::NotOwner);
        }
        Ok(())
    }

    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(self.locks().held.clone())
            .bind(sql_int(u64::try_from(limit).unwrap_or(u64::MAX)))
            .fetch_all(self.pool())
            .await
            .map_err(|e| error("cannot list the held locks", e))?;
        rows.iter()
            .map(|(name, fence, expires_at)| held_lock(name, *fence, *expires_at))
            .collect::<Result<_, _>>()
            .map(Some)
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let locks = self.locks();
        let listener = locks.feed.listen();
        if let Some(task) = locks.feed.claim() {
            runtime.spawn(run_feed(self.pool().clone(), locks.clone(), task));
        }
        Some(listener)
    }
}

/// Forwards the server's notifications to this process's waiters, reconnecting after failures,
/// until nobody has listened for [`FEED_IDLE`](crate::lock_wakeup::FEED_IDLE).
async fn run_feed(pool: PgPool, locks: PgLocks, mut task: FeedTask) {
    let feed = &locks.feed;
    let mut listener: Option<PgListener> = None;
    loop {
        if task.idle_too_long() {
            return;
        }
        let l = match listener.as_mut() {
            Some(l) => l,
            None => {
                let connected = async {
                    let mut l = PgListener::connect_with(&pool).await?;
                    l.listen(&locks.channel).await?;
                    Ok::<_, sqlx::Error>(l)
                };
                match tokio::time::timeout(Duration::from_secs(5), connected).await {
                    Ok(Ok(l)) => {
                        // Releases sent before this connection listened were missed.
                        feed.send_missed();
                        listener.insert(l)
                    }
                    _ => {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(1), l.try_recv()).await {
            Ok(Ok(Some(n))) => feed.send(Arc::from(n.payload())),
            // The connection was lost; the next call reconnects and listens again.
            Ok(Ok(None)) => feed.send_missed(),
            Ok(Err(_)) => {
                listener = None;
                feed.send_missed();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(_) => {}
        }
    }
}
