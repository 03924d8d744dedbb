//! MySQL's and MariaDB's errors, told apart by error number.

use idem_core::StoreError;
use sqlx::MySql;
use sqlx::error::DatabaseError;
use sqlx::mysql::MySqlDatabaseError;

use crate::sql;

/// MySQL error numbers that mean the server is busy, shutting down or failing over, not that
/// the statement is wrong: too many connections (1040), shutdown in progress (1053), lock wait
/// timeout (1205), deadlock (1213), read-only (1290, 1836), connection killed (1927). A lost
/// connection is an I/O error, classified as such.
const TRANSIENT: &[u16] = &[1040, 1053, 1205, 1213, 1290, 1836, 1927];

/// Whether a database error's number says it may pass.
pub(super) fn transient(e: &dyn DatabaseError) -> bool {
    e.try_downcast_ref::<MySqlDatabaseError>()
        .is_some_and(|m| TRANSIENT.contains(&m.number()))
}

/// Classifies a database error by its error number, never by its message.
pub(super) fn error(what: &str, e: sqlx::Error) -> StoreError {
    sql::error::<MySql>(what, e)
}
