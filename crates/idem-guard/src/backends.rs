//! The guards on each database. The statements are the same up to placeholders, and how a
//! changed value is handed back: `RETURNING` in PostgreSQL and SQLite, `LAST_INSERT_ID(expr)`
//! in MySQL/MariaDB (whose `UPDATE` has no `RETURNING`; the value is the connection's own, so
//! no second read can see another writer's).

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::LockWait;
#[cfg(feature = "postgres")]
use crate::numbered;
use crate::{
    Bounded, Cas, Counter, GuardError, Inserted, Locked, RowLock, Scalar, StateMachine, Transition,
    UniqueInsert, Versioned,
};

/// Column 0 of the one row a key found; `None` for no row; more than one is an error.
fn only<R: sqlx::Row>(rows: &[R]) -> Result<Option<Scalar>, GuardError>
where
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i16: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    match rows {
        [] => Ok(None),
        [row] => Scalar::read(row, 0).map(Some),
        more => Err(GuardError::NotUnique(more.len() as u64)),
    }
}

fn int(s: &Scalar) -> Result<i64, GuardError> {
    match s {
        Scalar::Int(v) => Ok(*v),
        Scalar::Text(_) => Err(GuardError::UnreadableValue),
    }
}

fn one_row(rows: u64) -> Result<bool, GuardError> {
    match rows {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(GuardError::NotUnique(n)),
    }
}

macro_rules! bind_scalar {
    ($q:expr, $v:expr) => {
        match $v {
            Scalar::Int(i) => $q.bind(*i),
            Scalar::Text(t) => $q.bind(t.clone()),
        }
    };
}

macro_rules! backend {
    (
        conn: $conn:ty,
        sql: $sql:expr,
        transition: $transition:ident,
        cas: $cas:ident,
        add: $add:ident,
        returning: $returning:tt,
        name: $name:literal $(,)?
    ) => {
        impl StateMachine {
            #[doc = concat!("Moves the row with `key` from `from` to `to` on ", $name, ".")]
            ///
            /// Refused with [`GuardError::UndeclaredTransition`] before any SQL if the edge is
            /// not declared.
            pub async fn $transition(
                &self,
                conn: &mut $conn,
                key: impl Into<Scalar>,
                from: impl Into<Scalar>,
                to: impl Into<Scalar>,
            ) -> Result<Transition, GuardError> {
                let (key, from, to) = (key.into(), from.into(), to.into());
                self.check(&from, &to)?;
                let sql = $sql(&self.update_sql());
                let q = sqlx::query(sqlx::AssertSqlSafe(sql));
                let q = bind_scalar!(q, &to);
                let q = bind_scalar!(q, &key);
                let q = bind_scalar!(q, &from);
                if one_row(q.execute(&mut *conn).await?.rows_affected())? {
                    return Ok(Transition::Applied);
                }
                let read = $sql(&self.row.read(&self.column));
                let q = sqlx::query(sqlx::AssertSqlSafe(read));
                let rows = bind_scalar!(q, &key).fetch_all(&mut *conn).await?;
                Ok(Self::explain(&to, only(&rows)?))
            }
        }

        impl Versioned {
            #[doc = concat!("Sets `sets` on the row with `key` if it still has version `expected`, on ", $name, ".")]
            pub async fn $cas(
                &self,
                conn: &mut $conn,
                key: impl Into<Scalar>,
                expected: i64,
                sets: &[(&str, Scalar)],
            ) -> Result<Cas, GuardError> {
                let key = key.into();
                let columns = Self::columns(sets)?;
                let sql = $sql(&self.update_sql(&columns));
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                for (_, value) in sets {
                    q = bind_scalar!(q, value);
                }
                let q = bind_scalar!(q, &key).bind(expected);
                if one_row(q.execute(&mut *conn).await?.rows_affected())? {
                    return Ok(Cas::Applied(expected.saturating_add(1)));
                }
                let read = $sql(&self.row.read(&self.version));
                let q = sqlx::query(sqlx::AssertSqlSafe(read));
                let rows = bind_scalar!(q, &key).fetch_all(&mut *conn).await?;
                Ok(match only(&rows)? {
                    Some(version) => Cas::Conflict(int(&version)?),
                    None => Cas::NotFound,
                })
            }
        }

        impl Counter {
            #[doc = concat!("Adds `delta` (negative: takes away) to the row with `key` unless that crosses a bound, on ", $name, ".")]
            pub async fn $add(
                &self,
                conn: &mut $conn,
                key: impl Into<Scalar>,
                delta: i64,
            ) -> Result<Bounded, GuardError> {
                let key = key.into();
                if let Some(update) = self.update_sql(delta, backend!(@wrap $returning)) {
                    let update = if $returning {
                        format!("{update} RETURNING {}", self.column)
                    } else {
                        update
                    };
                    let q = sqlx::query(sqlx::AssertSqlSafe($sql(&update))).bind(delta);
                    let q = bind_scalar!(q, &key);
                    if let Some(value) = backend!(@apply $returning, q, conn) {
                        return Ok(Bounded::Applied(value));
                    }
                }
                let read = $sql(&self.row.read(&self.column));
                let q = sqlx::query(sqlx::AssertSqlSafe(read));
                let rows = bind_scalar!(q, &key).fetch_all(&mut *conn).await?;
                let current = only(&rows)?.as_ref().map(int).transpose()?;
                Ok(Self::explain(delta, current))
            }
        }

    };
    (@wrap true) => { |v: &str| v.to_owned() };
    (@wrap false) => { |v: &str| format!("LAST_INSERT_ID({v})") };
    (@apply true, $q:expr, $conn:ident) => {{
        // Every returned row, so that a key matching several is reported, not half-applied.
        let rows = $q.fetch_all(&mut *$conn).await?;
        only(&rows)?.as_ref().map(int).transpose()?
    }};
    (@apply false, $q:expr, $conn:ident) => {
        if one_row($q.execute(&mut *$conn).await?.rows_affected())? {
            let v: u64 = sqlx::query_scalar("SELECT LAST_INSERT_ID()")
                .fetch_one(&mut *$conn)
                .await?;
            // LAST_INSERT_ID is unsigned: a negative value comes back as its two's complement.
            Some(v.cast_signed())
        } else {
            None
        }
    };
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! row_lock {
    ($conn:ty, $sql:expr, $lock:ident, $name:literal, savepoint: $savepoint:tt) => {
        impl RowLock {
            #[doc = concat!("Locks the row with `key` until the transaction ends, on ", $name, ".")]
            pub async fn $lock(
                &self,
                conn: &mut $conn,
                key: impl Into<Scalar>,
                wait: LockWait,
            ) -> Result<Locked, GuardError> {
                let key = key.into();
                // A refused NOWAIT aborts a PostgreSQL transaction; inside a savepoint only
                // the savepoint is lost, and the caller's transaction goes on.
                let savepoint = $savepoint && wait == LockWait::NoWait;
                if savepoint {
                    sqlx::query("SAVEPOINT idem_guard_lock")
                        .execute(&mut *conn)
                        .await?;
                }
                let q = sqlx::query(sqlx::AssertSqlSafe($sql(&self.sql(wait))));
                let answer = bind_scalar!(q, &key).fetch_optional(&mut *conn).await;
                if savepoint {
                    let end = if answer.is_ok() {
                        "RELEASE SAVEPOINT idem_guard_lock"
                    } else {
                        "ROLLBACK TO SAVEPOINT idem_guard_lock"
                    };
                    sqlx::query(end).execute(&mut *conn).await?;
                }
                match answer {
                    Ok(Some(_)) => Ok(Locked::Locked),
                    // Skipped because locked, or absent: tell them apart without waiting.
                    Ok(None) if wait == LockWait::SkipLocked => {
                        let read = $sql(&self.row.read(&self.row.key));
                        let q = sqlx::query(sqlx::AssertSqlSafe(read));
                        Ok(
                            match bind_scalar!(q, &key).fetch_optional(&mut *conn).await? {
                                Some(_) => Locked::Busy,
                                None => Locked::NotFound,
                            },
                        )
                    }
                    Ok(None) => Ok(Locked::NotFound),
                    // Only a NOWAIT refusal means "busy": a waiting lock that times out
                    // (lock_timeout, innodb_lock_wait_timeout) is an error, and on PostgreSQL
                    // it has aborted the transaction.
                    Err(e) if wait == LockWait::NoWait && is_lock_busy(&e) => Ok(Locked::Busy),
                    Err(e) => Err(e.into()),
                }
            }
        }
    };
}

/// Whether a `NOWAIT` lock was refused because another transaction holds the row: SQLSTATE
/// 55P03 (PostgreSQL), MySQL error 3572, or MariaDB's `NOWAIT` timing out at once (1205).
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn is_lock_busy(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    if db.code().as_deref() == Some("55P03") {
        return true;
    }
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return matches!(my.number(), 3572 | 1205);
    }
    false
}

#[cfg(feature = "postgres")]
backend! {
    conn: sqlx::PgConnection,
    sql: numbered,
    transition: transition_pg,
    cas: update_pg,
    add: add_pg,
    returning: true,
    name: "PostgreSQL",
}

#[cfg(feature = "postgres")]
row_lock!(sqlx::PgConnection, numbered, lock_pg, "PostgreSQL", savepoint: true);

#[cfg(feature = "mysql")]
row_lock!(sqlx::MySqlConnection, str::to_owned, lock_mysql, "MySQL/MariaDB", savepoint: false);

#[cfg(feature = "mysql")]
backend! {
    conn: sqlx::MySqlConnection,
    sql: str::to_owned,
    transition: transition_mysql,
    cas: update_mysql,
    add: add_mysql,
    returning: false,
    name: "MySQL/MariaDB",
}

#[cfg(feature = "sqlite")]
backend! {
    conn: sqlx::SqliteConnection,
    sql: str::to_owned,
    transition: transition_sqlite,
    cas: update_sqlite,
    add: add_sqlite,
    returning: true,
    name: "SQLite",
}

#[cfg(feature = "sqlite")]
impl RowLock {
    /// SQLite has no row locks: this checks that the row exists, inside a transaction that
    /// already holds the database's write lock (`BEGIN IMMEDIATE`), which no other writer can
    /// take until it ends. [`Locked::Locked`] or [`Locked::NotFound`].
    pub async fn lock_sqlite(
        &self,
        conn: &mut sqlx::SqliteConnection,
        key: impl Into<Scalar>,
    ) -> Result<Locked, GuardError> {
        let key = key.into();
        let q = sqlx::query(sqlx::AssertSqlSafe(self.row.read(&self.row.key)));
        Ok(
            match bind_scalar!(q, &key).fetch_optional(&mut *conn).await? {
                Some(_) => Locked::Locked,
                None => Locked::NotFound,
            },
        )
    }
}

/// Tries the insert: `Ok(())` if it inserted, `Err(duplicate)` if a row with the key was there
/// (with MySQL's duplicate-key error, which may concern another unique index).
macro_rules! try_insert {
    (conflict, $sql:expr, $this:ident, $conn:ident, $values:ident) => {{
        let conflict: Vec<String> = $this.key.iter().map(ToString::to_string).collect();
        let tail = format!(" ON CONFLICT ({}) DO NOTHING", conflict.join(", "));
        let mut q = sqlx::query(sqlx::AssertSqlSafe($sql(&$this.insert_sql(&tail))));
        for v in $values {
            q = bind_scalar!(q, v);
        }
        if one_row(q.execute(&mut *$conn).await?.rows_affected())? {
            Ok(())
        } else {
            Err(None)
        }
    }};
    (error, $sql:expr, $this:ident, $conn:ident, $values:ident) => {{
        let mut q = sqlx::query(sqlx::AssertSqlSafe($sql(&$this.insert_sql(""))));
        for v in $values {
            q = bind_scalar!(q, v);
        }
        match q.execute(&mut *$conn).await {
            Ok(_) => Ok(()),
            // ER_DUP_ENTRY, by number: a failed statement leaves a MySQL transaction usable.
            Err(e) if is_duplicate_key(&e) => Err(Some(e)),
            Err(e) => return Err(e.into()),
        }
    }};
}

macro_rules! unique_insert {
    (
        conn: $conn:ty,
        row: $row:ty,
        sql: $sql:expr,
        insert: $insert:ident,
        duplicate: $duplicate:ident,
        latest: $latest:literal,
        name: $name:literal $(,)?
    ) => {
        impl UniqueInsert {
            #[doc = concat!("Inserts `values` (one per column), or finds the row with the same key, on ", $name, ".")]
            pub async fn $insert<T>(
                &self,
                conn: &mut $conn,
                values: &[Scalar],
            ) -> Result<Inserted<T>, GuardError>
            where
                T: for<'r> sqlx::FromRow<'r, $row> + Send + Unpin,
            {
                self.check_values(values)?;
                let attempt: Result<(), Option<sqlx::Error>> =
                    try_insert!($duplicate, $sql, self, conn, values);
                let inserted = attempt.is_ok();
                // After a duplicate, the latest committed row, whatever this transaction's
                // snapshot.
                let tail = if inserted { "" } else { $latest };
                let mut q =
                    sqlx::query_as::<_, T>(sqlx::AssertSqlSafe($sql(&self.select_sql(tail))));
                for &i in &self.key_at {
                    q = bind_scalar!(q, &values[i]);
                }
                let row = q.fetch_optional(&mut *conn).await?;
                match (inserted, row) {
                    (true, Some(row)) => Ok(Inserted::New(row)),
                    (false, Some(row)) => Ok(Inserted::Existing(row)),
                    // No row with this key after a duplicate-key error: the duplicate was on
                    // another unique index, and that error is the answer. Otherwise the row
                    // was deleted between the two statements; the caller may try again.
                    (_, None) => Err(match attempt {
                        Err(Some(duplicate)) => duplicate.into(),
                        _ => GuardError::Database(sqlx::Error::RowNotFound),
                    }),
                }
            }
        }
    };
}

/// MySQL's duplicate-key error, by its number (1062), never its message.
#[cfg(feature = "mysql")]
fn is_duplicate_key(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some_and(|my| my.number() == 1062)
}

#[cfg(feature = "postgres")]
unique_insert! {
    conn: sqlx::PgConnection,
    row: sqlx::postgres::PgRow,
    sql: numbered,
    insert: insert_pg,
    duplicate: conflict,
    latest: "",
    name: "PostgreSQL",
}

#[cfg(feature = "mysql")]
unique_insert! {
    conn: sqlx::MySqlConnection,
    row: sqlx::mysql::MySqlRow,
    sql: str::to_owned,
    insert: insert_mysql,
    duplicate: error,
    latest: " LOCK IN SHARE MODE",
    name: "MySQL/MariaDB",
}

#[cfg(feature = "sqlite")]
unique_insert! {
    conn: sqlx::SqliteConnection,
    row: sqlx::sqlite::SqliteRow,
    sql: str::to_owned,
    insert: insert_sqlite,
    duplicate: conflict,
    latest: "",
    name: "SQLite",
}
