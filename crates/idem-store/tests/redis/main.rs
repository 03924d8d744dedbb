//! The Redis store against real servers: the conformance suite on the project's Redis, and on
//! a three-node Redis Cluster this test starts itself. Skipped (with a note) when there is no
//! Redis, except under `CI=true`.

#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used)]

use idem_store::{RedisOptions, RedisStore};
use idem_testkit::conformance::Fixture;
use idem_testkit::services::{REDIS, RedisServer};

fn options() -> RedisOptions {
    RedisOptions {
        prefix: "idem-test:".into(),
        // The test servers keep nothing on disk; the suite checks what counters do, not what
        // survives a restart.
        allow_volatile_counters: true,
        ..RedisOptions::default()
    }
}

mod single {
    use super::*;

    async fn fixture() -> Option<Fixture<RedisStore>> {
        let url = REDIS.url()?;
        Some(Fixture::new(
            RedisStore::connect(&url, options()).await.unwrap(),
        ))
    }

    idem_testkit::conformance_tests!(fixture());

    mod locks {
        use std::sync::Arc;

        use idem_core::SharedLockStore;

        idem_testkit::lock_conformance_tests!(async {
            Some(Arc::new(super::fixture().await?.store) as SharedLockStore)
        });
    }
}

/// Behind a replay cache, the Redis store still answers as it does alone.
mod cached {
    use super::*;
    use idem_store::{ReplayCache, ReplayCacheLimits};

    async fn fixture() -> Option<Fixture<ReplayCache<RedisStore>>> {
        let url = REDIS.url()?;
        let store = RedisStore::connect(&url, options()).await.unwrap();
        Some(Fixture::new(ReplayCache::new(
            store,
            ReplayCacheLimits::default(),
        )))
    }

    idem_testkit::conformance_tests!(fixture());
}

mod cluster {
    use super::*;
    use idem_testkit::services::RedisCluster;

    async fn fixture() -> Option<Fixture<RedisStore>> {
        let cluster = RedisCluster::shared()?;
        // Through one node only: the client learns the others and follows redirects.
        let store = RedisStore::connect_cluster(&cluster.urls()[..1], options())
            .await
            .unwrap();
        Some(Fixture::new(store))
    }

    idem_testkit::conformance_tests!(fixture());

    mod locks {
        use std::sync::Arc;

        use idem_core::SharedLockStore;

        idem_testkit::lock_conformance_tests!(async {
            Some(Arc::new(super::fixture().await?.store) as SharedLockStore)
        });
    }
}

/// How many times the server ran each command since it started (`INFO commandstats`).
pub(crate) fn calls(server: &RedisServer, command: &str) -> u64 {
    server
        .info("commandstats")
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

pub(crate) fn scripts(server: &RedisServer) -> u64 {
    calls(server, "evalsha") + calls(server, "eval")
}

/// Sets the server's settings `pairs` (`CONFIG SET`).
async fn configure(c: &mut redis::aio::MultiplexedConnection, pairs: &[(&str, &str)]) {
    for (name, value) in pairs {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(c)
            .await
            .unwrap();
    }
}

/// Has the server log every command from now on (its slow log, for [`commands_sent`]).
async fn log_every_command(c: &mut redis::aio::MultiplexedConnection) {
    let every = [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "10000"),
    ];
    configure(c, &every).await;
}

/// Holds every write command for 300 ms: the calls a store sends meanwhile queue, and go
/// together once it ends (group commit).
async fn pause_writes(c: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(300)
        .arg("WRITE")
        .query_async(c)
        .await
        .unwrap();
}

/// The commands clients sent since the last call, each as its arguments in upper case, and
/// then forgotten (`SLOWLOG RESET`). Commands a script runs are logged with no client
/// address on Redis 7, and left out; Valkey logs them as its caller's, and they are in.
async fn commands_sent(c: &mut redis::aio::MultiplexedConnection) -> Vec<Vec<String>> {
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(c)
        .await
        .unwrap();
    let _: () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async(c)
        .await
        .unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).to_uppercase(),
        redis::Value::SimpleString(s) => s.to_uppercase(),
        _ => String::new(),
    };
    log.iter()
        .filter_map(|entry| {
            let redis::Value::Array(fields) = entry else {
                return None;
            };
            let (Some(redis::Value::Array(args)), Some(client)) = (fields.get(3), fields.get(4))
            else {
                return None;
            };
            (!text(client).starts_with("?:")).then(|| args.iter().map(text).collect())
        })
        .collect()
}

/// How many of the commands clients sent since the last call (see [`commands_sent`]) are
/// claims as a batch sends them (`SET … NX PX`, without the `GET` of a claim sent alone).
async fn batched_claims(c: &mut redis::aio::MultiplexedConnection) -> usize {
    let batched = |args: &Vec<String>| {
        let has = |word: &str| args.iter().skip(3).any(|a| a == word);
        args.first().is_some_and(|a| a == "SET") && has("NX") && !has("GET")
    };
    commands_sent(c).await.iter().filter(|a| batched(a)).count()
}

mod batching;
mod failures;
mod listing;
mod locks;
mod valkey;
