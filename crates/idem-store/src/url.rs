//! Store URLs: how a store is named on the command line and in configuration.
//!
//! - `memory://`: an in-process store, forgotten at exit.
//! - `sqlite://PATH`: a SQLite file; `sqlite://idem.db` is relative to the working directory,
//!   `sqlite:///var/lib/idem/idem.db` is absolute. Options as a query string:
//!   `synchronous=full|normal` and `busy_timeout_ms=N`.

use std::str::FromStr;
use std::sync::Arc;

use idem_core::{SharedStore, StoreError};

use crate::MemoryStore;

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreUrl {
    /// `memory://`
    Memory,
    /// `sqlite://PATH`
    #[cfg(feature = "sqlite")]
    Sqlite {
        /// The database file.
        path: std::path::PathBuf,
        /// Durability of each commit.
        synchronous: crate::Synchronous,
        /// How long to wait for another writer's lock, in milliseconds.
        busy_timeout_ms: u64,
    },
}

/// Why a store URL was refused. The message is meant for a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StoreUrlError(String);

fn err(msg: impl Into<String>) -> StoreUrlError {
    StoreUrlError(msg.into())
}

/// The schemes this build understands, for error messages.
fn known_schemes() -> &'static str {
    if cfg!(feature = "sqlite") {
        "memory://, sqlite://PATH"
    } else {
        "memory://"
    }
}

/// The `name=value` pairs of a URL query.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
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
            err(format!(
                "store URL {url:?} has no scheme; expected one of {}",
                known_schemes()
            ))
        })?;
        let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
        match scheme {
            "memory" => {
                if !location.is_empty() || !query.is_empty() {
                    return Err(err("memory:// takes no path or options"));
                }
                Ok(StoreUrl::Memory)
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
                        _ => {
                            return Err(err(format!(
                                "unknown sqlite option {name:?}; known: synchronous, busy_timeout_ms"
                            )));
                        }
                    }
                }
                Ok(StoreUrl::Sqlite {
                    path: location.into(),
                    synchronous,
                    busy_timeout_ms,
                })
            }
            other => Err(err(format!(
                "unknown store scheme {other:?}; this build knows {}",
                known_schemes()
            ))),
        }
    }
}

impl StoreUrl {
    /// Opens the store this URL names.
    pub fn open(&self) -> Result<SharedStore, StoreError> {
        match self {
            StoreUrl::Memory => Ok(Arc::new(MemoryStore::new())),
            #[cfg(feature = "sqlite")]
            StoreUrl::Sqlite {
                path,
                synchronous,
                busy_timeout_ms,
            } => {
                let options = crate::SqliteOptions {
                    synchronous: *synchronous,
                    busy_timeout: std::time::Duration::from_millis(*busy_timeout_ms),
                    ..crate::SqliteOptions::default()
                };
                Ok(Arc::new(crate::SqliteStore::open_with(path, options)?))
            }
        }
    }
}

/// Parses `url` and opens the store it names.
///
/// ```
/// let store = idem_store::open("memory://").unwrap();
/// assert_eq!(store.kind(), "memory");
/// assert!(idem_store::open("mongodb://x").is_err());
/// ```
pub fn open(url: &str) -> Result<SharedStore, OpenError> {
    Ok(url.parse::<StoreUrl>()?.open()?)
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
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        assert_eq!("memory://".parse(), Ok(StoreUrl::Memory));
        assert!("memory://x".parse::<StoreUrl>().is_err());
        assert!("idem.db".parse::<StoreUrl>().is_err());
        assert!("redis2://x".parse::<StoreUrl>().is_err());
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn parses_sqlite_paths_and_options() {
        assert_eq!(
            "sqlite:///var/lib/idem.db?synchronous=normal&busy_timeout_ms=10".parse(),
            Ok(StoreUrl::Sqlite {
                path: "/var/lib/idem.db".into(),
                synchronous: crate::Synchronous::Normal,
                busy_timeout_ms: 10
            })
        );
        assert!(matches!(
            "sqlite://idem.db".parse(),
            Ok(StoreUrl::Sqlite { path, synchronous: crate::Synchronous::Full, .. }) if path == std::path::Path::new("idem.db")
        ));
        for bad in [
            "sqlite://",
            "sqlite://x.db?synchronous=off",
            "sqlite://x.db?busy_timeout_ms=soon",
            "sqlite://x.db?journal=delete",
        ] {
            let e = bad.parse::<StoreUrl>().unwrap_err();
            assert!(!e.to_string().is_empty(), "{bad}");
        }
    }
}
