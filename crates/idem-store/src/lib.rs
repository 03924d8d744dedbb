//! Stores for idem's idempotency records.
//!
//! - [`MemoryStore`]: in-process, for tests and throwaway use.
//! - [`SqliteStore`] (feature `sqlite`, on by default): the embedded default. One file, nothing
//!   to install; safe for many tasks and several processes on one file.
//! - `PostgresStore` (feature `postgres`), `MySqlStore` (feature `mysql`, MySQL and MariaDB)
//!   and `RedisStore` (feature `redis`, single node or Cluster): for many processes sharing
//!   records on the servers they already run.
//!
//! [`ReplayCache`] wraps any of them and answers replays of completed records from memory.
//! Locks may also live apart from records: `ZooKeeperLocks` (feature `zookeeper`) and
//! `EtcdLocks` (feature `etcd`), opened by URL with [`open_locks`].
//!
//! [`open`] picks a store from a URL (`sqlite://PATH`, `memory://`, `postgres://…`,
//! `mysql://…`, `redis://…`, `redis+cluster://…`), as `idem serve --store` does.
//!
//! # Layout
//!
//! One module per store: `memory`, `sqlite/`, `postgres/`, `mysql/` and `redis/`. Each
//! directory keeps the store and its options in `mod.rs`, its operations on records in
//! `records.rs`, its locks in `locks.rs` (PostgreSQL, Redis, SQLite), its schema in
//! `migrate.rs` (PostgreSQL, MySQL; `schema.rs` for SQLite) and the classification of its
//! errors in `error.rs` (PostgreSQL, MySQL, Redis); SQLite's writer thread is `sqlite/writer.rs`, Redis's
//! Lua scripts `redis/scripts.rs` and its record layout `redis/format.rs`. PostgreSQL and MySQL
//! are one store written once in `sql/` (`SqlStore`, `sql/store.rs`; its records path
//! `sql/records.rs`, over the hooks of the `Server` each implements in its `records.rs`), with
//! the `Dialect` each implements, the migration steps, the classification of errors and the
//! reading of rows (`row.rs`, also SQLite's); their folders keep what is each server's own.
//! Group commit for the server stores is `group_commit/`, fenced writes [`fenced`], the
//! release feed that wakes lock waiters `lock_wakeup.rs`, and URL parsing `url/`. The lock
//! services' stores are `zookeeper/` and `etcd/`: the store and its session in `mod.rs`, the
//! queue of one lock name in `queue.rs`.

#[cfg(feature = "etcd")]
mod etcd;
pub mod fenced;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
mod group_commit;
mod lock_wakeup;
mod memory;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod replay_cache;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
mod reread;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod row;
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
mod session;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
mod url;
#[cfg(feature = "zookeeper")]
mod zookeeper;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdLocks, EtcdOptions};
pub use fenced::Fenced;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use fenced::SqlFences;
pub use memory::{MemoryLimits, MemoryStore, RECORD_OVERHEAD};
#[cfg(feature = "mysql")]
pub use mysql::{MySqlOptions, MySqlStore};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresOptions, PostgresStore};
#[cfg(feature = "redis")]
#[doc(hidden)]
pub use redis::lock_scripts;
#[cfg(feature = "redis")]
pub use redis::{Conn as RedisConnection, EXPIRY_MARGIN, RedisOptions, RedisStore};
pub use replay_cache::{ReplayCache, ReplayCacheLimits};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use sql::{SqlOptions, SqlStore};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteOptions, SqliteStore, Synchronous};
pub use url::{OpenError, StoreUrl, StoreUrlError, open, open_locks, redact};
#[cfg(feature = "zookeeper")]
pub use zookeeper::{ZooKeeperLocks, ZooKeeperOptions};
