//! What each operation on records does inside the writer's transaction: read the record, apply
//! the pure transition from `idem-core`, write the result. `Err` is a SQL failure that aborts
//! the whole batch; refusals and corrupt rows are part of the answer.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, StaleLease, Step, StepError,
    StoreError, Timestamp,
};
use rusqlite::{OptionalExtension, params};

use crate::row::{RawRow, sql_int};

/// The transaction a batch of operations runs in.
type Tx<'c> = rusqlite::Transaction<'c>;

pub(super) fn begin(
    tx: &Tx<'_>,
    req: &BeginRequest,
    now: Timestamp,
) -> rusqlite::Result<Result<BeginOutcome, StoreError>> {
    Ok(match load(tx, &req.key)? {
        Ok(existing) => {
            let step = Record::begin(existing.as_ref(), req, now, idem_core::LeaseId::generate());
            if let Some(new) = &step.write {
                save(tx, new)?;
            }
            Ok(step.outcome)
        }
        Err(e) => Err(e),
    })
}

pub(super) fn complete(
    tx: &Tx<'_>,
    key: &Key,
    lease: &Lease,
    response: &Bytes,
    now: Timestamp,
) -> rusqlite::Result<Result<(), LeaseError>> {
    transition(tx, key, |r| {
        Ok(Record::complete(r, lease, response.clone(), now)?)
    })
}

pub(super) fn release(
    tx: &Tx<'_>,
    key: &Key,
    lease: &Lease,
    now: Timestamp,
) -> rusqlite::Result<Result<(), LeaseError>> {
    transition(tx, key, |r| Ok(Record::release(r, lease, now)?))
}

pub(super) fn record_step(
    tx: &Tx<'_>,
    key: &Key,
    lease: &Lease,
    step: &Step,
    now: Timestamp,
) -> rusqlite::Result<Result<(), StepError>> {
    transition(tx, key, |r| {
        let mut r = r.ok_or(StaleLease)?.clone();
        Ok(r.record_step_in_place(lease, step, now)?.then_some(r))
    })
}

pub(super) fn renew(
    tx: &Tx<'_>,
    key: &Key,
    lease: &Lease,
    length: Duration,
    now: Timestamp,
) -> rusqlite::Result<Result<Lease, LeaseError>> {
    Ok(match load(tx, key)? {
        Ok(Some(mut r)) => match r.renew_in_place(lease, length, now) {
            Ok(renewed) => {
                save(tx, &r)?;
                Ok(renewed)
            }
            Err(stale) => Err(stale.into()),
        },
        Ok(None) => Err(StaleLease.into()),
        Err(e) => Err(e.into()),
    })
}

pub(super) fn advance(
    tx: &Tx<'_>,
    key: &Key,
    by: u64,
) -> rusqlite::Result<Result<u64, StoreError>> {
    // Guarded so the sum never leaves SQLite's integers (it would turn into a float).
    let by = sql_int(by);
    let value: Option<i64> = tx
        .prepare_cached(
            "INSERT INTO idem_counters (scope, namespace, client_key, value)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (scope, namespace, client_key) DO UPDATE
                 SET value = value + excluded.value
                 WHERE value <= 9223372036854775807 - excluded.value
             RETURNING value",
        )?
        .query_row(
            params![
                key.scope().as_str(),
                key.namespace().as_str(),
                key.client_key().as_str(),
                by
            ],
            |row| row.get(0),
        )
        .optional()?;
    Ok(value
        .and_then(|v| u64::try_from(v).ok())
        .ok_or(StoreError::CounterExhausted))
}

pub(super) fn raise(tx: &Tx<'_>, key: &Key, to: u64) -> rusqlite::Result<Result<u64, StoreError>> {
    let value: i64 = tx
        .prepare_cached(
            "INSERT INTO idem_counters (scope, namespace, client_key, value)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (scope, namespace, client_key) DO UPDATE
                 SET value = max(value, excluded.value)
             RETURNING value",
        )?
        .query_row(
            params![
                key.scope().as_str(),
                key.namespace().as_str(),
                key.client_key().as_str(),
                sql_int(to)
            ],
            |row| row.get(0),
        )?;
    Ok(u64::try_from(value).map_err(|_| StoreError::CounterExhausted))
}

pub(super) fn reopen(
    tx: &Tx<'_>,
    key: &Key,
    fence: u64,
    now: Timestamp,
) -> rusqlite::Result<Result<bool, StoreError>> {
    Ok(match load(tx, key)? {
        Ok(Some(mut r)) => {
            let changed = r.reopen_in_place(fence, now);
            if changed {
                save(tx, &r)?;
            }
            Ok(changed)
        }
        Ok(None) => Ok(false),
        Err(e) => Err(e),
    })
}

pub(super) fn get(
    tx: &Tx<'_>,
    key: &Key,
    now: Timestamp,
) -> rusqlite::Result<Result<Option<Record>, StoreError>> {
    Ok(load(tx, key)?.map(|r| r.filter(|r| r.is_live(now))))
}

pub(super) fn purge(
    tx: &Tx<'_>,
    now: Timestamp,
    limit: usize,
) -> rusqlite::Result<Result<u64, StoreError>> {
    let now = sql_int(now.as_millis());
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let n = tx
        .prepare_cached(
            "DELETE FROM idem_records WHERE rowid IN (
                SELECT rowid FROM idem_records
                WHERE expires_at <= ?1 AND (status <> 'in_progress' OR lease_expires_at <= ?1)
                LIMIT ?2)",
        )?
        .execute(params![now, limit])?;
    // Lock rows unused for an hour go with the same budget.
    let rest = limit.saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
    let before = now.saturating_sub(sql_int(idem_core::lock::lease_millis(
        idem_core::lock::LOCK_STATE_RETENTION,
    )));
    let locks = tx
        .prepare_cached(
            "DELETE FROM idem_locks WHERE name IN (
                SELECT name FROM idem_locks WHERE expires_at < ?1 LIMIT ?2)",
        )?
        .execute(params![before, rest])?;
    Ok(Ok((n + locks) as u64))
}

/// Reads the record, applies `f`, writes what it returns: `Ok(None)` is a repeat that changes
/// nothing.
fn transition<E: From<StoreError>>(
    tx: &rusqlite::Transaction<'_>,
    key: &Key,
    f: impl FnOnce(Option<&Record>) -> Result<Option<Record>, E>,
) -> rusqlite::Result<Result<(), E>> {
    let existing = match load(tx, key)? {
        Ok(r) => r,
        Err(e) => return Ok(Err(e.into())),
    };
    match f(existing.as_ref()) {
        Ok(Some(new)) => {
            save(tx, &new)?;
            Ok(Ok(()))
        }
        Ok(None) => Ok(Ok(())),
        Err(refused) => Ok(Err(refused)),
    }
}

/// Whether `e` says a row's column holds a value of another type (a row another program
/// wrote): that row is corrupt; the statement and the database are fine.
pub(super) fn unreadable(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
    )
}

pub(super) fn load(
    tx: &rusqlite::Connection,
    key: &Key,
) -> rusqlite::Result<Result<Option<Record>, StoreError>> {
    let mut stmt = tx.prepare_cached(
        "SELECT fingerprint, status, fence, lease_id, lease_expires_at, response, ttl_ms,
                created_at, updated_at, expires_at, steps
         FROM idem_records WHERE scope = ?1 AND namespace = ?2 AND client_key = ?3",
    )?;
    let row = stmt
        .query_row(
            params![
                key.scope().as_str(),
                key.namespace().as_str(),
                key.client_key().as_str()
            ],
            |row| {
                Ok(RawRow {
                    fingerprint: row.get(0)?,
                    status: row.get(1)?,
                    fence: row.get(2)?,
                    lease_id: row.get(3)?,
                    lease_expires_at: row.get(4)?,
                    response: row.get(5)?,
                    ttl_ms: row.get(6)?,
                    created_at: row.get(7)?,
                    updated_at: row.get(8)?,
                    expires_at: row.get(9)?,
                    steps: row.get(10)?,
                })
            },
        )
        .optional();
    let row = match row {
        Ok(row) => row,
        // This record is corrupt, which is its caller's answer, not a reason to fail every
        // other record of the batch.
        Err(e) if unreadable(&e) => {
            return Ok(Err(StoreError::Corrupt(format!(
                "a stored record does not read: {e}"
            ))));
        }
        Err(e) => return Err(e),
    };
    Ok(row.map(|raw| raw.into_record(key)).transpose())
}

/// The steps as the column holds them: `NULL` for none.
fn steps_column(steps: &[idem_core::Step]) -> Option<Vec<u8>> {
    (!steps.is_empty()).then(|| idem_core::step::encode(steps))
}

pub(super) fn save(tx: &rusqlite::Transaction<'_>, r: &Record) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO idem_records (scope, namespace, client_key, fingerprint, status, fence,
             lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at, expires_at,
             steps)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
         ON CONFLICT (scope, namespace, client_key) DO UPDATE SET
             fingerprint = excluded.fingerprint, status = excluded.status,
             fence = excluded.fence, lease_id = excluded.lease_id,
             lease_expires_at = excluded.lease_expires_at, response = excluded.response,
             ttl_ms = excluded.ttl_ms, created_at = excluded.created_at,
             updated_at = excluded.updated_at, expires_at = excluded.expires_at,
             steps = excluded.steps",
    )?
    .execute(params![
        r.key.scope().as_str(),
        r.key.namespace().as_str(),
        r.key.client_key().as_str(),
        &r.fingerprint.as_bytes()[..],
        r.status.as_str(),
        sql_int(r.fence),
        &r.lease_id.to_bytes()[..],
        sql_int(r.lease_expires_at.as_millis()),
        r.response.as_deref(),
        sql_int(r.ttl_ms),
        sql_int(r.created_at.as_millis()),
        sql_int(r.updated_at.as_millis()),
        sql_int(r.expires_at.as_millis()),
        steps_column(&r.steps),
    ])?;
    Ok(())
}
