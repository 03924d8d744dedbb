//! The operator's view of a [`MySqlStore`](super::MySqlStore): listing, counting and fenced
//! repairs, as `crate::sql::admin` writes them for both dialects. A page's bound after the
//! cursor is spelled out column by column (`scope > ? OR (scope = ? AND …)`): MariaDB reads a
//! row comparison by scanning the key index from its start. Keys are `VARBINARY`, so pages
//! follow byte order.

crate::sql::admin::record_admin!(super::MySqlStore, sqlx::MySql);
