//! The `idem` command's subcommands, one module each, and what they share: opening a store,
//! the replay cache's flags, and `migrate`, which is only that.

pub(crate) mod gateway;
pub(crate) mod id;
mod listen;
mod parse;
pub(crate) mod records;
pub(crate) mod relay;
pub(crate) mod serve;

use std::sync::Arc;
use std::time::Duration;

use idem_core::SharedStore;
use idem_ops::metered::Metered;
use idem_store::StoreUrl;
use tracing::info;

use parse::parse_cache_age;

#[derive(clap::Args)]
pub(crate) struct MigrateArgs {
    /// The store, as for serve: sqlite://PATH, postgres://…, mysql://…, redis://…
    #[arg(long, env = "IDEM_STORE")]
    store: String,
}

/// The replay cache, shared by serve and gateway: completed records answered from memory.
#[derive(clap::Args)]
pub(crate) struct ReplayCacheArgs {
    /// How many completed answers to keep in memory, so that their replays skip the store; 0
    /// turns the cache off.
    #[arg(long, env = "IDEM_REPLAY_CACHE_ENTRIES", default_value_t = 10_000)]
    replay_cache_entries: usize,

    /// How many bytes of answers (and keys) the replay cache keeps at most.
    #[arg(long, env = "IDEM_REPLAY_CACHE_BYTES", default_value_t = 32 << 20)]
    replay_cache_bytes: usize,

    /// How long an answer stays in the replay cache at most (even if its record lives
    /// longer): the longest another instance, or `idem records`, may take to see its repair
    /// of a completed record here (at most 1h).
    #[arg(long, env = "IDEM_REPLAY_CACHE_MAX_AGE", default_value = "60s", value_parser = parse_cache_age)]
    replay_cache_max_age: Duration,
}

impl ReplayCacheArgs {
    /// `store` behind the replay cache, unless it is off; `skip` keeps answers out of it.
    pub(crate) fn wrap(&self, store: SharedStore, skip: Option<fn(&[u8]) -> bool>) -> SharedStore {
        if self.replay_cache_entries == 0 {
            return store;
        }
        let limits = idem_store::ReplayCacheLimits {
            entries: self.replay_cache_entries,
            bytes: self.replay_cache_bytes,
            max_age: self.replay_cache_max_age,
        };
        let mut cache = idem_store::ReplayCache::new(store, limits);
        if let Some(skip) = skip {
            cache = cache.skip(skip);
        }
        tokio::spawn(idem_ops::metrics::watch_replay_cache(cache.clone()));
        Arc::new(cache)
    }
}

/// Opens the store at `url` and, where it keeps them, its locks; an in-memory store also
/// publishes its size as gauges. The error names the store with any password hidden.
pub(crate) async fn open_with_locks(
    url: &str,
) -> Result<(SharedStore, Option<idem_core::SharedLockStore>), String> {
    let parsed: StoreUrl = url
        .parse()
        .map_err(|e| format!("invalid store URL {:?}: {e}", idem_store::redact(url)))?;
    // Installed before the store is wrapped: metric handles taken earlier record nothing.
    idem_ops::metrics::Registry::global();
    let metered = |store: SharedStore| -> SharedStore { Arc::new(Metered::new(store)) };
    if let StoreUrl::Memory(limits) = &parsed {
        let store = idem_store::MemoryStore::with_limits(*limits);
        tokio::spawn(idem_ops::metrics::watch_memory_store(store.clone()));
        return Ok((metered(Arc::new(store.clone())), Some(Arc::new(store))));
    }
    let (store, locks) = parsed
        .open_with_locks()
        .await
        .map_err(|e| format!("store {:?}: {e}", idem_store::redact(url)))?;
    Ok((metered(store), locks))
}

/// Opens the store at `url`; the error names it with any password hidden.
pub(crate) async fn open_store(url: &str) -> Result<SharedStore, String> {
    opened(url, |parsed| parsed).await
}

/// The store for a command that runs once and exits: as [`open_store`], but a SQLite file's
/// key filter is not loaded. A command's few `begin`s gain nothing from it, and its load
/// would take the read connection that listings and counts use first.
pub(crate) async fn open_store_once(url: &str) -> Result<SharedStore, String> {
    opened(url, without_key_filter).await
}

/// The store for a tool that looks at and mends an existing store (`idem records`): as
/// [`open_store_once`], and a SQLite file that is not there is an error, not a new, empty
/// database.
pub(crate) async fn open_existing_store(url: &str) -> Result<SharedStore, String> {
    opened(url, |url| without_key_filter(url).existing_only()).await
}

/// Parses `url`, adjusts it and opens the store, as [`idem_store::open`] does.
async fn opened(
    url: &str,
    adjust: impl FnOnce(idem_store::StoreUrl) -> idem_store::StoreUrl,
) -> Result<SharedStore, String> {
    let opened = match url.parse() {
        Ok(parsed) => adjust(parsed)
            .open()
            .await
            .map_err(idem_store::OpenError::from),
        Err(e) => Err(idem_store::OpenError::from(e)),
    };
    opened.map_err(|e| format!("store {:?}: {e}", idem_store::redact(url)))
}

/// `url` with a SQLite file's key filter off; any other store as it is.
fn without_key_filter(mut url: idem_store::StoreUrl) -> idem_store::StoreUrl {
    if let idem_store::StoreUrl::Sqlite { key_filter, .. } = &mut url {
        *key_filter = false;
    }
    url
}

/// `e` and the errors beneath it, as one line: "connecting to the broker: Connection refused".
pub(crate) fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text = format!("{text}: {c_text}");
        }
        cause = c.source();
    }
    text
}

pub(crate) async fn migrate(args: &MigrateArgs) -> Result<(), String> {
    // Opening a store applies whatever migrations it lacks, under the store's own lock.
    let store = open_store_once(&args.store).await?;
    info!(store = store.kind(), "the store's schema is up to date");
    Ok(())
}

#[cfg(test)]
mod tests {
    use idem_store::StoreUrl;

    use super::without_key_filter;

    /// The one-shot commands open SQLite without the key filter, even when the URL asks for it,
    /// and leave other stores' URLs alone.
    #[test]
    fn one_shot_commands_turn_the_key_filter_off() {
        for url in ["sqlite://idem.db", "sqlite://idem.db?key_filter=on"] {
            let url = without_key_filter(url.parse().unwrap());
            assert!(
                matches!(
                    url,
                    StoreUrl::Sqlite {
                        key_filter: false,
                        ..
                    }
                ),
                "{url:?}"
            );
        }
        let memory: StoreUrl = "memory://".parse().unwrap();
        assert_eq!(without_key_filter(memory.clone()), memory);
    }
}
