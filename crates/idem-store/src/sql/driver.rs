//! What the code written once for both SQL servers needs of sqlx's driver for a dialect:
//! running a statement with values bound (on the pool, or on one connection) and reading a
//! row's values. sqlx states these as bounds on its `Database`; [`Driver`] states them once,
//! and every dialect whose driver meets them has it.

use idem_core::{BoxFuture, Key, Record, StoreError};
use sqlx::{
    AssertSqlSafe, ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Row, SqlStr, Type,
};

use super::{Dialect, raw};

/// A value bound to a statement, owned (the operator's view builds its statements as it goes).
pub(crate) enum Value {
    Int(i64),
    /// A part of a key: text or bytes, as the dialect stores keys.
    Key(String),
    Bytes(Vec<u8>),
}

/// A value bound to one of the records statements, borrowed from the call.
#[derive(Clone, Copy)]
pub(crate) enum Arg<'a> {
    Int(i64),
    /// A part of a key: text or bytes, as the dialect stores keys.
    Key(&'a str),
    Bytes(&'a [u8]),
}

impl<'a> Arg<'a> {
    /// The three parts of `key`, in the order of `scope = ? AND namespace = ? AND client_key = ?`.
    pub(crate) fn key(key: &'a Key) -> [Self; 3] {
        [
            Self::Key(key.scope().as_str()),
            Self::Key(key.namespace().as_str()),
            Self::Key(key.client_key().as_str()),
        ]
    }
}

/// Where a statement runs: on the pool (on a connection of its own), or on one connection (of
/// the pool, or a caller's transaction).
pub(crate) enum On<'a, D: sqlx::Database> {
    Pool(&'a Pool<D>),
    Conn(&'a mut D::Connection),
}

/// What the shared code needs of a dialect's driver. Every dialect whose driver can do these
/// has it.
pub(crate) trait Driver: Dialect {
    /// The rows `text` answers, with `values` bound.
    fn fetch(
        pool: &Pool<Self>,
        text: String,
        values: Vec<Value>,
    ) -> BoxFuture<'_, Result<Vec<Self::Row>, sqlx::Error>>;

    /// How many rows `text` changed, with `values` bound.
    fn execute(
        pool: &Pool<Self>,
        text: String,
        values: Vec<Value>,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;

    /// How many rows the prepared `statement` changed, with `args` bound.
    fn run<'a>(
        on: On<'a, Self>,
        statement: &SqlStr,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;

    /// The row the prepared `statement` answers, if any, with `args` bound.
    fn row<'a>(
        on: On<'a, Self>,
        statement: &SqlStr,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<Option<Self::Row>, sqlx::Error>>;

    /// A row of the records table's columns (`COLUMNS`, first) as `key`'s record.
    fn record(row: &Self::Row, key: &Key) -> Result<Record, StoreError>;

    /// Column `i` of `row` as an integer.
    fn int(row: &Self::Row, i: usize) -> Result<Option<i64>, sqlx::Error>;

    /// Column `i` of `row` as bytes.
    fn bytes(row: &Self::Row, i: usize) -> Result<Option<Vec<u8>>, sqlx::Error>;

    /// Column `i` of `row` as text (or a key part, stored as the dialect stores keys).
    fn text(row: &Self::Row, i: usize, key: bool) -> Result<String, sqlx::Error>;
}

impl<D: Dialect> Driver for D
where
    for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
    D::Arguments: IntoArguments<D>,
    for<'q> i64: Encode<'q, D>,
    for<'q> String: Encode<'q, D>,
    for<'q> Vec<u8>: Encode<'q, D>,
    for<'q> &'q str: Encode<'q, D>,
    for<'q> &'q [u8]: Encode<'q, D>,
    i64: Type<D>,
    String: Type<D>,
    Vec<u8>: Type<D>,
    for<'q> &'q str: Type<D>,
    for<'q> &'q [u8]: Type<D>,
    for<'r> i64: Decode<'r, D>,
    for<'r> String: Decode<'r, D>,
    for<'r> Vec<u8>: Decode<'r, D>,
    usize: ColumnIndex<D::Row>,
{
    fn fetch(
        pool: &Pool<Self>,
        text: String,
        values: Vec<Value>,
    ) -> BoxFuture<'_, Result<Vec<Self::Row>, sqlx::Error>> {
        let query = bound::<D>(text, values);
        Box::pin(async move { query.fetch_all(pool).await })
    }

    fn execute(
        pool: &Pool<Self>,
        text: String,
        values: Vec<Value>,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        let query = bound::<D>(text, values);
        Box::pin(async move { Ok(D::rows_affected(&query.execute(pool).await?)) })
    }

    fn run<'a>(
        on: On<'a, Self>,
        statement: &SqlStr,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        let query = prepared::<D>(statement, args);
        Box::pin(async move {
            let done = match on {
                On::Pool(pool) => query.execute(pool).await?,
                On::Conn(c) => query.execute(c).await?,
            };
            Ok(D::rows_affected(&done))
        })
    }

    fn row<'a>(
        on: On<'a, Self>,
        statement: &SqlStr,
        args: &'a [Arg<'a>],
    ) -> BoxFuture<'a, Result<Option<Self::Row>, sqlx::Error>> {
        let query = prepared::<D>(statement, args);
        Box::pin(async move {
            match on {
                On::Pool(pool) => query.fetch_optional(pool).await,
                On::Conn(c) => query.fetch_optional(c).await,
            }
        })
    }

    fn record(row: &Self::Row, key: &Key) -> Result<Record, StoreError> {
        raw(row)?.into_record(key)
    }

    fn int(row: &Self::Row, i: usize) -> Result<Option<i64>, sqlx::Error> {
        row.try_get(i)
    }

    fn bytes(row: &Self::Row, i: usize) -> Result<Option<Vec<u8>>, sqlx::Error> {
        row.try_get(i)
    }

    fn text(row: &Self::Row, i: usize, key: bool) -> Result<String, sqlx::Error> {
        if key && D::BINARY_KEYS {
            let bytes: Vec<u8> = row.try_get(i)?;
            String::from_utf8(bytes).map_err(|e| sqlx::Error::ColumnDecode {
                index: i.to_string(),
                source: e.into(),
            })
        } else {
            row.try_get(i)
        }
    }
}

/// A query of `text` with `values` bound, keys as the dialect stores them.
fn bound<D: Dialect>(
    text: String,
    values: Vec<Value>,
) -> sqlx::query::Query<'static, D, D::Arguments>
where
    for<'q> i64: Encode<'q, D>,
    for<'q> String: Encode<'q, D>,
    for<'q> Vec<u8>: Encode<'q, D>,
    i64: Type<D>,
    String: Type<D>,
    Vec<u8>: Type<D>,
{
    let mut q = sqlx::query::<D>(AssertSqlSafe(text));
    for v in values {
        q = match v {
            Value::Int(i) => q.bind(i),
            Value::Key(k) if D::BINARY_KEYS => q.bind(k.into_bytes()),
            Value::Key(k) => q.bind(k),
            Value::Bytes(b) => q.bind(b),
        };
    }
    q
}

/// The prepared `statement` with `args` bound, keys as the dialect stores them.
fn prepared<'a, D: Dialect>(
    statement: &SqlStr,
    args: &'a [Arg<'a>],
) -> sqlx::query::Query<'a, D, D::Arguments>
where
    for<'q> i64: Encode<'q, D>,
    for<'q> &'q str: Encode<'q, D>,
    for<'q> &'q [u8]: Encode<'q, D>,
    i64: Type<D>,
    for<'q> &'q str: Type<D>,
    for<'q> &'q [u8]: Type<D>,
{
    let mut q = sqlx::query::<D>(statement.clone());
    for arg in args {
        q = match *arg {
            Arg::Int(i) => q.bind(i),
            Arg::Key(k) if D::BINARY_KEYS => q.bind(k.as_bytes()),
            Arg::Key(k) => q.bind(k),
            Arg::Bytes(b) => q.bind(b),
        };
    }
    q
}
