//! Guards for business tables: the seeds' in-table idempotency schemes with typed outcomes,
//! never a bare row count.
//!
//! Done by hand, these schemes go wrong in familiar ways: "0 rows affected" taken for success
//! when the row had moved to another state (a coupon that expired is not a coupon already
//! held), a transition nobody meant to allow, a lost update. Each guard here is one
//! conditional statement that the database applies atomically per row; when it changes
//! nothing, the row is read to say exactly why.
//!
//! - [`StateMachine`]: states and allowed edges declared once; a transition answers
//!   [`Transition::Applied`], [`Transition::AlreadyThere`], [`Transition::Conflict`] with the
//!   current state, or [`Transition::NotFound`]; an edge not in the graph is refused before any
//!   SQL runs.
//! - [`Versioned`]: optimistic locking (`version = version + 1 WHERE version = :v`):
//!   [`Cas::Applied`] with the new version, [`Cas::Conflict`] with the current one, or
//!   [`Cas::NotFound`].
//! - [`UniqueInsert`]: insert-or-replay on a unique key: [`Inserted::New`] with the row, or
//!   [`Inserted::Existing`] with the row that was there (one account per user), safe under
//!   concurrent callers, the duplicate told by the database's own means, never by an error
//!   message.
//! - [`Bounded`]: a conditional decrement or increment that never crosses a bound
//!   (`avail - n >= 0`): [`Bounded::Applied`] with the new value, [`Bounded::Insufficient`] or
//!   [`Bounded::Exceeded`] with the current one, or [`Bounded::NotFound`].
//!
//! Every guard runs on a connection or transaction of PostgreSQL (`*_pg`), MySQL/MariaDB
//! (`*_mysql`) or SQLite (`*_sqlite`), so it composes with the caller's other writes; run it in
//! the same transaction as the idempotency record's completion (`PostgresStore::complete_in`,
//! `MySqlStore::complete_in`) and a retry replays its outcome (every outcome is `Serialize`).

// Without a database feature the guards' statements have no backend to run them.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code, unused_imports, unused_macros)
)]

mod backends;

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A value a guard binds or reads back: a key, a state, a column value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    /// An integer (`BIGINT`).
    Int(i64),
    /// Text.
    Text(String),
}

impl Scalar {
    /// Column `index` of `row`: an integer of any width, or text. `NULL`, or a value of
    /// another type, is [`GuardError::UnreadableValue`].
    pub fn read<R: sqlx::Row>(row: &R, index: usize) -> Result<Self, GuardError>
    where
        for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> i16: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        usize: sqlx::ColumnIndex<R>,
    {
        if row
            .try_get_raw(index)
            .map_or(true, |v| sqlx::ValueRef::is_null(&v))
        {
            return Err(GuardError::UnreadableValue);
        }
        if let Ok(v) = row.try_get::<i64, _>(index) {
            return Ok(Scalar::Int(v));
        }
        if let Ok(v) = row.try_get::<i32, _>(index) {
            return Ok(Scalar::Int(v.into()));
        }
        if let Ok(v) = row.try_get::<i16, _>(index) {
            return Ok(Scalar::Int(v.into()));
        }
        row.try_get::<String, _>(index)
            .map(Scalar::Text)
            .map_err(|_| GuardError::UnreadableValue)
    }
}

impl From<i64> for Scalar {
    fn from(v: i64) -> Self {
        Scalar::Int(v)
    }
}

impl From<i32> for Scalar {
    fn from(v: i32) -> Self {
        Scalar::Int(v.into())
    }
}

impl From<&str> for Scalar {
    fn from(v: &str) -> Self {
        Scalar::Text(v.to_owned())
    }
}

impl From<String> for Scalar {
    fn from(v: String) -> Self {
        Scalar::Text(v)
    }
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Int(v) => write!(f, "{v}"),
            Scalar::Text(v) => write!(f, "{v:?}"),
        }
    }
}

/// Why a guard could not give an outcome.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError {
    /// The transition is not an edge of the declared graph; no SQL ran.
    #[error("the transition {from} → {to} is not declared")]
    UndeclaredTransition {
        /// The state it would leave.
        from: Scalar,
        /// The state it would enter.
        to: Scalar,
    },
    /// A table or column name that is not a plain identifier, or a graph that names a state it
    /// does not declare.
    #[error("invalid guard definition: {0}")]
    Definition(String),
    /// More than one row matched the key: the key column is not unique. The statement's
    /// changes are in the caller's transaction (roll it back), or already committed on a
    /// connection outside one.
    #[error("the key matched {0} rows: the key column must be unique")]
    NotUnique(u64),
    /// A row's value has a type the guard does not read (not an integer or text).
    #[error("the column's value is neither an integer nor text")]
    UnreadableValue,
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// A table or column name safe to put into SQL text: ASCII letters, digits and `_` (and one
/// `.` for a schema), not starting with a digit, at most 63 characters per part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ident(String);

impl Ident {
    /// Checks `name`.
    pub fn new(name: &str) -> Result<Self, GuardError> {
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 63
                && !p.starts_with(|c: char| c.is_ascii_digit())
                && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| part_ok(p)) {
            return Err(GuardError::Definition(format!(
                "{name:?} is not a plain identifier (letters, digits and _, optionally schema.name)"
            )));
        }
        Ok(Self(name.to_owned()))
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a guarded row is: its table and the unique key column that finds it.
#[derive(Debug, Clone)]
struct Row {
    table: Ident,
    key: Ident,
}

impl Row {
    fn new(table: &str, key: &str) -> Result<Self, GuardError> {
        Ok(Self {
            table: Ident::new(table)?,
            key: Ident::new(key)?,
        })
    }

    /// `SELECT {column} FROM {table} WHERE {key} = ?`
    fn read(&self, column: &Ident) -> String {
        format!("SELECT {column} FROM {} WHERE {} = ?", self.table, self.key)
    }
}

/// The outcome of a state transition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "state", rename_all = "snake_case")]
pub enum Transition {
    /// The row was in the `from` state and is now in `to`.
    Applied,
    /// The row was already in `to`: nothing changed. The guard cannot tell which request put
    /// it there; behind an idempotency record a repeated request never gets here, so this
    /// usually means another request did.
    AlreadyThere,
    /// The row is in another state, which this transition does not start from (a coupon that
    /// expired meanwhile): nothing changed.
    Conflict(Scalar),
    /// No row has this key.
    NotFound,
}

/// A state column whose states and allowed transitions are declared once.
///
/// ```
/// use idem_guard::StateMachine;
///
/// let coupons = StateMachine::new("coupon_instance", "coupon_id", "status")?
///     .states([1, 2, 3, 4])   // available, held, expired, used
///     .edge(1, 2)?            // hold
///     .edge(2, 4)?            // use
///     .edge(2, 1)?            // give back
///     .edge(1, 3)?;           // expire
/// assert!(coupons.allows(&1.into(), &2.into()));
/// assert!(!coupons.allows(&3.into(), &2.into()));
/// # Ok::<(), idem_guard::GuardError>(())
/// ```
#[derive(Debug, Clone)]
pub struct StateMachine {
    row: Row,
    column: Ident,
    states: BTreeSet<Scalar>,
    edges: BTreeSet<(Scalar, Scalar)>,
}

impl StateMachine {
    /// The state column `column` of `table`, whose rows `key` (a unique column) finds.
    pub fn new(table: &str, key: &str, column: &str) -> Result<Self, GuardError> {
        Ok(Self {
            row: Row::new(table, key)?,
            column: Ident::new(column)?,
            states: BTreeSet::new(),
            edges: BTreeSet::new(),
        })
    }

    /// Declares states.
    #[must_use]
    pub fn states<S: Into<Scalar>>(mut self, states: impl IntoIterator<Item = S>) -> Self {
        self.states.extend(states.into_iter().map(Into::into));
        self
    }

    /// Declares the transition `from → to` between two declared states.
    pub fn edge(
        mut self,
        from: impl Into<Scalar>,
        to: impl Into<Scalar>,
    ) -> Result<Self, GuardError> {
        let (from, to) = (from.into(), to.into());
        for s in [&from, &to] {
            if !self.states.contains(s) {
                return Err(GuardError::Definition(format!(
                    "the edge names state {s}, which is not declared"
                )));
            }
        }
        self.edges.insert((from, to));
        Ok(self)
    }

    /// Whether `from → to` is declared.
    pub fn allows(&self, from: &Scalar, to: &Scalar) -> bool {
        self.edges.contains(&(from.clone(), to.clone()))
    }

    fn check(&self, from: &Scalar, to: &Scalar) -> Result<(), GuardError> {
        if self.allows(from, to) {
            Ok(())
        } else {
            Err(GuardError::UndeclaredTransition {
                from: from.clone(),
                to: to.clone(),
            })
        }
    }

    /// `UPDATE … SET state = ? WHERE key = ? AND state = ?`
    fn update_sql(&self) -> String {
        let (t, k, c) = (&self.row.table, &self.row.key, &self.column);
        format!("UPDATE {t} SET {c} = ? WHERE {k} = ? AND {c} = ?")
    }

    /// What a changed-nothing update means, from the row's current state.
    fn explain(to: &Scalar, current: Option<Scalar>) -> Transition {
        match current {
            None => Transition::NotFound,
            Some(s) if &s == to => Transition::AlreadyThere,
            Some(s) => Transition::Conflict(s),
        }
    }
}

/// The outcome of an insert-or-replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "row", rename_all = "snake_case")]
pub enum Inserted<T> {
    /// The row was inserted; here it is as stored.
    New(T),
    /// A row with the same unique key was there already (inserted by an earlier attempt of the
    /// same request, or by a concurrent one); here it is, unchanged.
    Existing(T),
}

impl<T> Inserted<T> {
    /// The row, new or existing.
    pub fn into_row(self) -> T {
        match self {
            Inserted::New(row) | Inserted::Existing(row) => row,
        }
    }
}

/// Insert-or-replay on a unique key: the seeds' "insert and catch the duplicate", done so that
/// the duplicate is recognised by the database's own means (`ON CONFLICT DO NOTHING` in
/// PostgreSQL and SQLite, error number 1062 in MySQL/MariaDB), and the caller always gets a
/// row back.
///
/// ```
/// use idem_guard::UniqueInsert;
///
/// // One fund account per user: `UNIQUE (user_id)`.
/// let accounts = UniqueInsert::new("fund_account", &["user_id"], &["user_id", "currency"])?;
/// # Ok::<(), idem_guard::GuardError>(())
/// ```
#[derive(Debug, Clone)]
pub struct UniqueInsert {
    table: Ident,
    key: Vec<Ident>,
    columns: Vec<Ident>,
    /// Where each key column is among the inserted columns.
    key_at: Vec<usize>,
}

impl UniqueInsert {
    /// Inserts `columns` into `table`, whose unique key is `key` (columns among `columns`).
    pub fn new(table: &str, key: &[&str], columns: &[&str]) -> Result<Self, GuardError> {
        let columns: Vec<Ident> = columns
            .iter()
            .map(|c| Ident::new(c))
            .collect::<Result<_, _>>()?;
        let key: Vec<Ident> = key
            .iter()
            .map(|c| Ident::new(c))
            .collect::<Result<_, _>>()?;
        if key.is_empty() {
            return Err(GuardError::Definition(
                "the unique key needs a column".into(),
            ));
        }
        let key_at = key
            .iter()
            .map(|k| {
                columns.iter().position(|c| c == k).ok_or_else(|| {
                    GuardError::Definition(format!("the key column {k} is not inserted"))
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            table: Ident::new(table)?,
            key,
            columns,
            key_at,
        })
    }

    /// `INSERT INTO t (a, b) VALUES (?, ?)` and what follows it.
    fn insert_sql(&self, tail: &str) -> String {
        let cols: Vec<String> = self.columns.iter().map(ToString::to_string).collect();
        let marks = vec!["?"; cols.len()].join(", ");
        format!(
            "INSERT INTO {} ({}) VALUES ({marks}){tail}",
            self.table,
            cols.join(", ")
        )
    }

    /// `SELECT * FROM t WHERE k1 = ? AND k2 = ?` and what follows it.
    fn select_sql(&self, tail: &str) -> String {
        let cond: Vec<String> = self.key.iter().map(|k| format!("{k} = ?")).collect();
        format!(
            "SELECT * FROM {} WHERE {}{tail}",
            self.table,
            cond.join(" AND ")
        )
    }

    fn check_values(&self, values: &[Scalar]) -> Result<(), GuardError> {
        if values.len() == self.columns.len() {
            Ok(())
        } else {
            Err(GuardError::Definition(format!(
                "{} values for {} columns",
                values.len(),
                self.columns.len()
            )))
        }
    }
}

/// The outcome of a compare-and-set on a version column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "version", rename_all = "snake_case")]
pub enum Cas {
    /// The row had the expected version; it now has this one (expected + 1).
    Applied(i64),
    /// The row has another version (someone else updated it): nothing changed.
    Conflict(i64),
    /// No row has this key.
    NotFound,
}

/// Optimistic locking on a version column: an update applies only to the version the caller
/// read, and moves it on by one.
#[derive(Debug, Clone)]
pub struct Versioned {
    row: Row,
    version: Ident,
}

impl Versioned {
    /// The version column `version` of `table`, whose rows `key` (a unique column) finds.
    pub fn new(table: &str, key: &str, version: &str) -> Result<Self, GuardError> {
        Ok(Self {
            row: Row::new(table, key)?,
            version: Ident::new(version)?,
        })
    }

    /// `UPDATE … SET a = ?, b = ?, version = version + 1 WHERE key = ? AND version = ?`
    fn update_sql(&self, columns: &[Ident]) -> String {
        let (t, k, v) = (&self.row.table, &self.row.key, &self.version);
        let sets: String = columns.iter().map(|c| format!("{c} = ?, ")).collect();
        format!("UPDATE {t} SET {sets}{v} = {v} + 1 WHERE {k} = ? AND {v} = ?")
    }

    fn columns(sets: &[(&str, Scalar)]) -> Result<Vec<Ident>, GuardError> {
        sets.iter().map(|(c, _)| Ident::new(c)).collect()
    }
}

/// The outcome of a bounded change of a counter column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "value", rename_all = "snake_case")]
pub enum Bounded {
    /// Changed; the new value (what remains, for a decrement).
    Applied(i64),
    /// A decrement would go below the floor; the current value. Nothing changed.
    Insufficient(i64),
    /// An increment would go above the ceiling; the current value. Nothing changed.
    Exceeded(i64),
    /// No row has this key.
    NotFound,
}

/// A counter column that a change never takes below a floor (default 0) or above a ceiling
/// (default none): stock, seats, a balance.
#[derive(Debug, Clone)]
pub struct Counter {
    row: Row,
    column: Ident,
    floor: i64,
    ceiling: i64,
}

impl Counter {
    /// The counter column `column` of `table`, whose rows `key` (a unique column) finds; floor
    /// 0, no ceiling.
    pub fn new(table: &str, key: &str, column: &str) -> Result<Self, GuardError> {
        Ok(Self {
            row: Row::new(table, key)?,
            column: Ident::new(column)?,
            floor: 0,
            ceiling: i64::MAX,
        })
    }

    /// The lowest value a change may leave.
    #[must_use]
    pub fn floor(mut self, floor: i64) -> Self {
        self.floor = floor;
        self
    }

    /// The highest value a change may leave.
    #[must_use]
    pub fn ceiling(mut self, ceiling: i64) -> Self {
        self.ceiling = ceiling;
        self
    }

    /// `UPDATE … SET c = c + ? WHERE key = ? AND c + ? BETWEEN floor AND ceiling`, written so
    /// that neither side can overflow: `c >= floor - delta` for a decrement and
    /// `c <= ceiling - delta` for an increment. `wrap` wraps the new value (MySQL's
    /// `LAST_INSERT_ID(…)`, which hands it back without a second read).
    fn update_sql(&self, delta: i64, wrap: fn(&str) -> String) -> Option<String> {
        let (t, k, c) = (&self.row.table, &self.row.key, &self.column);
        let bound = if delta < 0 {
            // floor - delta overflows only for a floor near i64::MAX: then no decrement fits.
            format!("{c} >= {}", self.floor.checked_sub(delta)?)
        } else {
            format!("{c} <= {}", self.ceiling.checked_sub(delta)?)
        };
        let value = wrap(&format!("{c} + ?"));
        Some(format!(
            "UPDATE {t} SET {c} = {value} WHERE {k} = ? AND {bound}"
        ))
    }

    fn explain(delta: i64, current: Option<i64>) -> Bounded {
        match current {
            None => Bounded::NotFound,
            Some(v) if delta < 0 => Bounded::Insufficient(v),
            Some(v) => Bounded::Exceeded(v),
        }
    }
}

/// How a row lock waits for a row another transaction holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// Wait (up to the database's lock timeout).
    Wait,
    /// Do not wait: [`Locked::Busy`] at once.
    NoWait,
    /// Do not wait: skip the row as if absent; for a single key the same answer as
    /// [`LockWait::NoWait`] ([`Locked::Busy`]), without an error in the database's log.
    SkipLocked,
}

/// The outcome of taking a row lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Locked {
    /// The row is locked until the transaction ends.
    Locked,
    /// Another transaction holds it (with [`LockWait::NoWait`] or [`LockWait::SkipLocked`]).
    Busy,
    /// No row has this key.
    NotFound,
}

/// Row locks (`SELECT … FOR UPDATE`) on a table's rows by a unique key, inside the caller's
/// transaction (PostgreSQL: a refused `NOWAIT` is taken inside a savepoint, so the transaction
/// stays usable). Lock by an indexed, unique column: a lock taken through a column without an
/// index locks every row the scan passes (the whole table in MySQL).
///
/// SQLite has no row locks: a write transaction locks the whole database. Its
/// [`RowLock::lock_sqlite`] only checks that the row exists; open the transaction with
/// `BEGIN IMMEDIATE` (sqlx: `conn.begin_with("BEGIN IMMEDIATE")`) so the lock is taken before
/// the first read, and other writers wait (up to the busy timeout) for the whole transaction.
#[derive(Debug, Clone)]
pub struct RowLock {
    row: Row,
}

impl RowLock {
    /// Rows of `table`, found by the unique column `key`.
    pub fn new(table: &str, key: &str) -> Result<Self, GuardError> {
        Ok(Self {
            row: Row::new(table, key)?,
        })
    }

    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    fn sql(&self, wait: LockWait) -> String {
        let suffix = match wait {
            LockWait::Wait => "",
            LockWait::NoWait => " NOWAIT",
            LockWait::SkipLocked => " SKIP LOCKED",
        };
        format!(
            "SELECT 1 FROM {} WHERE {} = ? FOR UPDATE{suffix}",
            self.row.table, self.row.key
        )
    }
}

/// `?` placeholders as PostgreSQL's `$1, $2, …` (the guards' SQL has no string literals).
/// A statement with `?` placeholders, as PostgreSQL takes it: `$1, $2, …` in their place.
/// The guards write their statements once with `?`; so can a caller whose other statements
/// run beside them on every database. Every `?` is a placeholder: keep them out of literals.
///
/// ```
/// assert_eq!(idem_guard::numbered("UPDATE t SET a = ? WHERE id = ?"), "UPDATE t SET a = $1 WHERE id = $2");
/// ```
pub fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for ch in sql.chars() {
        if ch == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(ch);
        }
    }
    out
}

#[cfg(test)]
mod tests;
