//! Locks by the writer's clock, on a row per lock name in the database file.

use std::time::Duration;

use idem_core::{
    Acquire, Held, HeldLock, LockError, LockName, LockState, LockStore, OwnerDigest,
    ReleaseListener, StoreError, Timestamp,
};
use rusqlite::{OptionalExtension, params};

use crate::row::{held_lock, sql_int};

use super::SqliteStore;

/// A lock operation; it runs by the writer's clock.
pub(super) enum LockOp {
    Acquire(OwnerDigest, Duration),
    Renew(OwnerDigest, u64, Duration),
    Release(OwnerDigest, u64),
}

/// The answer of a [`LockOp`] of the same kind.
pub(super) enum LockAnswer {
    Acquire(Acquire),
    Renew(Held),
    /// Whether the lock was still held.
    Release(bool),
}

/// A lock operation by the writer's clock, on the lock's row.
pub(super) fn apply_lock(
    tx: &rusqlite::Transaction<'_>,
    name: &LockName,
    op: &LockOp,
) -> rusqlite::Result<Result<LockAnswer, LockError>> {
    let now = Timestamp::now();
    let row = tx
        .prepare_cached("SELECT owner, fence, expires_at FROM idem_locks WHERE name = ?1")?
        .query_row([name.as_str()], |row| {
            let owner: Vec<u8> = row.get(0)?;
            let fence: i64 = row.get(1)?;
            let expires_at: i64 = row.get(2)?;
            Ok((owner, fence, expires_at))
        })
        .optional();
    // `None`: no row; `Some(None)`: a row that does not read as a lock's state, which is that
    // lock's corruption, not its batch's failure.
    let mut state = match row {
        Ok(row) => row.map(|(owner, fence, expires_at)| {
            Some(LockState {
                owner: OwnerDigest(owner.try_into().ok()?),
                fence: u64::try_from(fence).ok()?,
                expires_at: Timestamp::from_millis(u64::try_from(expires_at).ok()?),
            })
        }),
        Err(e) if super::records::unreadable(&e) => Some(None),
        Err(e) => return Err(e),
    };
    let Some(current) = state.take() else {
        return Ok(match op {
            LockOp::Acquire(owner, lease) => acquire_lock(tx, name, None, *owner, *lease, now)?,
            _ => Err(LockError::NotOwner),
        });
    };
    let Some(mut current) = current else {
        return Ok(Err(
            StoreError::Corrupt("a lock row is unreadable".into()).into()
        ));
    };
    let answer = match op {
        LockOp::Acquire(owner, lease) => {
            return acquire_lock(tx, name, Some(&current), *owner, *lease, now);
        }
        LockOp::Renew(owner, fence, lease) => current
            .renew(*owner, *fence, *lease, now)
            .map(LockAnswer::Renew),
        LockOp::Release(owner, fence) => current
            .release(*owner, *fence, now)
            .map(LockAnswer::Release),
    };
    if answer.is_ok() {
        save_lock(tx, name, &current)?;
    }
    Ok(answer)
}

fn acquire_lock(
    tx: &rusqlite::Transaction<'_>,
    name: &LockName,
    current: Option<&LockState>,
    owner: OwnerDigest,
    lease: Duration,
    now: Timestamp,
) -> rusqlite::Result<Result<LockAnswer, LockError>> {
    Ok(Ok(LockAnswer::Acquire(
        match LockState::acquire(current, owner, lease, now) {
            Ok(new) => {
                save_lock(tx, name, &new)?;
                Acquire::Acquired(Held {
                    fence: new.fence,
                    expires_at: new.expires_at,
                })
            }
            Err(until) => Acquire::Busy { until },
        },
    )))
}

fn save_lock(
    tx: &rusqlite::Transaction<'_>,
    name: &LockName,
    s: &LockState,
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO idem_locks (name, owner, fence, expires_at) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, fence = excluded.fence,
             expires_at = excluded.expires_at",
    )?
    .execute(params![
        name.as_str(),
        &s.owner.0[..],
        sql_int(s.fence),
        sql_int(s.expires_at.as_millis())
    ])?;
    Ok(())
}

/// Locks by this machine's wall clock, in the database file: processes sharing the file share
/// the locks. Waiters in this process are woken on release; those of other processes notice at
/// their next attempt (see `Locks::poll_interval`).
impl LockStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        match self.lock_op(name, LockOp::Acquire(owner, lease)).await {
            Ok(LockAnswer::Acquire(a)) => Ok(a),
            Err(LockError::Store(e)) => Err(e),
            _ => Err(StoreError::Corrupt("unexpected lock answer".into())),
        }
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<Held, LockError> {
        match self
            .lock_op(name, LockOp::Renew(owner, fence, lease))
            .await?
        {
            LockAnswer::Renew(held) => Ok(held),
            _ => Err(StoreError::Corrupt("unexpected lock answer".into()).into()),
        }
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        match self.lock_op(name, LockOp::Release(owner, fence)).await? {
            LockAnswer::Release(was_held) => {
                if was_held {
                    self.released.send(name.shared());
                }
                Ok(())
            }
            _ => Err(StoreError::Corrupt("unexpected lock answer".into()).into()),
        }
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        Some(self.released.listen())
    }

    /// On the read connection, by this machine's clock, as the writer decides.
    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        let limit = sql_int(u64::try_from(limit).unwrap_or(u64::MAX));
        let held = self
            .listings
            .run(move |conn| {
                let now = sql_int(Timestamp::now().as_millis());
                let mut stmt = conn.prepare_cached(
                    "SELECT name, fence, expires_at FROM idem_locks
                     WHERE expires_at > ?1 ORDER BY name LIMIT ?2",
                )?;
                let rows = stmt
                    .query_map(params![now, limit], |row| {
                        Ok((
                            row.get::<_, String>(0)?,
                            row.get::<_, i64>(1)?,
                            row.get::<_, i64>(2)?,
                        ))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(rows
                    .iter()
                    .map(|(name, fence, expires_at)| held_lock(name, *fence, *expires_at))
                    .collect())
            })
            .await?;
        Ok(Some(held))
    }
}
