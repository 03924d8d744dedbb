//! Telling a failure that may pass (the server or the network) from a mistake, for both SQL
//! dialects: by SQLSTATE or error number as each [`Dialect`] reads it, never by message text.

use idem_core::StoreError;

use super::Dialect;

/// Classifies a sqlx error: a database error by the dialect's codes, anything else by kind. A
/// failure that may pass is [`StoreError::Unavailable`], the rest [`StoreError::Backend`].
pub(crate) fn error<D: Dialect>(what: &str, e: sqlx::Error) -> StoreError {
    let transient = match &e {
        sqlx::Error::Database(db) => D::transient(db.as_ref()),
        other => is_transient(other),
    };
    // The driver's text names the failure (refused, timed out, the server's message), never
    // the values bound to a statement.
    let message = format!("{what}: {e}");
    if transient {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
}

/// Whether a sqlx error that is not a database error means the server or the network failed
/// (worth retrying later) rather than a mistake.
fn is_transient(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
    )
}
