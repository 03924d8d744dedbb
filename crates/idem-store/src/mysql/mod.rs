//! Idempotency records in MySQL or MariaDB.
//!
//! Each decision is one statement InnoDB applies atomically per row. `begin` is an
//! `INSERT … ON DUPLICATE KEY UPDATE` whose assignments take the row over only when the key may
//! be acquired (expired, released, or in progress for the same request with its lease run
//! out), and report the new fence through `LAST_INSERT_ID(expr)`, which the server returns with
//! the statement's result: 0 means nothing was acquired. MySQL has no `RETURNING` for this
//! statement, and this is its documented way to hand a value computed in an upsert back to the
//! client. `complete`, `release` and `reopen` are `UPDATE`s conditioned on the lease and state.
//!
//! Purges find expired rows through an index on `purge_after` (the lease end plus the TTL, set
//! when a lease is granted or renewed), so completing a record touches no secondary index; a
//! purge deletes a row only once `expires_at` has passed too, since a late completion or a
//! reopen moves it past `purge_after`.
//!
//! Keys are `VARBINARY`, so they compare byte for byte: under the usual case-insensitive
//! collations `Order-1` and `order-1` would be one key.
//!
//! The store is [`SqlStore`] over this dialect, written once with PostgreSQL's in `crate::sql`;
//! what is MySQL's own is here: its hooks on the records path (`records`: the statements it
//! spells its own way, reading the fence back through `LAST_INSERT_ID`, the batched forms, the
//! session settings), the schema and its migrations (`migrate`) and the classification of
//! errors by error number (`error`). A page of the operator's view spells its bound after the
//! cursor column by column (`scope > ? OR (scope = ? AND …)`): MariaDB reads a row comparison
//! by scanning the key index from its start. Keys are `VARBINARY`, so pages follow byte order.

use std::sync::Arc;

use sqlx::MySql;

use crate::sql::{self, SqlOptions, SqlStore};

mod error;
mod migrate;
mod records;

use error::error;

/// How a [`MySqlStore`] connects.
pub type MySqlOptions = SqlOptions;

/// Idempotency records in a MySQL or MariaDB table: a [`SqlStore`] on MySQL.
pub type MySqlStore = SqlStore<MySql>;

/// What a [`MySqlStore`] keeps beside its records: the statements for batches of `2^(i+1)`
/// rows (a batch is padded up to the next size, so each connection prepares a handful of
/// statements, not one per size); none when every call goes on its own.
#[derive(Clone, Debug)]
pub(crate) struct Own {
    batch_sql: Arc<[records::BatchSql]>,
}

/// What every connection sets first: the lock wait bound, and an `UPDATE`'s assignments
/// applied left to right, each seeing the ones before (`renew` computes `expires_at` from the
/// new lease end, and `purge_after` from that). MariaDB's `SIMULTANEOUS_ASSIGNMENT` mode, if a
/// server sets it, would evaluate them all against the old row; a test shows it turned off.
fn session_settings(options: &SqlOptions) -> String {
    let wait = options.lock_timeout.as_secs().max(1);
    format!(
        "SET SESSION innodb_lock_wait_timeout = {wait}, \
         sql_mode = REPLACE(@@SESSION.sql_mode, 'SIMULTANEOUS_ASSIGNMENT', '')"
    )
}

impl sql::Dialect for sqlx::MySql {
    const SERVER: &'static str = "MySQL";
    const MIGRATIONS: &'static [sql::Migration] = migrate::MIGRATIONS;
    const TABLE_OPTIONS: &'static str = "ENGINE = InnoDB";
    const THREE_VALUES: &'static str = "VALUES (?, ?, ?)";
    const BINARY_KEYS: bool = true;
    // MariaDB reads the whole index up to the bound for `(a, b) > (?, ?)`.
    const ROW_COMPARISON: bool = false;
    const BIGINT: &'static str = "SIGNED";

    fn placeholder(_: usize) -> String {
        "?".to_owned()
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn transient(e: &dyn sqlx::error::DatabaseError) -> bool {
        error::transient(e)
    }
}
