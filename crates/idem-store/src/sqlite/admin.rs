//! The operator's view of a [`SqliteStore`]: listing, counting and fenced repairs.
//!
//! Listings page through the key index (`scope, namespace, client_key`) by the last key shown,
//! never by an offset, so every page costs what the first does. Listings and counts run on a
//! read connection of their own, on its own thread, started at the first of them: in WAL mode
//! a reader never holds up the writer, however long a count over a large table takes. Repairs
//! are writes: they go through the writer, in its transaction, serialized with `begin` and
//! `complete`, and check the record's state and fence in the same transaction.

use std::cmp::Ordering;

use idem_core::admin::{RESPONSE_HEAD, key_listing};
use idem_core::{
    BoxFuture, Bytes, Counts, Cursor, Key, Listed, Page, RecordAdmin, RecordFilter, RecordState,
    Repair, Shown, StoreError, Timestamp,
};
use rusqlite::types::Value;
use rusqlite::{Connection, ToSql, named_params};

use crate::row::sql_int;

use super::SqliteStore;
use super::records::{load, save};

/// A record's state at `:now` in SQL, as its place in `RecordState::ALL` (0 in progress,
/// 1 stuck, 2 completed, 3 released, 4 expired; a number, which a count compares faster than a
/// name): the one definition that listings filter and show by, counts count by and deletions
/// check. It agrees with `RecordState::of`.
macro_rules! state_sql {
    () => {
        "CASE
            WHEN status = 'in_progress' AND lease_expires_at > :now THEN 0
            WHEN expires_at <= :now THEN 4
            WHEN status = 'in_progress' THEN 1
            WHEN status = 'completed' THEN 2
            ELSE 3
        END"
    };
}

/// A state as [`state_sql!`] numbers it.
fn state_code(state: RecordState) -> i64 {
    RecordState::ALL
        .iter()
        .position(|s| *s == state)
        .and_then(|i| i64::try_from(i).ok())
        .unwrap_or(-1)
}

/// A `WHERE` clause built from the parts of a filter that are set, with its named parameters.
struct Query {
    clauses: Vec<&'static str>,
    params: Vec<(&'static str, Value)>,
}

impl Query {
    fn new(now: Timestamp) -> Self {
        Self {
            clauses: Vec::new(),
            params: vec![(":now", Value::Integer(sql_int(now.as_millis())))],
        }
    }

    fn and<const N: usize>(&mut self, clause: &'static str, params: [(&'static str, Value); N]) {
        self.clauses.push(clause);
        self.params.extend(params);
    }

    fn where_sql(&self) -> String {
        if self.clauses.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", self.clauses.join(" AND "))
        }
    }

    fn params(&self) -> Vec<(&str, &dyn ToSql)> {
        self.params
            .iter()
            .map(|(name, value)| (*name, value as &dyn ToSql))
            .collect()
    }

    /// Narrows to the filter's scope and namespace and to the keys after `after`, in terms the
    /// key index answers in key order (an equality on a leading column, then a range). `false`
    /// when no key after `after` can match.
    fn keys(&mut self, filter: &RecordFilter, after: Option<&Key>) -> bool {
        let text = |s: &str| Value::Text(s.to_owned());
        match (&filter.scope, &filter.namespace) {
            (Some(scope), Some(namespace)) => {
                self.and(
                    "scope = :scope AND namespace = :namespace",
                    [
                        (":scope", text(scope.as_str())),
                        (":namespace", text(namespace.as_str())),
                    ],
                );
                if let Some(a) = after {
                    match (a.scope(), a.namespace()).cmp(&(scope, namespace)) {
                        Ordering::Less => {}
                        Ordering::Equal => self.and(
                            "client_key > :after_key",
                            [(":after_key", text(a.client_key().as_str()))],
                        ),
                        Ordering::Greater => return false,
                    }
                }
            }
            (Some(scope), None) => {
                self.and("scope = :scope", [(":scope", text(scope.as_str()))]);
                if let Some(a) = after {
                    match a.scope().cmp(scope) {
                        Ordering::Less => {}
                        Ordering::Equal => self.and(
                            "(namespace, client_key) > (:after_namespace, :after_key)",
                            [
                                (":after_namespace", text(a.namespace().as_str())),
                                (":after_key", text(a.client_key().as_str())),
                            ],
                        ),
                        Ordering::Greater => return false,
                    }
                }
            }
            (None, namespace) => {
                if let Some(a) = after {
                    self.and(
                        "(scope, namespace, client_key) > (:after_scope, :after_namespace, :after_key)",
                        [
                            (":after_scope", text(a.scope().as_str())),
                            (":after_namespace", text(a.namespace().as_str())),
                            (":after_key", text(a.client_key().as_str())),
                        ],
                    );
                }
                if let Some(namespace) = namespace {
                    // `+`: a test on each row, not an index constraint, with which SQLite
                    // would sort each scope's rows rather than read them in index order.
                    self.and(
                        "+namespace = :namespace",
                        [(":namespace", text(namespace.as_str()))],
                    );
                }
            }
        }
        true
    }

    /// Narrows to the filter's age and response prefix, and to its state if `with_state`.
    fn rest(&mut self, filter: &RecordFilter, with_state: bool) {
        if let Some(before) = filter.created_before {
            self.and(
                "created_at <= :created_before",
                [(
                    ":created_before",
                    Value::Integer(sql_int(before.as_millis())),
                )],
            );
        }
        if let Some(prefix) = &filter.response_prefix {
            self.and(
                "status = 'completed' AND substr(response, 1, length(:prefix)) = :prefix",
                [(":prefix", Value::Blob(prefix.to_vec()))],
            );
        }
        if let (true, Some(state)) = (with_state, filter.state) {
            self.and(
                concat!(state_sql!(), " = :state"),
                [(":state", Value::Integer(state_code(state)))],
            );
        }
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("a stored record has a bad {what}"))
}

/// `N` integer columns from `first` on, each `None` if it is negative.
fn uints<const N: usize>(
    row: &rusqlite::Row<'_>,
    first: usize,
) -> rusqlite::Result<[Option<u64>; N]> {
    let mut out = [None; N];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = u64::try_from(row.get::<_, i64>(first + i)?).ok();
    }
    Ok(out)
}

/// One row of a listing, as selected by [`list_page`].
fn listed(row: &rusqlite::Row<'_>) -> rusqlite::Result<Result<Listed, StoreError>> {
    let scope: String = row.get(0)?;
    let namespace: String = row.get(1)?;
    let client_key: String = row.get(2)?;
    let state: i64 = row.get(3)?;
    let numbers: [Option<u64>; 5] = uints(row, 4)?;
    let response_len: Option<i64> = row.get(9)?;
    let response_head: Option<Vec<u8>> = row.get(10)?;
    Ok((|| {
        let key = Key::parse(&scope, &namespace, &client_key).map_err(|_| corrupt("key"))?;
        let state = usize::try_from(state)
            .ok()
            .and_then(|i| RecordState::ALL.get(i).copied())
            .ok_or_else(|| corrupt("status"))?;
        let [fence, created_at, updated_at, lease_expires_at, expires_at] =
            numbers.map(|v| v.ok_or_else(|| corrupt("number")));
        let ts = |v: Result<u64, StoreError>| v.map(Timestamp::from_millis);
        Ok(Listed {
            key,
            state,
            fence: fence?,
            created_at: ts(created_at)?,
            updated_at: ts(updated_at)?,
            lease_expires_at: ts(lease_expires_at)?,
            expires_at: ts(expires_at)?,
            response_len: response_len
                .map(|n| u64::try_from(n).map_err(|_| corrupt("response")))
                .transpose()?,
            response_head: response_head.map(Bytes::from).unwrap_or_default(),
        })
    })())
}

fn list_page(
    conn: &Connection,
    query: &Query,
    limit: usize,
) -> rusqlite::Result<Result<Page, StoreError>> {
    // The key index gives the order, so a page reads its rows and stops (`INDEXED BY` keeps
    // the planner from sorting a whole table for a filter it could answer by another index).
    let sql = format!(
        "SELECT scope, namespace, client_key, {state}, fence, created_at, updated_at,
                lease_expires_at, expires_at, length(response),
                substr(response, 1, {RESPONSE_HEAD})
         FROM idem_records INDEXED BY idem_records_key {where_sql}
         ORDER BY scope, namespace, client_key LIMIT :limit",
        state = state_sql!(),
        where_sql = query.where_sql(),
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let limit_value = Value::Integer(i64::try_from(limit).unwrap_or(i64::MAX));
    let mut params = query.params();
    params.push((":limit", &limit_value));
    let mut rows = stmt.query(params.as_slice())?;
    let mut records = Vec::with_capacity(limit);
    while let Some(row) = rows.next()? {
        match listed(row)? {
            Ok(l) => records.push(l),
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Ok(Page::in_key_order(records, limit)))
}

fn count_states(conn: &Connection, query: &Query) -> rusqlite::Result<Result<Counts, StoreError>> {
    // One pass over the rows; the states in `RecordState::ALL` order. `LIMIT -1` keeps SQLite
    // from folding the inner query into the outer one, which would work out the state once
    // for every reference to it rather than once a row.
    let sql = format!(
        "SELECT count(*) FILTER (WHERE s = 0), count(*) FILTER (WHERE s = 1),
                count(*) FILTER (WHERE s = 2), count(*) FILTER (WHERE s = 3),
                count(*) FILTER (WHERE s = 4), min(created_at) FILTER (WHERE s <= 1)
         FROM (SELECT {state} AS s, created_at FROM idem_records {where_sql} LIMIT -1)",
        state = state_sql!(),
        where_sql = query.where_sql(),
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let (counts, oldest) = stmt.query_row(query.params().as_slice(), |row| {
        let counts: [Option<u64>; 5] = uints(row, 0)?;
        let oldest: Option<i64> = row.get(5)?;
        Ok((counts, oldest))
    })?;
    let [in_progress, stuck, completed, released, expired] = counts.map(|n| n.unwrap_or(0));
    let oldest_in_progress = match oldest.map(u64::try_from).transpose() {
        Ok(t) => t.map(Timestamp::from_millis),
        Err(_) => return Ok(Err(corrupt("creation time"))),
    };
    Ok(Ok(Counts {
        in_progress,
        stuck,
        completed,
        released,
        expired,
        oldest_in_progress,
    }))
}

/// A repair inside the writer's transaction: applied only if the record is, at `now`, still
/// what was `shown` and the repair applies to that state. Answers whether it changed anything.
pub(super) fn apply_repair(
    tx: &rusqlite::Transaction<'_>,
    key: &Key,
    shown: Shown,
    repair: Repair,
    now: Timestamp,
) -> rusqlite::Result<Result<bool, StoreError>> {
    if !idem_core::repair::may_apply(repair, shown) {
        return Ok(Ok(false));
    }
    match repair {
        Repair::Release => match load(tx, key)? {
            Ok(Some(record)) if idem_core::repair::applies(repair, shown, &record, now) => {
                save(tx, &Repair::released(record, now))?;
                Ok(Ok(true))
            }
            Ok(_) => Ok(Ok(false)),
            Err(e) => Ok(Err(e)),
        },
        // Checked in SQL, by the state a listing shows: a record whose row no longer reads as
        // a record (a corrupt one) can still be deleted.
        Repair::Delete => {
            let deleted = tx
                .prepare_cached(concat!(
                    "DELETE FROM idem_records
                     WHERE scope = :scope AND namespace = :namespace AND client_key = :key
                         AND fence = :fence AND ",
                    state_sql!(),
                    " = :state"
                ))?
                .execute(named_params! {
                    ":scope": key.scope().as_str(),
                    ":namespace": key.namespace().as_str(),
                    ":key": key.client_key().as_str(),
                    ":fence": sql_int(shown.fence),
                    ":state": state_code(shown.state),
                    ":now": sql_int(now.as_millis()),
                })?;
            Ok(Ok(deleted > 0))
        }
    }
}

impl RecordAdmin for SqliteStore {
    fn list<'a>(
        &'a self,
        filter: &'a RecordFilter,
        after: Option<&'a Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            let after = key_listing(filter, after, limit)?;
            let mut query = Query::new(now);
            if !query.keys(filter, after) {
                return Ok(Page::default());
            }
            query.rest(filter, true);
            self.listings
                .run(move |conn| list_page(conn, &query, limit))
                .await
        })
    }

    fn count<'a>(
        &'a self,
        filter: &'a RecordFilter,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Counts, StoreError>> {
        Box::pin(async move {
            let mut query = Query::new(now);
            query.keys(filter, None);
            query.rest(filter, false);
            self.listings
                .run(move |conn| count_states(conn, &query))
                .await
        })
    }

    fn repair<'a>(
        &'a self,
        key: &'a Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.repair_record(key, shown, repair, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Namespace, Scope};

    /// Every shape of listing reads the key index in order and stops: no sort, no other index.
    #[test]
    fn every_listing_reads_the_key_index_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("idem.db")).unwrap();
        let conn = Connection::open(store.path()).unwrap();
        let key = Key::parse("s", "n", "k").unwrap();
        let now = Timestamp::from_millis(1);
        let scopes = [None, Some(Scope::new("s").unwrap())];
        let namespaces = [None, Some(Namespace::new("n").unwrap())];
        for scope in &scopes {
            for namespace in &namespaces {
                for after in [None, Some(&key)] {
                    let filter = RecordFilter {
                        scope: scope.clone(),
                        namespace: namespace.clone(),
                        state: Some(RecordState::Expired),
                        created_before: Some(now),
                        response_prefix: Some(Bytes::from_static(b"x")),
                    };
                    let mut query = Query::new(now);
                    assert!(query.keys(&filter, after));
                    query.rest(&filter, true);
                    let sql = format!(
                        "EXPLAIN QUERY PLAN SELECT scope FROM idem_records
                         INDEXED BY idem_records_key {}
                         ORDER BY scope, namespace, client_key LIMIT 10",
                        query.where_sql()
                    );
                    let mut stmt = conn.prepare(&sql).unwrap();
                    let plan: Vec<String> = stmt
                        .query_map(query.params().as_slice(), |row| row.get(3))
                        .unwrap()
                        .collect::<Result<_, _>>()
                        .unwrap();
                    let plan = plan.join("; ");
                    assert!(
                        !plan.contains("B-TREE"),
                        "{filter:?} after {after:?}: {plan}"
                    );
                    if scope.is_some() || after.is_some() {
                        assert!(
                            plan.contains("SEARCH"),
                            "{filter:?} after {after:?}: {plan}"
                        );
                    }
                    if after.is_some() {
                        // The cursor bounds the index range, not each row.
                        assert!(plan.contains('>'), "{filter:?} after {after:?}: {plan}");
                    }
                }
            }
        }
    }
}
