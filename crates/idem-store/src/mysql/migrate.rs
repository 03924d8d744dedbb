//! The MySQL schema, and applying it: each pending migration once, under a named lock
//! (`crate::sql::migrate` runs the steps).

use idem_core::StoreError;
use sqlx::{MySql, MySqlConnection};

use super::error;
use crate::sql::migrate::{apply, current};
use crate::sql::{Migration, TableName};

/// The schema, one migration per version; applied in order, each once.
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "records table and purge index",
        statements: &["CREATE TABLE IF NOT EXISTS {table} (
        scope            VARBINARY(255) NOT NULL,
        namespace        VARBINARY(255) NOT NULL,
        client_key       VARBINARY(255) NOT NULL,
        fingerprint      BINARY(32)     NOT NULL,
        status           VARCHAR(16) CHARACTER SET ascii NOT NULL,
        fence            BIGINT         NOT NULL,
        lease_id         BINARY(16)     NOT NULL,
        lease_expires_at BIGINT         NOT NULL,
        response         LONGBLOB       NULL,
        ttl_ms           BIGINT         NOT NULL,
        created_at       BIGINT         NOT NULL,
        updated_at       BIGINT         NOT NULL,
        expires_at       BIGINT         NOT NULL,
        purge_after      BIGINT         NOT NULL,
        PRIMARY KEY (scope, namespace, client_key),
        KEY purge_after (purge_after)
    ) ENGINE = InnoDB"],
    },
    Migration {
        version: 2,
        description: "counters",
        statements: &["CREATE TABLE IF NOT EXISTS {table}_counters (
        scope      VARBINARY(255) NOT NULL,
        namespace  VARBINARY(255) NOT NULL,
        client_key VARBINARY(255) NOT NULL,
        value      BIGINT         NOT NULL,
        PRIMARY KEY (scope, namespace, client_key)
    ) ENGINE = InnoDB"],
    },
    Migration {
        version: 3,
        description: "steps",
        // Plain `ADD COLUMN` (MySQL has no `IF NOT EXISTS` for columns): under the named lock
        // it runs once, unless a crash falls between it and recording its version.
        statements: &["ALTER TABLE {table} ADD COLUMN steps LONGBLOB NULL"],
    },
];

/// Applies pending migrations while holding a named lock, so that processes starting together
/// apply each migration once. (MySQL commits DDL at once, so each step is also written to be
/// safe to repeat.)
pub(super) async fn migrate(c: &mut MySqlConnection, table: &TableName) -> Result<(), StoreError> {
    // Up to date already: nothing to lock or create, so a service may run as a user without
    // the right to change the schema (after `idem migrate` ran as one with it).
    if current::<MySql>(c, table).await {
        return Ok(());
    }
    let fail = |e| error("cannot apply the MySQL schema", e);
    // MySQL takes lock names of at most 64 characters: a digest of the table's name.
    let lock = format!(
        "idem:{}",
        &idem_core::Fingerprint::of_bytes(table.to_string().as_bytes()).to_hex()[..32]
    );
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
        .bind(&lock)
        .fetch_one(&mut *c)
        .await
        .map_err(fail)?;
    if locked != Some(1) {
        return Err(StoreError::Unavailable {
            message: "another process held the migration lock for a minute".into(),
            source: None,
        });
    }
    let result = apply::<MySql>(c, table).await;
    let released = sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut *c)
        .await;
    result?;
    released.map(drop).map_err(fail)
}
