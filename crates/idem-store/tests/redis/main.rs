//! The Redis store against real servers: the conformance suite on the project's Redis, and on
//! a three-node Redis Cluster this test starts itself. Skipped (with a note) when there is no
//! Redis, except under `CI=true`.

#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used)]

use idem_store::{RedisOptions, RedisStore};
use idem_testkit::conformance::Fixture;
use idem_testkit::services::REDIS;

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

mod batching;
mod failures;
mod listing;
mod valkey;
