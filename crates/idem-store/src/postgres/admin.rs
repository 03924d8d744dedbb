//! The operator's view of a [`PostgresStore`](super::PostgresStore): listing, counting and
//! fenced repairs, as `crate::sql::admin` writes them for both dialects. A page seeks the
//! primary key by a row comparison, `(scope, namespace, client_key) > ($1, $2, $3)`, which
//! PostgreSQL reads as one index range.

crate::sql::admin::record_admin!(super::PostgresStore, sqlx::Postgres);
