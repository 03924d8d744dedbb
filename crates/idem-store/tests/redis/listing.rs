//! The operator's listing over `SCAN`, on one server and on a Cluster.

use super::*;

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
        fence: idem_core::Lease::first_fence(now),
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
