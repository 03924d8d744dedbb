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

        use idem_core::LockStore;

        idem_testkit::lock_conformance_tests!(async {
            Some(Arc::new(super::fixture().await?.store) as Arc<dyn LockStore>)
        });
    }
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

        use idem_core::LockStore;

        idem_testkit::lock_conformance_tests!(async {
            Some(Arc::new(super::fixture().await?.store) as Arc<dyn LockStore>)
        });
    }
}

/// A Redis that goes away makes every operation fail closed, with an error that says to try
/// again; when it is back, the same store works again without being rebuilt.
#[test]
fn an_outage_fails_closed_and_the_store_recovers_by_itself() {
    use std::time::Duration;

    use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, Timestamp};
    use idem_testkit::services::RedisServer;

    idem_testkit::block_on(async {
        let Some(mut server) = RedisServer::start() else {
            return;
        };
        let options = RedisOptions {
            response_timeout: Duration::from_secs(1),
            ..options()
        };
        let store = RedisStore::connect(&server.url(), options).await.unwrap();
        let req = |k: &str| {
            BeginRequest::new(
                Key::parse("s", "outage", k).unwrap(),
                Fingerprint::of_bytes(b"x"),
            )
        };
        assert!(matches!(
            store.begin(&req("before"), Timestamp::now()).await.unwrap(),
            BeginOutcome::Acquired(_)
        ));

        server.stop();
        for k in ["during-1", "during-2"] {
            let e = store.begin(&req(k), Timestamp::now()).await.unwrap_err();
            assert!(e.is_transient(), "{e}");
        }
        assert!(
            store
                .get(&req("before").key, Timestamp::now())
                .await
                .is_err()
        );

        server.restart();
        // The connection comes back by itself; give it a few tries.
        let mut outcome = None;
        for _ in 0..50 {
            if let Ok(o) = store.begin(&req("after"), Timestamp::now()).await {
                outcome = Some(o);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            matches!(outcome, Some(BeginOutcome::Acquired(_))),
            "{outcome:?}"
        );
    });
}

/// A server that may evict keys when full is refused (an evicted record lets its work run
/// again) unless eviction is allowed explicitly; a prefix with braces is refused.
#[test]
fn an_evicting_server_and_a_braced_prefix_are_refused() {
    use idem_testkit::services::RedisServer;

    idem_testkit::block_on(async {
        let Some(server) = RedisServer::start() else {
            return;
        };
        let client = redis::Client::open(server.url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        for (name, value) in [("maxmemory", "100mb"), ("maxmemory-policy", "allkeys-lru")] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query_async(&mut c)
                .await
                .unwrap();
        }
        let e = RedisStore::connect(&server.url(), options())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("evicts keys"), "{e}");
        let allowed = RedisOptions {
            allow_eviction: true,
            ..options()
        };
        assert!(RedisStore::connect(&server.url(), allowed).await.is_ok());

        let braced = RedisOptions {
            prefix: "app:{x}:".into(),
            ..options()
        };
        let e = RedisStore::connect(&REDIS.url().unwrap_or(server.url()), braced)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("prefix"), "{e}");
    });
}

/// A record's key holding something this store did not write (a hash, or a string of another
/// layout) fails every operation with an error and is never overwritten: the store cannot
/// tell what that record decided, so it decides nothing.
#[test]
fn a_value_the_store_did_not_write_is_refused_and_left_alone() {
    use idem_core::{BeginRequest, Fingerprint, Key, Lease, LeaseId, Store, Timestamp};

    idem_testkit::block_on(async {
        let Some(url) = REDIS.url() else {
            return;
        };
        let store = RedisStore::connect(&url, options()).await.unwrap();
        let mut c = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let now = Timestamp::now();
        let scope = format!("foreign-{}-{}", std::process::id(), now.as_millis());
        for (i, kind) in ["hash", "string"].into_iter().enumerate() {
            let key = Key::parse(&scope, "ns", &format!("k{i}")).unwrap();
            let at = store.redis_key(&key);
            if kind == "hash" {
                let _: () = redis::cmd("HSET")
                    .arg(&at)
                    .arg("st")
                    .arg("completed")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            } else {
                let _: () = redis::cmd("SET")
                    .arg(&at)
                    // Long enough to read as a record, were its first byte not checked.
                    .arg(format!("2c{}", "0".repeat(200)))
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"x"));
            assert!(store.begin(&req, now).await.is_err(), "{kind}: begin");
            assert!(store.get(&key, now).await.is_err(), "{kind}: get");
            let lease = Lease {
                id: LeaseId::from_bytes([7; 16]),
                fence: 1,
                expires_at: now,
            };
            let done = store
                .complete(&key, &lease, b"r".to_vec().into(), now)
                .await;
            assert!(done.is_err(), "{kind}: complete");
            assert!(store.reopen(&key, 1, now).await.is_err(), "{kind}: reopen");
            let kept: String = redis::cmd("TYPE")
                .arg(&at)
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(kept, kind, "the value was replaced");
            let _: () = redis::cmd("DEL")
                .arg(&at)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    });
}
