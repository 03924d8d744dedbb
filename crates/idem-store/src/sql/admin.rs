//! The operator's view of the SQL server stores ([`RecordAdmin`](idem_core::RecordAdmin)),
//! written once for both dialects.
//!
//! The five states are SQL predicates on `status`, `lease_expires_at` and `expires_at` at a
//! bound `now`, the same definition as [`RecordState::of`]; listing, counting and repairing
//! all use them, so a record is in the state a repair checks exactly when a listing showed it
//! there.
//!
//! A page is read by keyset on the primary key: the rows after the cursor's key in key order,
//! `LIMIT n`, never an offset, so every page costs what the first does. The order is the
//! primary key's (bytes on MySQL, the columns' collation on PostgreSQL), and the cursor's
//! bound compares in the same order, so following cursors visits each row once. A listing
//! narrowed by state or age still walks the key index and skips what does not match: a page of
//! rare records reads past the others.

use std::marker::PhantomData;

use idem_core::{
    BoxFuture, Bytes, Counts, Cursor, Key, Listed, Page, RecordAdmin, RecordFilter, RecordState,
    Repair, Shown, StoreError, Timestamp,
    admin::{RESPONSE_HEAD, key_listing},
};
use sqlx::Pool;

use super::driver::{Driver, Value};
use super::{Dialect, Server, SqlStore, TableName};
use crate::row::sql_int;

/// A statement being written: the values its placeholders take so far, in order (the text is
/// put together by the caller from the placeholders and conditions this hands back).
struct Statement<D> {
    values: Vec<Value>,
    dialect: PhantomData<D>,
}

impl<D: Dialect> Statement<D> {
    fn new() -> Self {
        Self {
            values: Vec::new(),
            dialect: PhantomData,
        }
    }

    /// Binds `value` and answers its placeholder.
    fn bind(&mut self, value: Value) -> String {
        self.values.push(value);
        D::placeholder(self.values.len())
    }

    fn now(&mut self, now: Timestamp) -> String {
        self.bind(Value::Int(sql_int(now.as_millis())))
    }

    /// The condition that a row is in `state` at `now` (as [`RecordState::of`] decides).
    fn state(&mut self, state: RecordState, now: Timestamp) -> String {
        match state {
            RecordState::InProgress => format!(
                "(status = 'in_progress' AND lease_expires_at > {})",
                self.now(now)
            ),
            RecordState::Stuck => format!(
                "(status = 'in_progress' AND lease_expires_at <= {} AND expires_at > {})",
                self.now(now),
                self.now(now)
            ),
            RecordState::Completed => {
                format!("(status = 'completed' AND expires_at > {})", self.now(now))
            }
            RecordState::Released => {
                format!("(status = 'released' AND expires_at > {})", self.now(now))
            }
            RecordState::Expired => format!(
                "(expires_at <= {} AND (status <> 'in_progress' OR lease_expires_at <= {}))",
                self.now(now),
                self.now(now)
            ),
        }
    }

    /// The name of the state a row is in at `now`.
    fn state_name(&mut self, now: Timestamp) -> String {
        let live = [
            RecordState::InProgress,
            RecordState::Stuck,
            RecordState::Completed,
            RecordState::Released,
        ];
        let cases: Vec<String> = live
            .into_iter()
            .map(|s| format!("WHEN {} THEN '{}'", self.state(s, now), s.as_str()))
            .collect();
        format!(
            "CASE {} ELSE '{}' END",
            cases.join(" "),
            RecordState::Expired.as_str()
        )
    }

    /// The conditions of `filter` but its state.
    fn filter(&mut self, filter: &RecordFilter) -> Vec<String> {
        let mut conditions = Vec::new();
        if let Some(scope) = &filter.scope {
            let p = self.bind(Value::Key(scope.as_str().to_owned()));
            conditions.push(format!("scope = {p}"));
        }
        if let Some(namespace) = &filter.namespace {
            let p = self.bind(Value::Key(namespace.as_str().to_owned()));
            conditions.push(format!("namespace = {p}"));
        }
        if let Some(t) = filter.created_before {
            conditions.push(format!("created_at <= {}", self.now(t)));
        }
        if let Some(prefix) = &filter.response_prefix {
            let len = self.bind(Value::Bytes(prefix.to_vec()));
            let head = self.bind(Value::Bytes(prefix.to_vec()));
            conditions.push(format!(
                "status = 'completed'
                 AND substring(response from 1 for octet_length({len})) = {head}"
            ));
        }
        conditions
    }

    /// The condition that a row's key comes after `key`, in the primary key's order.
    fn after(&mut self, key: &Key) -> String {
        let parts = [
            ("scope", key.scope().as_str()),
            ("namespace", key.namespace().as_str()),
            ("client_key", key.client_key().as_str()),
        ];
        if D::ROW_COMPARISON {
            let values: Vec<String> = parts
                .iter()
                .map(|(_, v)| self.bind(Value::Key((*v).to_owned())))
                .collect();
            return format!("(scope, namespace, client_key) > ({})", values.join(", "));
        }
        // a > x OR (a = x AND (b > y OR (b = y AND (c > z)))): a column at a time, each but the
        // last opening two parentheses that close at the end.
        let mut bound = String::new();
        for (i, (column, v)) in parts.iter().enumerate() {
            let greater = self.bind(Value::Key((*v).to_owned()));
            if i + 1 == parts.len() {
                bound.push_str(&format!("{column} > {greater}"));
                bound.push_str(&")".repeat(2 * i));
            } else {
                let equal = self.bind(Value::Key((*v).to_owned()));
                bound.push_str(&format!(
                    "{column} > {greater} OR ({column} = {equal} AND ("
                ));
            }
        }
        format!("({bound})")
    }
}

fn conjunction(conditions: &[String]) -> String {
    if conditions.is_empty() {
        "TRUE".to_owned()
    } else {
        conditions.join(" AND ")
    }
}

/// The columns a listing reads, in [`listed`]'s order: the state is computed by the server,
/// and of the response only its length and head travel.
fn listed_columns<D: Dialect>(s: &mut Statement<D>, now: Timestamp) -> String {
    format!(
        "scope, namespace, client_key, {}, fence, created_at, updated_at, lease_expires_at,
         expires_at, CAST(octet_length(response) AS {}),
         substring(response from 1 for {RESPONSE_HEAD})",
        s.state_name(now),
        D::BIGINT
    )
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("the stored record has a bad {what}"))
}

fn state(name: &str) -> Result<RecordState, StoreError> {
    name.parse().map_err(|_| corrupt("status"))
}

/// A row of [`listed_columns`].
fn listed<D: Driver>(row: &D::Row) -> Result<Listed, StoreError> {
    let bad = |e| StoreError::backend("the records table has an unexpected shape", e);
    let text = |i, key| D::text(row, i, key).map_err(bad);
    let int = |i: usize, what: &str| -> Result<u64, StoreError> {
        let v = D::int(row, i).map_err(bad)?.ok_or_else(|| corrupt(what))?;
        u64::try_from(v).map_err(|_| corrupt(what))
    };
    let at = |i, what| int(i, what).map(Timestamp::from_millis);
    let key = Key::parse(&text(0, true)?, &text(1, true)?, &text(2, true)?)
        .map_err(|_| corrupt("key"))?;
    let response_len = match D::int(row, 9).map_err(bad)? {
        Some(n) => Some(u64::try_from(n).map_err(|_| corrupt("response"))?),
        None => None,
    };
    Ok(Listed {
        key,
        state: state(&text(3, false)?)?,
        fence: int(4, "fence")?,
        created_at: at(5, "creation time")?,
        updated_at: at(6, "update time")?,
        lease_expires_at: at(7, "lease expiry")?,
        expires_at: at(8, "expiry")?,
        response_len,
        response_head: Bytes::from(D::bytes(row, 10).map_err(bad)?.unwrap_or_default()),
    })
}

/// One page of the records in `table` matching `filter` at `now`, after `after`.
async fn list<D: Driver>(
    pool: &Pool<D>,
    table: &TableName,
    filter: &RecordFilter,
    after: Option<&Cursor>,
    limit: usize,
    now: Timestamp,
) -> Result<Page, StoreError> {
    let after = key_listing(filter, after, limit)?;
    let mut s = Statement::<D>::new();
    let columns = listed_columns(&mut s, now);
    let mut conditions = s.filter(filter);
    if let Some(state) = filter.state {
        conditions.push(s.state(state, now));
    }
    if let Some(key) = after {
        conditions.push(s.after(key));
    }
    // The key order, without the columns the filter fixes: MariaDB sorts the rows itself
    // rather than read the index in order when the order names a column fixed to a value.
    let order: Vec<&str> = [
        ("scope", filter.scope.is_some()),
        ("namespace", filter.namespace.is_some()),
        ("client_key", false),
    ]
    .into_iter()
    .filter(|(_, fixed)| !fixed)
    .map(|(column, _)| column)
    .collect();
    let limit_at = s.bind(Value::Int(i64::try_from(limit).unwrap_or(i64::MAX)));
    let text = format!(
        "SELECT {columns} FROM {table} WHERE {} ORDER BY {} LIMIT {limit_at}",
        conjunction(&conditions),
        order.join(", ")
    );
    let rows = D::fetch(pool, text, s.values)
        .await
        .map_err(|e| super::error::<D>("cannot list the records", e))?;
    let records = rows
        .iter()
        .map(listed::<D>)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Page::in_key_order(records, limit))
}

/// The records in `table` passing `filter` (its state ignored) at `now`, by state: one pass
/// that counts each state and finds the oldest attempt.
async fn count<D: Driver>(
    pool: &Pool<D>,
    table: &TableName,
    filter: &RecordFilter,
    now: Timestamp,
) -> Result<Counts, StoreError> {
    let mut s = Statement::<D>::new();
    let mut columns: Vec<String> = RecordState::ALL
        .into_iter()
        .map(|state| format!("COUNT(CASE WHEN {} THEN 1 END)", s.state(state, now)))
        .collect();
    let (running, stuck) = (
        s.state(RecordState::InProgress, now),
        s.state(RecordState::Stuck, now),
    );
    columns.push(format!(
        "MIN(CASE WHEN {running} OR {stuck} THEN created_at END)"
    ));
    let conditions = s.filter(filter);
    let text = format!(
        "SELECT {} FROM {table} WHERE {}",
        columns.join(", "),
        conjunction(&conditions)
    );
    let rows = D::fetch(pool, text, s.values)
        .await
        .map_err(|e| super::error::<D>("cannot count the records", e))?;
    let row = rows
        .first()
        .ok_or_else(|| StoreError::Corrupt("a count without a row".into()))?;
    let bad = |e| StoreError::backend("the records table has an unexpected shape", e);
    let value = |i: usize| -> Result<Option<u64>, StoreError> {
        D::int(row, i)
            .map_err(bad)?
            .map(|v| u64::try_from(v).map_err(|_| corrupt("count")))
            .transpose()
    };
    let n = |i: usize| value(i).map(Option::unwrap_or_default);
    Ok(Counts {
        in_progress: n(0)?,
        stuck: n(1)?,
        completed: n(2)?,
        released: n(3)?,
        expired: n(4)?,
        oldest_in_progress: value(5)?.map(Timestamp::from_millis),
    })
}

/// Applies `repair` to the record under `key` in `table` if it is, at `now`, still what was
/// `shown`: one statement conditioned on the key, the fence and the state, so it lands on that
/// record or on none. A release leaves `purge_after` as it is, as a settle does: `expires_at`
/// moves past it, and a purge waits for both.
async fn repair<D: Driver>(
    pool: &Pool<D>,
    table: &TableName,
    key: &Key,
    shown: Shown,
    repair: Repair,
    now: Timestamp,
) -> Result<bool, StoreError> {
    if !idem_core::repair::may_apply(repair, shown) {
        return Ok(false);
    }
    let mut s = Statement::<D>::new();
    let change = match repair {
        Repair::Release => {
            let (at, from, plus) = (s.now(now), s.now(now), s.now(now));
            format!(
                "UPDATE {table} SET
                     steps = CASE WHEN status = 'completed' THEN NULL ELSE steps END,
                     status = 'released', response = NULL, updated_at = {at},
                     expires_at = LEAST(ttl_ms, 9223372036854775807 - {from}) + {plus}"
            )
        }
        Repair::Delete => format!("DELETE FROM {table}"),
    };
    let scope = s.bind(Value::Key(key.scope().as_str().to_owned()));
    let namespace = s.bind(Value::Key(key.namespace().as_str().to_owned()));
    let client_key = s.bind(Value::Key(key.client_key().as_str().to_owned()));
    let fence = s.bind(Value::Int(sql_int(shown.fence)));
    let state = s.state(shown.state, now);
    let text = format!(
        "{change} WHERE scope = {scope} AND namespace = {namespace} AND client_key = {client_key}
             AND fence = {fence} AND {state}"
    );
    let changed = D::execute(pool, text, s.values)
        .await
        .map_err(|e| super::error::<D>("cannot repair the record", e))?;
    Ok(changed == 1)
}

impl<S: Server> RecordAdmin for SqlStore<S> {
    fn list<'a>(
        &'a self,
        filter: &'a RecordFilter,
        after: Option<&'a Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(list(&self.pool, &self.table, filter, after, limit, now))
    }

    fn count<'a>(
        &'a self,
        filter: &'a RecordFilter,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Counts, StoreError>> {
        Box::pin(count(&self.pool, &self.table, filter, now))
    }

    fn repair<'a>(
        &'a self,
        key: &'a Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self::repair(
            &self.pool,
            &self.table,
            key,
            shown,
            repair,
            now,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound after a key, as each dialect spells it, with the values in placeholder order.
    #[test]
    fn the_bound_after_a_key_follows_the_key_order() {
        let key = Key::parse("s", "n", "c").unwrap_or_else(|e| panic!("{e}"));
        let values = |s: &[Value]| -> Vec<String> {
            s.iter()
                .map(|v| match v {
                    Value::Key(k) => k.clone(),
                    _ => String::new(),
                })
                .collect()
        };
        #[cfg(feature = "mysql")]
        {
            let mut s = Statement::<sqlx::MySql>::new();
            assert_eq!(
                s.after(&key),
                "(scope > ? OR (scope = ? AND (namespace > ? OR (namespace = ? AND \
                 (client_key > ?)))))"
            );
            assert_eq!(values(&s.values), ["s", "s", "n", "n", "c"]);
        }
        #[cfg(feature = "postgres")]
        {
            let mut s = Statement::<sqlx::Postgres>::new();
            s.bind(Value::Int(0));
            assert_eq!(
                s.after(&key),
                "(scope, namespace, client_key) > ($2, $3, $4)"
            );
            assert_eq!(values(&s.values[1..]), ["s", "n", "c"]);
        }
    }
}
