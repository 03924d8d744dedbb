//! The PostgreSQL schema, and applying it: each pending migration once, in one transaction
//! under an advisory lock (`crate::sql::migrate` runs the steps).

use idem_core::StoreError;
use sqlx::{Connection, PgConnection, Postgres};

use super::error;
use crate::sql::migrate::{apply, current};
use crate::sql::{Migration, TableName};

/// The schema, one migration per version; applied in order, each once.
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "records table and purge index",
        statements: &[
            "CREATE TABLE IF NOT EXISTS {table} (
            scope            TEXT    NOT NULL,
            namespace        TEXT    NOT NULL,
            client_key       TEXT    NOT NULL,
            fingerprint      BYTEA   NOT NULL,
            status           TEXT    NOT NULL
                CHECK (status IN ('in_progress', 'completed', 'released')),
            fence            BIGINT  NOT NULL,
            lease_id         BYTEA   NOT NULL,
            lease_expires_at BIGINT  NOT NULL,
            response         BYTEA,
            ttl_ms           BIGINT  NOT NULL,
            created_at       BIGINT  NOT NULL,
            updated_at       BIGINT  NOT NULL,
            expires_at       BIGINT  NOT NULL,
            purge_after      BIGINT  NOT NULL,
            PRIMARY KEY (scope, namespace, client_key)
        ) WITH (fillfactor = 80)",
            "CREATE INDEX IF NOT EXISTS {name}_purge_after ON {table} (purge_after)",
        ],
    },
    Migration {
        version: 2,
        description: "counters",
        statements: &["CREATE TABLE IF NOT EXISTS {table}_counters (
            scope      TEXT   NOT NULL,
            namespace  TEXT   NOT NULL,
            client_key TEXT   NOT NULL,
            value      BIGINT NOT NULL,
            PRIMARY KEY (scope, namespace, client_key)
        )"],
    },
    Migration {
        version: 3,
        description: "locks",
        statements: &["CREATE TABLE IF NOT EXISTS {table}_locks (
            name       TEXT   NOT NULL PRIMARY KEY,
            owner      BYTEA  NOT NULL,
            fence      BIGINT NOT NULL,
            expires_at BIGINT NOT NULL
        ) WITH (fillfactor = 80)"],
    },
    Migration {
        version: 4,
        description: "steps",
        statements: &["ALTER TABLE {table} ADD COLUMN IF NOT EXISTS steps BYTEA"],
    },
];

/// Applies pending migrations in one transaction, under an advisory lock so that
/// processes starting together apply each migration once.
pub(super) async fn migrate(c: &mut PgConnection, table: &TableName) -> Result<(), StoreError> {
    // Up to date already: nothing to lock or create, so a service may run as a user without
    // the right to change the schema (after `idem migrate` ran as one with it).
    if current::<Postgres>(c, table).await {
        return Ok(());
    }
    let fail = |e| error("cannot apply the PostgreSQL schema", e);
    let mut tx = c.begin().await.map_err(fail)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("idem migrations {table}"))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    apply::<Postgres>(&mut tx, table).await?;
    tx.commit().await.map_err(fail)
}
