//! Outages, servers the store refuses, values it did not write, expiries far ahead.

use super::*;

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
        configure(
            &mut c,
            &[("maxmemory", "100mb"), ("maxmemory-policy", "allkeys-lru")],
        )
        .await;
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
    use idem_core::{BeginRequest, Fingerprint, Key, Lease, LeaseId, Store, StoreError, Timestamp};

    fn corrupt<T>(r: &Result<T, StoreError>) -> bool {
        matches!(r, Err(StoreError::Corrupt(_)))
    }

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
        // A hash; a string of another layout; strings that begin like a record but are not
        // one (no state, no numbers), long enough to be read as one were only their first
        // byte checked.
        let strings = [
            format!("2c{}", "0".repeat(200)),
            format!("1{}", "0".repeat(200)),
            format!("1{}", "9".repeat(200)),
            format!("1p{}", "x".repeat(200)),
            // Every field in place but the creation time, and long expired: taken for a
            // record, it would be taken over.
            format!(
                "1c{}{}{:020}{:016}{:016}{}{:016}{:016}resp",
                "f".repeat(32),
                "l".repeat(16),
                1,
                1,
                1000,
                "x".repeat(16),
                1,
                2
            ),
        ];
        let values = std::iter::once(None).chain(strings.iter().map(Some));
        for (i, value) in values.enumerate() {
            let kind = if value.is_some() { "string" } else { "hash" };
            let key = Key::parse(&scope, "ns", &format!("k{i}")).unwrap();
            let at = store.redis_key(&key);
            if let Some(value) = value {
                let _: () = redis::cmd("SET")
                    .arg(&at)
                    .arg(value)
                    .query_async(&mut c)
                    .await
                    .unwrap();
            } else {
                let _: () = redis::cmd("HSET")
                    .arg(&at)
                    .arg("st")
                    .arg("completed")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"x"));
            assert!(corrupt(&store.begin(&req, now).await), "{i}: begin");
            assert!(corrupt(&store.get(&key, now).await), "{i}: get");
            let lease = Lease {
                id: LeaseId::from_bytes([7; 16]),
                fence: 1,
                expires_at: now,
            };
            let done = store
                .complete(&key, &lease, b"r".to_vec().into(), now)
                .await;
            assert!(done.is_err(), "{i}: complete");
            assert!(corrupt(&store.reopen(&key, 1, now).await), "{i}: reopen");
            let kept: String = redis::cmd("TYPE")
                .arg(&at)
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(kept, kind, "{i}: the value was replaced");
            if let Some(value) = value {
                let kept: String = redis::cmd("GET")
                    .arg(&at)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                assert_eq!(&kept, value, "{i}: the value was replaced");
            }
            let _: () = redis::cmd("DEL")
                .arg(&at)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    });
}

/// Expiries far ahead (a lease and TTL of `Duration::MAX`; a clock far in the future with a
/// long TTL) still fit the record: it stays readable, and a completed record replays.
#[test]
fn far_expiries_keep_the_record_whole() {
    use std::time::Duration;

    use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, Timestamp};

    idem_testkit::block_on(async {
        let Some(url) = REDIS.url() else {
            return;
        };
        let store = RedisStore::connect(&url, options()).await.unwrap();
        let now = Timestamp::now();
        let scope = format!("far-{}-{}", std::process::id(), now.as_millis());
        let fp = Fingerprint::of_bytes(b"x");

        let key = Key::parse(&scope, "ns", "forever").unwrap();
        let req = BeginRequest::new(key.clone(), fp)
            .with_lease(Duration::MAX)
            .with_ttl(Duration::MAX);
        let BeginOutcome::Acquired(lease) = store.begin(&req, now).await.unwrap() else {
            panic!("not acquired");
        };
        let lease = store.renew(&key, &lease, Duration::MAX, now).await.unwrap();
        assert!(store.get(&key, now).await.unwrap().is_some());
        store
            .complete(&key, &lease, b"done".to_vec().into(), now)
            .await
            .unwrap();
        assert!(matches!(
            store.begin(&req, now).await.unwrap(),
            BeginOutcome::Replay(r) if r.response.as_ref() == b"done"
        ));

        // A clock far ahead, where now plus the TTL passes the largest exact timestamp.
        let later = Timestamp::from_millis(5_000_000_000_000_000);
        let key = Key::parse(&scope, "ns", "later").unwrap();
        let req = BeginRequest::new(key.clone(), fp)
            .with_ttl(Duration::from_millis(6_000_000_000_000_000));
        let BeginOutcome::Acquired(lease) = store.begin(&req, later).await.unwrap() else {
            panic!("not acquired");
        };
        store
            .complete(&key, &lease, b"once".to_vec().into(), later)
            .await
            .unwrap();
        let after = Timestamp::from_millis(5_000_000_000_001_000);
        assert!(matches!(
            store.begin(&req, after).await.unwrap(),
            BeginOutcome::Replay(r) if r.response.as_ref() == b"once"
        ));
    });
}
