//! PostgreSQL's errors, told apart by SQLSTATE.

use idem_core::StoreError;
use sqlx::Postgres;

use crate::sql;

/// Whether a SQLSTATE says the server is busy, going away or failing over rather than that
/// the statement is wrong.
pub(super) fn transient_sqlstate(code: &str) -> bool {
    let class = |prefix: &str| code.starts_with(prefix);
    (class("08") || class("53") || class("40")) && code != "53100"
        // Shutdowns (admin, crash, cannot connect now); not 57P04, a dropped database.
        || ["57P01", "57P02", "57P03", "55P03", "57014", "25006"].contains(&code)
}

/// Classifies a database error by SQLSTATE: the server or the network failing may pass
/// (connection errors 08, shutdowns 57P01-03, out of memory or connections 53 but not a full disk,
/// serialization and deadlock 40, a lock or statement timeout 55P03 and 57014, a read-only
/// server after a failover 25006); the rest is a backend error.
pub(crate) fn error(what: &str, e: sqlx::Error) -> StoreError {
    sql::error::<Postgres>(what, e)
}

#[cfg(test)]
mod tests {
    use super::transient_sqlstate;

    #[test]
    fn sqlstates_that_may_pass_and_those_that_do_not() {
        for code in [
            "08006", "08001", "53300", "40001", "40P01", "57P01", "57P03", "55P03", "57014",
            "25006",
        ] {
            assert!(transient_sqlstate(code), "{code}");
        }
        for code in [
            "53100", "57P04", "23505", "42P01", "42501", "22003", "28P01",
        ] {
            assert!(!transient_sqlstate(code), "{code}");
        }
    }
}
