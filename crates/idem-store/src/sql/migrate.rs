//! The versioned migrations of the SQL server stores, run the same way on both: a table
//! `<table>_migrations` lists the versions applied, and each pending migration's statements
//! run in order, then its version is recorded. Each store holds the lock that keeps processes
//! starting together from applying a migration twice (an advisory lock in a transaction on
//! PostgreSQL, a named lock on MySQL) around [`apply`].

use idem_core::{StoreError, Timestamp};
use sqlx::error::DatabaseError;
use sqlx::{AssertSqlSafe, Database, Encode, Executor, FromRow, IntoArguments, Type};

use super::{Migration, TableName, pending};
use crate::row::sql_int;

/// What tells one SQL server's dialect from the other's, for what is written once for both:
/// its schema, how it spells the migrations table, and which of its errors may pass.
pub(crate) trait Dialect: Database {
    /// The server's name, for messages.
    const SERVER: &'static str;
    /// The schema, one migration per version; applied in order, each once.
    const MIGRATIONS: &'static [Migration];
    /// What follows the column list of a `CREATE TABLE` (the storage engine, if any).
    const TABLE_OPTIONS: &'static str;
    /// The `VALUES` of an insert of three bound values, in the dialect's placeholders.
    const THREE_VALUES: &'static str;
    /// Whether the key columns are bytes (`VARBINARY`, bound and read as bytes) rather than
    /// text.
    const BINARY_KEYS: bool;
    /// Whether the server seeks an index by a row comparison (`(a, b) > (?, ?)`); one that
    /// does not gets the same bound spelled out as `a > ? OR (a = ? AND b > ?)`.
    const ROW_COMPARISON: bool;
    /// The type a `CAST` to a 64-bit integer names.
    const BIGINT: &'static str;

    /// The placeholder of the `n`th value bound to a statement (from 1).
    fn placeholder(n: usize) -> String;

    /// How many rows a statement changed.
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// Whether a database error means the server is busy, going away or failing over rather
    /// than that the statement is wrong.
    fn transient(e: &dyn DatabaseError) -> bool;
}

/// Whether every migration is applied (false if that cannot be read).
pub(crate) async fn current<D: Dialect>(c: &mut D::Connection, table: &TableName) -> bool
where
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    (i64,): for<'r> FromRow<'r, D::Row>,
{
    let applied: Result<Vec<i64>, _> = sqlx::query_scalar::<D, i64>(AssertSqlSafe(format!(
        "SELECT version FROM {}",
        table.migrations_table()
    )))
    .fetch_all(&mut *c)
    .await;
    applied.is_ok_and(|a| pending(D::MIGRATIONS, &a).is_ok_and(|p| p.is_empty()))
}

/// Creates the migrations table if need be and applies the pending migrations, recording each.
/// The caller holds the migration lock.
pub(crate) async fn apply<D: Dialect>(
    c: &mut D::Connection,
    table: &TableName,
) -> Result<(), StoreError>
where
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    (i64,): for<'r> FromRow<'r, D::Row>,
    for<'q> i64: Encode<'q, D>,
    for<'q> &'static str: Encode<'q, D>,
    i64: Type<D>,
    &'static str: Type<D>,
{
    let fail = |e| super::error::<D>(&format!("cannot apply the {} schema", D::SERVER), e);
    let versions = table.migrations_table();
    sqlx::query::<D>(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {versions} (
             version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at BIGINT NOT NULL)
         {}",
        D::TABLE_OPTIONS
    )))
    .execute(&mut *c)
    .await
    .map_err(fail)?;
    let applied: Vec<i64> = sqlx::query_scalar::<D, i64>(AssertSqlSafe(format!(
        "SELECT version FROM {versions} ORDER BY version"
    )))
    .fetch_all(&mut *c)
    .await
    .map_err(fail)?;
    for m in pending(D::MIGRATIONS, &applied)? {
        for statement in m.statements {
            sqlx::query::<D>(AssertSqlSafe(table.fill(statement)))
                .execute(&mut *c)
                .await
                .map_err(fail)?;
        }
        sqlx::query::<D>(AssertSqlSafe(format!(
            "INSERT INTO {versions} (version, description, applied_at) {}",
            D::THREE_VALUES
        )))
        .bind(m.version)
        .bind(m.description)
        .bind(sql_int(Timestamp::now().as_millis()))
        .execute(&mut *c)
        .await
        .map_err(fail)?;
    }
    Ok(())
}
