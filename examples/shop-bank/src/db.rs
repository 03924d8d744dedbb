//! The shop's database: SQLite (embedded), PostgreSQL or MySQL/MariaDB, one enum over sqlx's
//! three pools so each handler is written once. Statements use `?` placeholders; PostgreSQL's
//! `$n` are put in when a statement runs.

use std::str::FromStr;
use std::time::Duration;

use idem_guard::{
    Bounded, Cas, Counter, GuardError, Inserted, LockWait, Locked, RowLock, Scalar, StateMachine,
    Transition, UniqueInsert, Versioned, numbered,
};
use sqlx::{MySql, Postgres, Row, Sqlite, Transaction};

/// A database error, with whether trying the transaction again may succeed.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The driver's error.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// A guard's error.
    #[error(transparent)]
    Guard(#[from] GuardError),
    /// The commit failed on the way: the transaction may or may not have been committed.
    #[error("the commit's outcome is unknown: {0}")]
    CommitUnknown(sqlx::Error),
    /// A value of an unexpected type came back.
    #[error("unexpected value in column {0}")]
    Value(usize),
}

impl DbError {
    /// A deadlock, a serialization failure, a busy SQLite file or a lost connection: the
    /// transaction rolled back and may be tried again.
    pub fn is_transient(&self) -> bool {
        let (DbError::Sql(e) | DbError::Guard(GuardError::Database(e))) = self else {
            return false;
        };
        match e {
            sqlx::Error::Database(d) => {
                if let Some(m) = d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                    // Lock wait timeout, deadlock.
                    return matches!(m.number(), 1205 | 1213);
                }
                // PostgreSQL: serialization failure, deadlock. SQLite: busy, locked, and the
                // busy snapshot's extended code.
                let code = d.code().unwrap_or_default();
                matches!(&*code, "40001" | "40P01" | "5" | "6" | "517")
            }
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
            _ => false,
        }
    }
}

/// Which engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// SQLite.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    MySql,
}

/// A pool of connections to the shop's database.
#[derive(Debug, Clone)]
pub enum Db {
    /// SQLite.
    Sqlite(sqlx::SqlitePool),
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// MySQL or MariaDB.
    MySql(sqlx::MySqlPool),
}

/// One open transaction.
pub enum Tx {
    /// SQLite.
    Sqlite(Transaction<'static, Sqlite>),
    /// PostgreSQL.
    Postgres(Transaction<'static, Postgres>),
    /// MySQL or MariaDB.
    MySql(Transaction<'static, MySql>),
}

/// Reads every column of a row as an integer or text.
fn columns<R: Row>(row: &R) -> Result<Vec<Scalar>, DbError>
where
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i16: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    (0..row.len())
        .map(|i| Scalar::read(row, i).map_err(|_| DbError::Value(i)))
        .collect()
}

/// Column `i` of a row read back, as an integer (`i64::MIN` if it is not one, which no
/// shop value is).
pub fn int(row: &[Scalar], i: usize) -> i64 {
    match row.get(i) {
        Some(Scalar::Int(v)) => *v,
        _ => i64::MIN,
    }
}

/// Column `i` of a row read back, as text (an integer in decimal).
pub fn text(row: &[Scalar], i: usize) -> String {
    match row.get(i) {
        Some(Scalar::Text(v)) => v.clone(),
        Some(Scalar::Int(v)) => v.to_string(),
        None => String::new(),
    }
}

/// A row read as plain values, for [`UniqueInsert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Values(pub Vec<Scalar>);

macro_rules! values_from_row {
    ($($row:ty),*) => {$(
        impl<'r> sqlx::FromRow<'r, $row> for Values {
            fn from_row(row: &'r $row) -> Result<Self, sqlx::Error> {
                columns(row).map(Values).map_err(|e| sqlx::Error::Decode(e.to_string().into()))
            }
        }
    )*};
}
values_from_row!(
    sqlx::sqlite::SqliteRow,
    sqlx::postgres::PgRow,
    sqlx::mysql::MySqlRow
);

macro_rules! bind_all {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for a in $args {
            q = match a {
                Scalar::Int(i) => q.bind(*i),
                Scalar::Text(t) => q.bind(t.clone()),
            };
        }
        q
    }};
}

/// Runs one statement on whichever connection `$c` is, with `$sql` for that engine.
macro_rules! each {
    ($self:expr, $c:ident, $sql:ident => $body:expr) => {
        match $self {
            Tx::Sqlite(t) => {
                let $c = &mut **t;
                let $sql = |s: &str| s.to_owned();
                $body
            }
            Tx::Postgres(t) => {
                let $c = &mut **t;
                let $sql = numbered;
                $body
            }
            Tx::MySql(t) => {
                let $c = &mut **t;
                let $sql = |s: &str| s.to_owned();
                $body
            }
        }
    };
}

impl Db {
    /// Connects to `sqlite://PATH`, `postgres://…` or `mysql://…` (`mariadb://` too).
    pub async fn connect(url: &str, max: u32) -> Result<Db, DbError> {
        let acquire = Duration::from_secs(10);
        if let Some(rest) = url.strip_prefix("mariadb://") {
            return Box::pin(Db::connect(&format!("mysql://{rest}"), max)).await;
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(acquire)
                .connect(url)
                .await?;
            Ok(Db::Postgres(pool))
        } else if url.starts_with("mysql://") {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(acquire)
                .connect(url)
                .await?;
            Ok(Db::MySql(pool))
        } else {
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(max)
                .acquire_timeout(acquire)
                .connect_with(options)
                .await?;
            Ok(Db::Sqlite(pool))
        }
    }

    /// Which engine this is.
    pub fn engine(&self) -> Engine {
        match self {
            Db::Sqlite(_) => Engine::Sqlite,
            Db::Postgres(_) => Engine::Postgres,
            Db::MySql(_) => Engine::MySql,
        }
    }

    /// Begins a transaction. SQLite's takes the write lock at once (`BEGIN IMMEDIATE`): a
    /// deferred one that reads and then writes can fail to upgrade, and SQLite has no row
    /// locks to take instead.
    pub async fn begin(&self) -> Result<Tx, DbError> {
        Ok(match self {
            Db::Sqlite(p) => Tx::Sqlite(p.begin_with("BEGIN IMMEDIATE").await?),
            Db::Postgres(p) => Tx::Postgres(p.begin().await?),
            Db::MySql(p) => Tx::MySql(p.begin().await?),
        })
    }

    /// Runs one statement in a transaction of its own.
    pub async fn exec(&self, sql: &str, args: &[Scalar]) -> Result<u64, DbError> {
        let mut tx = self.begin().await?;
        let n = tx.exec(sql, args).await?;
        tx.commit().await?;
        Ok(n)
    }

    /// A transaction for reading: on SQLite a deferred one, which takes no write lock.
    pub async fn begin_read(&self) -> Result<Tx, DbError> {
        match self {
            Db::Sqlite(p) => Ok(Tx::Sqlite(p.begin().await?)),
            _ => self.begin().await,
        }
    }

    /// Reads rows in a transaction of its own.
    pub async fn rows(&self, sql: &str, args: &[Scalar]) -> Result<Vec<Vec<Scalar>>, DbError> {
        let mut tx = self.begin_read().await?;
        let rows = tx.rows(sql, args).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            Db::Sqlite(p) => p.close().await,
            Db::Postgres(p) => p.close().await,
            Db::MySql(p) => p.close().await,
        }
    }
}

impl Tx {
    /// Runs a statement; the number of rows it changed.
    pub async fn exec(&mut self, sql: &str, args: &[Scalar]) -> Result<u64, DbError> {
        each!(self, c, dialect => {
            let text = dialect(sql);
            let q = bind_all!(sqlx::query(sqlx::AssertSqlSafe(text)), args);
            Ok(q.execute(c).await?.rows_affected())
        })
    }

    /// Reads rows, each column an integer or text.
    pub async fn rows(&mut self, sql: &str, args: &[Scalar]) -> Result<Vec<Vec<Scalar>>, DbError> {
        each!(self, c, dialect => {
            let text = dialect(sql);
            let q = bind_all!(sqlx::query(sqlx::AssertSqlSafe(text)), args);
            q.fetch_all(c).await?.iter().map(columns).collect()
        })
    }

    /// The first column of the first row, if any, as an integer.
    pub async fn int(&mut self, sql: &str, args: &[Scalar]) -> Result<Option<i64>, DbError> {
        match self.rows(sql, args).await?.first().and_then(|r| r.first()) {
            None => Ok(None),
            Some(Scalar::Int(v)) => Ok(Some(*v)),
            Some(Scalar::Text(_)) => Err(DbError::Value(0)),
        }
    }

    /// [`StateMachine`] transition.
    pub async fn transition(
        &mut self,
        sm: &StateMachine,
        key: Scalar,
        from: i64,
        to: i64,
    ) -> Result<Transition, DbError> {
        Ok(match self {
            Tx::Sqlite(t) => sm.transition_sqlite(t, key, from, to).await?,
            Tx::Postgres(t) => sm.transition_pg(t, key, from, to).await?,
            Tx::MySql(t) => sm.transition_mysql(t, key, from, to).await?,
        })
    }

    /// [`Versioned`] compare-and-set.
    pub async fn cas(
        &mut self,
        v: &Versioned,
        key: Scalar,
        expected: i64,
        sets: &[(&str, Scalar)],
    ) -> Result<Cas, DbError> {
        Ok(match self {
            Tx::Sqlite(t) => v.update_sqlite(t, key, expected, sets).await?,
            Tx::Postgres(t) => v.update_pg(t, key, expected, sets).await?,
            Tx::MySql(t) => v.update_mysql(t, key, expected, sets).await?,
        })
    }

    /// [`Counter`] bounded change.
    pub async fn add(&mut self, c: &Counter, key: Scalar, delta: i64) -> Result<Bounded, DbError> {
        Ok(match self {
            Tx::Sqlite(t) => c.add_sqlite(t, key, delta).await?,
            Tx::Postgres(t) => c.add_pg(t, key, delta).await?,
            Tx::MySql(t) => c.add_mysql(t, key, delta).await?,
        })
    }

    /// [`UniqueInsert`] insert-or-replay.
    pub async fn insert(
        &mut self,
        u: &UniqueInsert,
        values: &[Scalar],
    ) -> Result<Inserted<Values>, DbError> {
        Ok(match self {
            Tx::Sqlite(t) => u.insert_sqlite(t, values).await?,
            Tx::Postgres(t) => u.insert_pg(t, values).await?,
            Tx::MySql(t) => u.insert_mysql(t, values).await?,
        })
    }

    /// [`RowLock`]: `SELECT … FOR UPDATE` on PostgreSQL and MySQL; on SQLite, whose
    /// `BEGIN IMMEDIATE` already holds the only write lock, whether the row exists.
    pub async fn lock(&mut self, l: &RowLock, key: Scalar) -> Result<Locked, DbError> {
        Ok(match self {
            Tx::Sqlite(t) => l.lock_sqlite(t, key).await?,
            Tx::Postgres(t) => l.lock_pg(t, key, LockWait::Wait).await?,
            Tx::MySql(t) => l.lock_mysql(t, key, LockWait::Wait).await?,
        })
    }

    /// Commits. A failure here leaves the outcome unknown ([`DbError::CommitUnknown`]),
    /// except a refusal the database explains (a serialization failure), which rolled back.
    pub async fn commit(self) -> Result<(), DbError> {
        let result = match self {
            Tx::Sqlite(t) => t.commit().await,
            Tx::Postgres(t) => t.commit().await,
            Tx::MySql(t) => t.commit().await,
        };
        match result {
            Ok(()) => Ok(()),
            Err(e @ sqlx::Error::Database(_)) => Err(DbError::Sql(e)),
            Err(e) => Err(DbError::CommitUnknown(e)),
        }
    }
}
