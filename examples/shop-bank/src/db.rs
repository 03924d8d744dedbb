//! The shop's database: SQLite (embedded), PostgreSQL or MySQL/MariaDB, one enum over sqlx's
//! three pools so each handler is written once. Statements use `?` placeholders; PostgreSQL's
//! `$n` are put in when a statement runs, or once for a [`Statement`] that runs often. A
//! [`Tx`] runs its statements on its [`Conn`], which can also be a transaction someone else
//! opened (idem-mq's inbox hands its handler one).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem_guard::{
    Bounded, Cas, Counter, GuardError, Inserted, LockWait, Locked, RowLock, Scalar, StateMachine,
    Transition, UniqueInsert, Versioned, numbered,
};
use sqlx::{
    MySql, MySqlConnection, PgConnection, Postgres, Row, Sqlite, SqliteConnection, Transaction,
};

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

/// The connection of an open transaction, whoever opened it: a [`Tx`]'s own, or the one
/// idem-mq's inbox lends its handler. The statements run on it.
pub enum Conn<'t> {
    /// SQLite.
    Sqlite(&'t mut SqliteConnection),
    /// PostgreSQL.
    Postgres(&'t mut PgConnection),
    /// MySQL or MariaDB.
    MySql(&'t mut MySqlConnection),
}

impl<'t> From<&'t mut SqliteConnection> for Conn<'t> {
    fn from(c: &'t mut SqliteConnection) -> Self {
        Conn::Sqlite(c)
    }
}

impl<'t> From<&'t mut PgConnection> for Conn<'t> {
    fn from(c: &'t mut PgConnection) -> Self {
        Conn::Postgres(c)
    }
}

impl<'t> From<&'t mut MySqlConnection> for Conn<'t> {
    fn from(c: &'t mut MySqlConnection) -> Self {
        Conn::MySql(c)
    }
}

/// A statement written with `?` placeholders, put once in the form of each engine's
/// placeholders: for a statement that runs again and again, which [`Conn::exec`] would put
/// in its engine's form every time.
#[derive(Debug, Clone)]
pub struct Statement {
    /// SQLite's and MySQL's form: `?`.
    question: Arc<str>,
    /// PostgreSQL's form: `$1, $2, …`.
    numbered: Arc<str>,
}

impl Statement {
    /// `sql`, with `?` placeholders, in every engine's form.
    pub fn new(sql: &str) -> Self {
        Self {
            question: sql.into(),
            numbered: numbered(sql).into(),
        }
    }

    /// Its text for `engine`.
    fn text(&self, engine: Engine) -> Arc<str> {
        match engine {
            Engine::Postgres => self.numbered.clone(),
            Engine::Sqlite | Engine::MySql => self.question.clone(),
        }
    }
}

impl Engine {
    /// `sql`, written with `?` placeholders, in this engine's form.
    fn placeholders(self, sql: &str) -> Arc<str> {
        match self {
            Engine::Postgres => numbered(sql).into(),
            Engine::Sqlite | Engine::MySql => sql.into(),
        }
    }
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

/// A pool of up to `max` connections, each waited for 10 s at the most.
fn pool<D: sqlx::Database>(max: u32) -> sqlx::pool::PoolOptions<D> {
    sqlx::pool::PoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
}

/// `$body` with `$c` bound to the connection, whichever engine's it is.
macro_rules! each {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            Conn::Sqlite($c) => $body,
            Conn::Postgres($c) => $body,
            Conn::MySql($c) => $body,
        }
    };
}

impl Db {
    /// Connects to `sqlite://PATH`, `postgres://…` or `mysql://…` (`mariadb://` too).
    pub async fn connect(url: &str, max: u32) -> Result<Db, DbError> {
        if let Some(rest) = url.strip_prefix("mariadb://") {
            return Box::pin(Db::connect(&format!("mysql://{rest}"), max)).await;
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Db::Postgres(pool(max).connect(url).await?))
        } else if url.starts_with("mysql://") {
            Ok(Db::MySql(pool(max).connect(url).await?))
        } else {
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10));
            Ok(Db::Sqlite(pool(max).connect_with(options).await?))
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
    /// The transaction's connection, for its statements.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Sqlite(t) => Conn::Sqlite(t),
            Tx::Postgres(t) => Conn::Postgres(t),
            Tx::MySql(t) => Conn::MySql(t),
        }
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

/// A [`Tx`]'s statements are its connection's: each of these runs [`Conn`]'s method of the
/// same name.
macro_rules! on_conn {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $out:ty;)*) => {
        impl Tx {
            $(
                #[doc = concat!("[`Conn::", stringify!($name), "`], on the transaction's connection.")]
                pub async fn $name(&mut self, $($arg: $ty),*) -> Result<$out, DbError> {
                    self.conn().$name($($arg),*).await
                }
            )*
        }
    };
}

on_conn! {
    exec(sql: &str, args: &[Scalar]) -> u64;
    rows(sql: &str, args: &[Scalar]) -> Vec<Vec<Scalar>>;
    int(sql: &str, args: &[Scalar]) -> Option<i64>;
    transition(sm: &StateMachine, key: Scalar, from: i64, to: i64) -> Transition;
    cas(v: &Versioned, key: Scalar, expected: i64, sets: &[(&str, Scalar)]) -> Cas;
    add(c: &Counter, key: Scalar, delta: i64) -> Bounded;
    insert(u: &UniqueInsert, values: &[Scalar]) -> Inserted<Values>;
    lock(l: &RowLock, key: Scalar) -> Locked;
}

impl Conn<'_> {
    /// Which engine this is.
    pub fn engine(&self) -> Engine {
        match self {
            Conn::Sqlite(_) => Engine::Sqlite,
            Conn::Postgres(_) => Engine::Postgres,
            Conn::MySql(_) => Engine::MySql,
        }
    }

    /// Runs a statement; the number of rows it changed.
    pub async fn exec(&mut self, sql: &str, args: &[Scalar]) -> Result<u64, DbError> {
        let text = self.engine().placeholders(sql);
        self.execute(text, args).await
    }

    /// Runs a statement put in the engines' forms beforehand; the number of rows it changed.
    pub async fn run(&mut self, statement: &Statement, args: &[Scalar]) -> Result<u64, DbError> {
        let text = statement.text(self.engine());
        self.execute(text, args).await
    }

    async fn execute(&mut self, text: Arc<str>, args: &[Scalar]) -> Result<u64, DbError> {
        each!(self, c => {
            let q = bind_all!(sqlx::query(sqlx::AssertSqlSafe(text)), args);
            Ok(q.execute(&mut **c).await?.rows_affected())
        })
    }

    /// Reads rows, each column an integer or text.
    pub async fn rows(&mut self, sql: &str, args: &[Scalar]) -> Result<Vec<Vec<Scalar>>, DbError> {
        let text = self.engine().placeholders(sql);
        each!(self, c => {
            let q = bind_all!(sqlx::query(sqlx::AssertSqlSafe(text)), args);
            q.fetch_all(&mut **c).await?.iter().map(columns).collect()
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
            Conn::Sqlite(c) => sm.transition_sqlite(c, key, from, to).await?,
            Conn::Postgres(c) => sm.transition_pg(c, key, from, to).await?,
            Conn::MySql(c) => sm.transition_mysql(c, key, from, to).await?,
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
            Conn::Sqlite(c) => v.update_sqlite(c, key, expected, sets).await?,
            Conn::Postgres(c) => v.update_pg(c, key, expected, sets).await?,
            Conn::MySql(c) => v.update_mysql(c, key, expected, sets).await?,
        })
    }

    /// [`Counter`] bounded change.
    pub async fn add(&mut self, c: &Counter, key: Scalar, delta: i64) -> Result<Bounded, DbError> {
        Ok(match self {
            Conn::Sqlite(t) => c.add_sqlite(t, key, delta).await?,
            Conn::Postgres(t) => c.add_pg(t, key, delta).await?,
            Conn::MySql(t) => c.add_mysql(t, key, delta).await?,
        })
    }

    /// [`UniqueInsert`] insert-or-replay.
    pub async fn insert(
        &mut self,
        u: &UniqueInsert,
        values: &[Scalar],
    ) -> Result<Inserted<Values>, DbError> {
        Ok(match self {
            Conn::Sqlite(c) => u.insert_sqlite(c, values).await?,
            Conn::Postgres(c) => u.insert_pg(c, values).await?,
            Conn::MySql(c) => u.insert_mysql(c, values).await?,
        })
    }

    /// [`RowLock`]: `SELECT … FOR UPDATE` on PostgreSQL and MySQL; on SQLite, whose
    /// `BEGIN IMMEDIATE` already holds the only write lock, whether the row exists.
    pub async fn lock(&mut self, l: &RowLock, key: Scalar) -> Result<Locked, DbError> {
        Ok(match self {
            Conn::Sqlite(c) => l.lock_sqlite(c, key).await?,
            Conn::Postgres(c) => l.lock_pg(c, key, LockWait::Wait).await?,
            Conn::MySql(c) => l.lock_mysql(c, key, LockWait::Wait).await?,
        })
    }
}
