//! Redis errors: what may pass, what is a mistake, and what is a value this store did not
//! write.

use idem_core::StoreError;

use super::scripts::FOREIGN;

/// Whether a command that failed with `e` may have run on the server, or may still run
/// there: it was given up on while in flight (a response timeout) or its connection broke.
/// An error the server answered, or a connection never made, means it did not run.
pub(super) fn may_have_run(e: &redis::RedisError) -> bool {
    (e.is_io_error() || e.is_timeout() || e.is_connection_dropped()) && !e.is_connection_refusal()
}

/// Redis errors: the connection or the server being unreachable, busy or failing over may
/// pass; anything else (a script error, a wrong type at the key) is a backend error.
pub(crate) fn error(what: &str, e: redis::RedisError) -> StoreError {
    if e.code() == Some("WRONGTYPE") || e.to_string().contains(FOREIGN) {
        return StoreError::Corrupt(format!(
            "{what}: the Redis key holds a value this store did not write"
        ));
    }
    let message = format!("{what}: {e}");
    if transient(&e) {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
}

/// Whether `e` may pass: the connection or the server being unreachable, busy or failing over.
pub(super) fn transient(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                redis::ServerErrorKind::BusyLoading
                    | redis::ServerErrorKind::TryAgain
                    | redis::ServerErrorKind::ClusterDown
                    | redis::ServerErrorKind::MasterDown
                    | redis::ServerErrorKind::ReadOnly
            )
        )
}

pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("the Redis record has a bad {what}"))
}
