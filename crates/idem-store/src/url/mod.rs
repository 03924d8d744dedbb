//! Store URLs: how a store is named on the command line and in configuration.
//!
//! - `memory://`: an in-process store, forgotten at exit, for tests and a single process that
//!   may forget everything. `max_records=N` and `max_bytes=N` bound it (default 100000 and
//!   268435456, 256 MiB; see [`MemoryLimits`](crate::MemoryLimits)).
//! - `sqlite://PATH`: a SQLite file; `sqlite://idem.db` is relative to the working directory,
//!   `sqlite:///var/lib/idem/idem.db` is absolute. Options as a query string:
//!   `synchronous=full|normal`, `busy_timeout_ms=N` and `key_filter=on|off` (or
//!   `true|false`; off for a file whose keys other processes write most of; see
//!   `SqliteOptions::key_filter`).
//! - `postgres://user:password@host:port/database` (feature `postgres`): PostgreSQL. Besides
//!   the driver's own options, `idem_table=NAME` names the records table (default
//!   `idem_records`), `idem_pool=N` caps the connection pool (default 16) and `idem_batch=N`
//!   caps the records one statement begins or completes (default 64, at most 1024; 1 turns
//!   group commit off).
//! - `mysql://user:password@host:port/database` (feature `mysql`): MySQL or MariaDB, with the
//!   same `idem_table`, `idem_pool` and `idem_batch` options (`mariadb://` is accepted too).
//! - `redis://[:password@]host:port[/db]` (feature `redis`): one Redis server;
//!   `redis+cluster://host:port[,host:port…]`: a Redis Cluster, reached through any of the
//!   listed nodes. `idem_prefix=P` puts `P` before every key (default `idem:`); `idem_batch=N`
//!   caps the records one script call begins or completes on one server (default 64, at most
//!   1024; 1 turns group commit off; a Cluster sends every call on its own).

use std::str::FromStr;
use std::sync::Arc;

use idem_core::{LockStore, SharedLockStore, SharedStore, StoreError};

use crate::MemoryStore;

mod locks;
mod redact;

pub use locks::open_locks;
pub use redact::redact;

/// A parsed store URL. Its `Debug` form shows server URLs through [`redact`].
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreUrl {
    /// `memory://`, with its bounds.
    Memory(crate::MemoryLimits),
    /// `sqlite://PATH`
    #[cfg(feature = "sqlite")]
    #[non_exhaustive]
    Sqlite {
        /// The database file.
        path: std::path::PathBuf,
        /// Durability of each commit.
        synchronous: crate::Synchronous,
        /// How long to wait for another writer's lock, in milliseconds.
        busy_timeout_ms: u64,
        /// Whether a fresh key's `begin` may skip the read first (`SqliteOptions::key_filter`).
        key_filter: bool,
        /// Whether a missing file is created (`SqliteOptions::create`); always true when
        /// parsed, see [`StoreUrl::existing_only`].
        create: bool,
    },
    /// `redis://…` (one server) or `redis+cluster://…` (a Cluster, through these nodes).
    #[cfg(feature = "redis")]
    Redis {
        /// The server's URL, or each listed Cluster node's.
        nodes: Vec<String>,
        /// Whether it is a Cluster.
        cluster: bool,
        /// The store's options.
        options: crate::RedisOptions,
    },
    /// `mysql://…` or `mariadb://…`
    #[cfg(feature = "mysql")]
    MySql {
        /// The URL as the driver takes it (idem's own options removed).
        url: String,
        /// The store's options.
        options: crate::MySqlOptions,
    },
    /// `postgres://…` or `postgresql://…`
    #[cfg(feature = "postgres")]
    Postgres {
        /// The URL as the driver takes it (idem's own options removed).
        url: String,
        /// The store's options.
        options: crate::PostgresOptions,
    },
}

impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreUrl::Memory(limits) => f.debug_tuple("Memory").field(limits).finish(),
            #[cfg(feature = "sqlite")]
            StoreUrl::Sqlite {
                path,
                synchronous,
                busy_timeout_ms,
                key_filter,
                create,
            } => f
                .debug_struct("Sqlite")
                .field("path", path)
                .field("synchronous", synchronous)
                .field("busy_timeout_ms", busy_timeout_ms)
                .field("key_filter", key_filter)
                .field("create", create)
                .finish(),
            #[cfg(feature = "redis")]
            StoreUrl::Redis {
                nodes,
                cluster,
                options,
            } => f
                .debug_struct("Redis")
                .field(
                    "nodes",
                    &nodes.iter().map(|n| redact(n)).collect::<Vec<_>>(),
                )
                .field("cluster", cluster)
                .field("options", options)
                .finish(),
            #[cfg(feature = "mysql")]
            StoreUrl::MySql { url, options } => server(f, "MySql", url, options),
            #[cfg(feature = "postgres")]
            StoreUrl::Postgres { url, options } => server(f, "Postgres", url, options),
        }
    }
}

/// A SQL server's URL (redacted) and options, in the `Debug` form of a [`StoreUrl`].
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn server(
    f: &mut std::fmt::Formatter<'_>,
    name: &str,
    url: &str,
    options: &dyn std::fmt::Debug,
) -> std::fmt::Result {
    f.debug_struct(name)
        .field("url", &redact(url))
        .field("options", options)
        .finish()
}

/// Why a store URL was refused. The message is meant for a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StoreUrlError(String);

fn err(msg: impl Into<String>) -> StoreUrlError {
    StoreUrlError(msg.into())
}

/// The schemes this build understands, for error messages.
fn known_schemes() -> String {
    let mut schemes = vec!["memory://"];
    if cfg!(feature = "sqlite") {
        schemes.push("sqlite://PATH");
    }
    if cfg!(feature = "postgres") {
        schemes.push("postgres://");
    }
    if cfg!(feature = "mysql") {
        schemes.push("mysql://");
    }
    if cfg!(feature = "redis") {
        schemes.extend(["redis://", "redis+cluster://"]);
    }
    schemes.join(", ")
}

/// Splits idem's own `idem_*` options off a server URL's query: returns the URL without them,
/// and them as pairs.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "redis")),
    allow(dead_code)
)]
fn split_idem_options(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let (ours, theirs): (Vec<_>, Vec<_>) = query
        .split('&')
        .filter(|p| !p.is_empty())
        .partition(|p| p.starts_with("idem_"));
    let ours = ours
        .into_iter()
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect();
    let url = if theirs.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", theirs.join("&"))
    };
    (url, ours)
}

/// The `name=value` pairs of a URL query.
fn params(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
}

impl FromStr for StoreUrl {
    type Err = StoreUrlError;

    fn from_str(url: &str) -> Result<Self, StoreUrlError> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            // Not echoed: a URL may carry a password.
            err(format!(
                "the store URL has no scheme; expected one of {}",
                known_schemes()
            ))
        })?;
        let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
        match scheme {
            "memory" => {
                if !location.is_empty() {
                    return Err(err(
                        "memory:// takes no path, only the options max_records and max_bytes",
                    ));
                }
                let mut limits = crate::MemoryLimits::DEFAULT;
                for (name, value) in params(query) {
                    let bound = match name {
                        "max_records" => &mut limits.max_records,
                        "max_bytes" => &mut limits.max_bytes,
                        _ => {
                            return Err(err(format!(
                                "unknown memory:// option {name:?}; the options are max_records \
                                 and max_bytes"
                            )));
                        }
                    };
                    *bound = value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        err(format!(
                            "memory:// {name}={value:?} is not a positive whole number"
                        ))
                    })?;
                }
                Ok(StoreUrl::Memory(limits))
            }
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                if location.is_empty() {
                    return Err(err(
                        "sqlite:// needs a file path, as in sqlite://idem.db or sqlite:///var/lib/idem/idem.db",
                    ));
                }
                let mut synchronous = crate::Synchronous::Full;
                let mut busy_timeout_ms = 5_000;
                let mut key_filter = true;
                for (name, value) in params(query) {
                    match name {
                        "synchronous" => {
                            synchronous = match value.to_ascii_lowercase().as_str() {
                                "full" => crate::Synchronous::Full,
                                "normal" => crate::Synchronous::Normal,
                                _ => {
                                    return Err(err(format!(
                                        "synchronous={value:?} is not one of full, normal"
                                    )));
                                }
                            };
                        }
                        "busy_timeout_ms" => {
                            busy_timeout_ms = value.parse().map_err(|_| {
                                err(format!("busy_timeout_ms={value:?} is not a whole number"))
                            })?;
                        }
                        "key_filter" => {
                            key_filter = match value.to_ascii_lowercase().as_str() {
                                "on" | "true" => true,
                                "off" | "false" => false,
                                _ => {
                                    return Err(err(format!(
                                        "key_filter={value:?} is not one of on, off, true, false"
                                    )));
                                }
                            };
                        }
                        _ => {
                            return Err(err(format!(
                                "unknown sqlite option {name:?}; known: synchronous, \
                                 busy_timeout_ms, key_filter"
                            )));
                        }
                    }
                }
                Ok(StoreUrl::Sqlite {
                    path: location.into(),
                    synchronous,
                    busy_timeout_ms,
                    key_filter,
                    create: true,
                })
            }
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                let (url, ours) = sql_options(url)?;
                postgres_driver_options(&url)?;
                let mut options = crate::PostgresOptions::default();
                options.table = ours.table.unwrap_or(options.table);
                options.max_connections = ours.pool.unwrap_or(options.max_connections);
                options.max_batch = ours.batch.unwrap_or(options.max_batch);
                Ok(StoreUrl::Postgres { url, options })
            }
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => {
                let (url, ours) = sql_options(url)?;
                // The driver knows only `mysql://`; MariaDB speaks the same protocol.
                let url = url.replacen("mariadb://", "mysql://", 1);
                let mut options = crate::MySqlOptions::default();
                options.table = ours.table.unwrap_or(options.table);
                options.max_connections = ours.pool.unwrap_or(options.max_connections);
                options.max_batch = ours.batch.unwrap_or(options.max_batch);
                Ok(StoreUrl::MySql { url, options })
            }
            #[cfg(feature = "redis")]
            "redis" | "redis+cluster" => {
                let (url, ours) = split_idem_options(url);
                let mut options = crate::RedisOptions::default();
                for (name, value) in ours {
                    match name.as_str() {
                        "idem_prefix" => options.prefix = value,
                        "idem_batch" => options.max_batch = batch_size(&name, &value)?,
                        _ => {
                            return Err(err(format!(
                                "unknown option {name:?}; idem's own are idem_prefix, idem_batch"
                            )));
                        }
                    }
                }
                let cluster = scheme == "redis+cluster";
                let nodes = if cluster {
                    let rest = &url["redis+cluster://".len()..];
                    let (hosts, tail) = rest.split_once('/').map_or((rest, ""), |(h, t)| (h, t));
                    if !tail.is_empty() {
                        return Err(err("a Redis Cluster has no databases: drop the /db part"));
                    }
                    // Credentials written once, before the first host, are every node's: a
                    // Cluster client refuses nodes with different passwords.
                    let (userinfo, hosts) = match hosts.rsplit_once('@') {
                        Some((user, hosts)) => (format!("{user}@"), hosts),
                        None => (String::new(), hosts),
                    };
                    hosts
                        .split(',')
                        .map(|h| {
                            if h.is_empty() {
                                String::new()
                            } else {
                                format!("redis://{userinfo}{h}")
                            }
                        })
                        .collect()
                } else {
                    vec![url]
                };
                if nodes.iter().any(|n| n.len() <= "redis://".len()) {
                    return Err(err(format!(
                        "{scheme}:// needs a host, as in {scheme}://127.0.0.1:6379"
                    )));
                }
                Ok(StoreUrl::Redis {
                    nodes,
                    cluster,
                    options,
                })
            }
            other => Err(err(format!(
                "unknown store scheme {other:?}; this build knows {}",
                known_schemes()
            ))),
        }
    }
}

/// idem's options in a SQL server's URL.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Default)]
struct SqlOptions {
    table: Option<String>,
    pool: Option<u32>,
    batch: Option<usize>,
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
fn positive<N: FromStr + PartialOrd + Default>(
    name: &str,
    value: &str,
) -> Result<N, StoreUrlError> {
    value
        .parse()
        .ok()
        .filter(|n| *n > N::default())
        .ok_or_else(|| err(format!("{name}={value:?} is not a positive whole number")))
}

/// `idem_batch`: the most records one statement or script call begins or completes.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
fn batch_size(name: &str, value: &str) -> Result<usize, StoreUrlError> {
    let n: usize = positive(name, value)?;
    if n > crate::group_commit::MAX_JOBS {
        return Err(err(format!(
            "{name}={n} is more than {}",
            crate::group_commit::MAX_JOBS
        )));
    }
    Ok(n)
}

/// The query options the PostgreSQL driver reads (sqlx-postgres 0.9), besides `options[NAME]`.
#[cfg(feature = "postgres")]
const POSTGRES_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// Refuses a PostgreSQL URL option the driver does not read. The driver would ignore it with
/// a warning that prints its value, which for `sslpassword` (a libpq option it lacks) is a
/// secret; and an option silently ignored is a setting the user believes in but does not
/// have. The error names the option, never its value.
#[cfg(feature = "postgres")]
fn postgres_driver_options(url: &str) -> Result<(), StoreUrlError> {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let name = redact::percent_decoded(pair.split_once('=').map_or(pair, |(n, _)| n));
        let known = POSTGRES_OPTIONS.contains(&name.as_str())
            || name.starts_with("options[") && name.ends_with(']');
        if !known {
            // A name is shown only if it is one: followed by `=`, and spelled like a name (not
            // a value typed in its place).
            let plain = pair.contains('=')
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.[]".contains(&b));
            let shown = if plain {
                format!("{name:?}")
            } else {
                "(not shown)".into()
            };
            return Err(err(format!(
                "the PostgreSQL URL option {shown} is not one the driver reads (its value is \
                 not shown); it would be ignored, so it is refused. The options are {}, \
                 options[NAME], and idem's idem_table, idem_pool, idem_batch",
                POSTGRES_OPTIONS.join(", ")
            )));
        }
    }
    Ok(())
}

/// A SQL server URL without idem's options, and the options (`idem_table`, `idem_pool`,
/// `idem_batch`) it gave.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn sql_options(url: &str) -> Result<(String, SqlOptions), StoreUrlError> {
    let (url, given) = split_idem_options(url);
    let mut ours = SqlOptions::default();
    for (name, value) in given {
        match name.as_str() {
            "idem_table" => ours.table = Some(value),
            "idem_pool" => ours.pool = Some(positive(&name, &value)?),
            "idem_batch" => ours.batch = Some(batch_size(&name, &value)?),
            _ => {
                return Err(err(format!(
                    "unknown option {name:?}; idem's own are idem_table, idem_pool, idem_batch"
                )));
            }
        }
    }
    Ok((url, ours))
}

impl StoreUrl {
    /// This URL, opening only a store that exists: a SQLite file is not created when it is
    /// missing (the other stores are servers, and their tables are made on connecting).
    #[must_use]
    // Without SQLite there is nothing to change.
    #[cfg_attr(not(feature = "sqlite"), allow(unused_mut))]
    pub fn existing_only(mut self) -> Self {
        #[cfg(feature = "sqlite")]
        if let StoreUrl::Sqlite { create, .. } = &mut self {
            *create = false;
        }
        self
    }

    /// Opens the store this URL names (connecting, and applying migrations, for server
    /// stores).
    pub async fn open(&self) -> Result<SharedStore, StoreError> {
        Ok(self.open_with_locks().await?.0)
    }

    /// Opens the store, and the same store as a lock backend where it keeps locks (every
    /// store but MySQL/MariaDB), sharing its connections.
    pub async fn open_with_locks(
        &self,
    ) -> Result<(SharedStore, Option<SharedLockStore>), StoreError> {
        fn both<S: idem_core::Store + LockStore + Clone>(
            store: S,
        ) -> (SharedStore, Option<SharedLockStore>) {
            (Arc::new(store.clone()), Some(Arc::new(store)))
        }
        match self {
            StoreUrl::Memory(limits) => Ok(both(MemoryStore::with_limits(*limits))),
            #[cfg(feature = "sqlite")]
            StoreUrl::Sqlite {
                path,
                synchronous,
                busy_timeout_ms,
                key_filter,
                create,
            } => {
                let options = crate::SqliteOptions {
                    create: *create,
                    ..sqlite_options(*synchronous, *busy_timeout_ms, *key_filter)
                };
                Ok(both(crate::SqliteStore::open_with(path, options)?))
            }
            #[cfg(feature = "redis")]
            StoreUrl::Redis {
                nodes,
                cluster: false,
                options,
            } => Ok(both(
                crate::RedisStore::connect(&nodes[0], options.clone()).await?,
            )),
            #[cfg(feature = "redis")]
            StoreUrl::Redis {
                nodes,
                cluster: true,
                options,
            } => Ok(both(
                crate::RedisStore::connect_cluster(nodes, options.clone()).await?,
            )),
            #[cfg(feature = "mysql")]
            StoreUrl::MySql { url, options } => Ok((
                Arc::new(crate::MySqlStore::connect_with(url, options.clone()).await?),
                None,
            )),
            #[cfg(feature = "postgres")]
            StoreUrl::Postgres { url, options } => Ok(both(
                crate::PostgresStore::connect_with(url, options.clone()).await?,
            )),
        }
    }
}

/// Parses `url` and opens the store it names.
///
/// ```
/// # async fn demo() {
/// let store = idem_store::open("memory://").await.unwrap();
/// assert_eq!(store.kind(), "memory");
/// assert!(idem_store::open("mongodb://x").await.is_err());
/// # }
/// ```
pub async fn open(url: &str) -> Result<SharedStore, OpenError> {
    Ok(url.parse::<StoreUrl>()?.open().await?)
}

/// The SQLite store's settings a `sqlite://` URL names; the rest as by default.
#[cfg(feature = "sqlite")]
fn sqlite_options(
    synchronous: crate::Synchronous,
    busy_timeout_ms: u64,
    key_filter: bool,
) -> crate::SqliteOptions {
    crate::SqliteOptions {
        synchronous,
        busy_timeout: std::time::Duration::from_millis(busy_timeout_ms),
        key_filter,
        ..crate::SqliteOptions::default()
    }
}

/// Why [`open`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The URL was not understood.
    #[error(transparent)]
    Url(#[from] StoreUrlError),
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[cfg(test)]
mod tests;
