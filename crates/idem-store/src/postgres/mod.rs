//! Idempotency records in PostgreSQL.
//!
//! Each operation is one conditional statement that PostgreSQL applies atomically per row:
//! `begin` is an `INSERT … ON CONFLICT DO UPDATE … WHERE <the key may be acquired>`, so of
//! any number of concurrent `begin`s exactly one gets a row back; `complete`, `release` and
//! `reopen` are `UPDATE`s conditioned on the lease (id and fence) and the record's state. Only
//! when a conditional statement changed nothing is the row read, to tell the caller why (and
//! that read is decided by the same pure transitions as every other store).
//!
//! Expiry follows the caller's clock (`now`), as everywhere; expired rows are deleted in
//! bounded batches by `purge_expired`, found through an index on `purge_after`: the lease end
//! plus the TTL, set when a lease is granted or renewed. Completing or releasing changes
//! `expires_at` but no indexed column, so it is a HOT update (the table keeps free space in
//! each page for it). A completion after the lease ran out, or a reopen, moves `expires_at`
//! past `purge_after`, so a purge deletes a row only once both times have passed.
//!
//! The store is [`SqlStore`] over this dialect, written once with MySQL's in `crate::sql`;
//! what is PostgreSQL's own is here: its hooks on the records path (`records`: the statements
//! it spells its own way, reading the fence back with `RETURNING`, the batched forms, the
//! session settings), the schema and its migrations (`migrate`), the lease locks (`locks`)
//! and the classification of errors by SQLSTATE (`error`). A page of the
//! operator's view seeks the primary key by a row comparison, `(scope, namespace, client_key)
//! > ($1, $2, $3)`, which PostgreSQL reads as one index range.

use sqlx::Postgres;

use crate::sql::{self, SqlOptions, SqlStore};

mod error;
mod locks;
mod migrate;
mod records;

pub(crate) use error::error;

/// How a [`PostgresStore`] connects.
pub type PostgresOptions = SqlOptions;

/// Idempotency records in a PostgreSQL table: a [`SqlStore`] on PostgreSQL, with its lease
/// locks ([`idem_core::LockStore`]) and advisory locks ([`SqlStore::xact_lock`]) beside.
pub type PostgresStore = SqlStore<Postgres>;

/// What a [`PostgresStore`] keeps beside its records: its locks and its batched statements.
#[derive(Clone, Debug)]
pub(crate) struct Own {
    locks: locks::PgLocks,
    batches: records::Batches,
}

impl PostgresStore {
    pub(crate) fn locks(&self) -> &locks::PgLocks {
        &self.own.locks
    }
}

impl sql::Dialect for sqlx::Postgres {
    const SERVER: &'static str = "PostgreSQL";
    const MIGRATIONS: &'static [sql::Migration] = migrate::MIGRATIONS;
    const TABLE_OPTIONS: &'static str = "";
    const THREE_VALUES: &'static str = "VALUES ($1, $2, $3)";
    const BINARY_KEYS: bool = false;
    const ROW_COMPARISON: bool = true;
    const BIGINT: &'static str = "BIGINT";

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn rows_affected(done: &Self::QueryResult) -> u64 {
        done.rows_affected()
    }

    fn transient(e: &dyn sqlx::error::DatabaseError) -> bool {
        e.code().is_some_and(|c| error::transient_sqlstate(&c))
    }
}
