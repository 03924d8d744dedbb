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

/// Calls that arrive while others are in flight go to the server together (group commit: one
/// script call begins, or completes, many records), and each still gets its own answer: fresh
/// keys are acquired, a completed key replays, a held key is in progress, a key holding a value
/// the store did not write fails alone; each completion stores its own response, a repeated one
/// is accepted, a stale one refused, and one whose record turned foreign fails alone without
/// keeping the others from completing.
#[test]
fn calls_sent_together_each_get_their_own_answer() {
    use std::sync::Arc;

    use idem_core::{
        BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, LeaseError, Status, Store, StoreError,
        Timestamp,
    };

    /// The record commands clients sent since the last call (the server's slow log, set to
    /// log every command, cleared): how many, and the most keys one script call named.
    /// Commands a script runs are logged too, from no client address, and not counted.
    async fn sent(c: &mut redis::aio::MultiplexedConnection) -> (usize, usize) {
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
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            redis::Value::SimpleString(s) => s.clone(),
            _ => String::new(),
        };
        let (mut commands, mut widest) = (0, 0);
        for entry in log {
            let redis::Value::Array(fields) = entry else {
                continue;
            };
            let (Some(redis::Value::Array(args)), Some(client)) = (fields.get(3), fields.get(4))
            else {
                continue;
            };
            let name = args.first().map(text).unwrap_or_default().to_uppercase();
            if text(client).starts_with("?:") || !["SET", "EVALSHA", "EVAL"].contains(&&*name) {
                continue;
            }
            commands += 1;
            if name != "SET" {
                let keys = args
                    .get(2)
                    .map(text)
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                widest = widest.max(keys);
            }
        }
        (commands, widest)
    }

    idem_testkit::block_on(async {
        // A server of its own, so that its command counts are this test's.
        let Some(server) = idem_testkit::services::RedisServer::start() else {
            return;
        };
        let url = server.url();
        let store = Arc::new(RedisStore::connect(&url, options()).await.unwrap());
        let mut c = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        for (name, value) in [
            ("slowlog-log-slower-than", "0"),
            ("slowlog-max-len", "10000"),
        ] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query_async(&mut c)
                .await
                .unwrap();
        }
        let now = Timestamp::now();
        // 'static, so that the closures below are `Copy` and go into every task.
        let scope: &'static str =
            format!("batch-{}-{}", std::process::id(), now.as_millis()).leak();
        let key = move |i: usize| Key::parse(scope, "pay", &format!("k{i}")).unwrap();
        let req = move |i| BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"));
        let body = |i: usize| Bytes::from(format!("body {i}").into_bytes());
        // Holds every write command for a moment: the calls sent meanwhile queue, and go
        // together once it ends.
        let pause = {
            let c = c.clone();
            move || {
                let mut c = c.clone();
                async move {
                    let _: () = redis::cmd("CLIENT")
                        .arg("PAUSE")
                        .arg(300)
                        .arg("WRITE")
                        .query_async(&mut c)
                        .await
                        .unwrap();
                }
            }
        };
        let l0 = match store.begin(&req(0), now).await.unwrap() {
            BeginOutcome::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        store.complete(&key(0), &l0, body(0), now).await.unwrap();
        let BeginOutcome::Acquired(l1) = store.begin(&req(1), now).await.unwrap() else {
            panic!("k1 not acquired");
        };
        let _: () = redis::cmd("SET")
            .arg(store.redis_key(&key(2)))
            .arg("not a record")
            .query_async(&mut c)
            .await
            .unwrap();

        pause().await;
        sent(&mut c).await;
        let begins: Vec<_> = (0..40)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move { store.begin(&req(i), now).await })
            })
            .collect();
        let mut leases = Vec::new();
        for (i, begin) in begins.into_iter().enumerate() {
            match (i, begin.await.unwrap()) {
                (0, Ok(BeginOutcome::Replay(r))) => assert_eq!(r.response, body(0)),
                (1, Ok(BeginOutcome::InProgress { .. })) | (2, Err(StoreError::Corrupt(_))) => {}
                (i, Ok(BeginOutcome::Acquired(lease))) if i >= 3 => {
                    assert_eq!(lease.fence, 1);
                    leases.push((i, lease));
                }
                (i, other) => panic!("k{i}: {other:?}"),
            }
        }
        // One by one, forty begins are at least forty commands; together, a few script calls
        // and the three keys decided on their own (two commands each).
        let (begun, widest) = sent(&mut c).await;
        assert!(
            begun < 20 && widest > 1,
            "{begun} commands for 40 begins, {widest} keys at most"
        );

        // k0 completed again by its own lease (accepted), k1 by the lease of k39, which stays
        // in progress (refused), k3's record replaced by a foreign value (refused, and the
        // script that meets it stops part way), and every other fresh key with its own body.
        // (A batch tells its records apart by key, but the batcher also keeps two calls under
        // one lease id apart, so k39 itself is not completed here.)
        let (_, stale) = leases.pop().unwrap();
        let _: () = redis::cmd("SET")
            .arg(store.redis_key(&key(3)))
            .arg("not a record either")
            .query_async(&mut c)
            .await
            .unwrap();
        pause().await;
        sent(&mut c).await;
        let completes: Vec<_> = leases
            .iter()
            .copied()
            .chain([(0, l0), (1, stale)])
            .map(|(i, lease)| {
                let store = store.clone();
                let response = body(i);
                tokio::spawn(
                    async move { (i, store.complete(&key(i), &lease, response, now).await) },
                )
            })
            .collect();
        for complete in completes {
            match complete.await.unwrap() {
                (1, done) => assert!(matches!(done, Err(LeaseError::Stale(_))), "{done:?}"),
                (3, done) => assert!(
                    matches!(done, Err(LeaseError::Store(StoreError::Corrupt(_)))),
                    "{done:?}"
                ),
                (i, done) => assert!(done.is_ok(), "k{i}: {done:?}"),
            }
        }
        // The script meeting k3 stops part way, and the rest of its batch settles one by one.
        let (completed, widest) = sent(&mut c).await;
        assert!(
            widest > 1,
            "{completed} commands for 38 completes, {widest} keys at most"
        );
        for i in (0..39).filter(|i| ![1, 2, 3].contains(i)) {
            let r = store.get(&key(i), now).await.unwrap().unwrap();
            assert_eq!(
                (r.status, r.response),
                (Status::Completed, Some(body(i))),
                "k{i}"
            );
        }
        let r = store.get(&key(1), now).await.unwrap().unwrap();
        assert_eq!((r.status, r.fence), (Status::InProgress, l1.fence));
        let r = store.get(&key(39), now).await.unwrap().unwrap();
        assert_eq!(r.status, Status::InProgress);
    });
}

/// A listing in small pages sees each of thousands of records in a scope exactly once, and
/// nothing else: not the counters and locks beside them, nor values the store did not write at
/// keys shaped like a record's. A count agrees. On one server and on a Cluster.
#[test]
fn a_listing_sees_every_record_once_and_nothing_else() {
    idem_testkit::block_on(async {
        if let Some(url) = REDIS.url() {
            let store = RedisStore::connect(&url, options()).await.unwrap();
            let client = redis::Client::open(url).unwrap();
            let mut raw = client.get_multiplexed_async_connection().await.unwrap();
            every_record_once(store, &mut raw).await;
        }
        if let Some(cluster) = idem_testkit::services::RedisCluster::shared() {
            let urls = cluster.urls();
            let store = RedisStore::connect_cluster(&urls[..1], options())
                .await
                .unwrap();
            let client = redis::cluster::ClusterClient::new(urls).unwrap();
            let mut raw = client.get_async_connection().await.unwrap();
            every_record_once(store, &mut raw).await;
        }
    });
}

async fn every_record_once(store: RedisStore, raw: &mut impl redis::aio::ConnectionLike) {
    use std::collections::HashSet;
    use std::time::Duration;

    use idem_core::{
        BeginOutcome, BeginRequest, Counters, Cursor, Fingerprint, Key, LockName, LockStore,
        OwnerDigest, RecordFilter, RecordState, Repair, Scope, Shown, Store, Timestamp,
    };

    const RECORDS: usize = 3000;

    let now = Timestamp::now();
    let scope = format!("listing-{}-{}", std::process::id(), now.as_millis());
    let key = |i: usize| Key::parse(&scope, "ns", &format!("k{i}")).unwrap();
    let ids: Vec<usize> = (0..RECORDS).collect();
    for chunk in ids.chunks(250) {
        let begins: Vec<_> = chunk
            .iter()
            .map(|&i| {
                let store = store.clone();
                // Short-lived, should the test stop before it deletes them.
                let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"x"))
                    .with_ttl(Duration::from_secs(60));
                tokio::spawn(async move { store.begin(&req, now).await })
            })
            .collect();
        for begin in begins {
            let outcome = begin.await.unwrap().unwrap();
            assert!(matches!(outcome, BeginOutcome::Acquired(_)), "{outcome:?}");
        }
    }
    // Counters of some records' keys and of keys with no record, and locks.
    for i in (0..RECORDS).step_by(300) {
        store.advance(&key(i), 1).await.unwrap();
        store.advance(&key(RECORDS + i), 1).await.unwrap();
        let lock = LockName::new(&format!("{scope}-lock-{i}")).unwrap();
        LockStore::acquire(&store, &lock, OwnerDigest([1; 32]), Duration::from_secs(60))
            .await
            .unwrap();
    }
    // Keys shaped like a record's, holding what the store did not write.
    let strays = [
        format!("idem-test:{{{:032}}}", now.as_millis()),
        format!("idem-test:{{{:032}}}", now.as_millis() + 1),
    ];
    let _: () = redis::cmd("HSET")
        .arg(&strays[0])
        .arg("st")
        .arg("c")
        .query_async(raw)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&strays[1])
        .arg("2c")
        .query_async(raw)
        .await
        .unwrap();

    let admin = store.admin().unwrap();
    let filter = RecordFilter {
        scope: Some(Scope::new(scope.clone()).unwrap()),
        ..RecordFilter::default()
    };
    for limit in [7, 100] {
        let mut seen = HashSet::new();
        let mut after: Option<Cursor> = None;
        for page in 0.. {
            assert!(page < 100_000, "a listing that never ends");
            let page = admin
                .list(&filter, after.as_ref(), limit, now)
                .await
                .unwrap();
            assert!(page.records.len() <= limit + 64, "{}", page.records.len());
            for listed in page.records {
                assert_eq!(listed.key.scope().as_str(), scope);
                let name = listed.key.client_key().as_str().to_owned();
                assert!(seen.insert(name), "listed twice");
            }
            match page.next {
                Some(next) => after = Some(next.to_string().parse().unwrap()),
                None => break,
            }
        }
        let expected: HashSet<String> = (0..RECORDS).map(|i| format!("k{i}")).collect();
        assert_eq!(seen, expected, "pages of {limit}");
    }
    let counts = admin.count(&filter, now).await.unwrap();
    assert_eq!(
        (counts.in_progress, counts.total()),
        (RECORDS as u64, RECORDS as u64)
    );
    for stray in &strays {
        let _: () = redis::cmd("DEL").arg(stray).query_async(raw).await.unwrap();
    }
    // Deleted by fenced repairs, as an operator would.
    let shown = Shown {
        state: RecordState::InProgress,
        fence: 1,
    };
    for chunk in ids.chunks(250) {
        let deletes: Vec<_> = chunk
            .iter()
            .map(|&i| {
                let store = store.clone();
                let key = key(i);
                tokio::spawn(async move {
                    let admin = store.admin().unwrap();
                    admin.repair(&key, shown, Repair::Delete, now).await
                })
            })
            .collect();
        for delete in deletes {
            assert!(delete.await.unwrap().unwrap());
        }
    }
    assert_eq!(admin.count(&filter, now).await.unwrap().total(), 0);
}
