//! The key filter's tests: what it answers, and its load from the table in slices.

use std::time::Duration;

use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Store, Timestamp};

use super::*;
use crate::SqliteStore;

fn key(i: usize) -> Key {
    Key::parse("s", "n", &format!("k{i}")).unwrap()
}

/// Waits until no load is queued or running, and one has been made.
async fn settled(known: &KnownKeys) -> usize {
    for _ in 0..3000 {
        {
            let filters = known.read();
            if let (false, Some(current)) = (filters.rebuilding, &filters.current) {
                return current.capacity;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the key filter never finished loading");
}

/// Keys written before the store opened are loaded, keys begun since are learnt, a filter
/// outgrown is replaced by a larger one that still holds every key, and a key never
/// written is mostly said to be absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_written_is_known_and_most_others_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let now = Timestamp::now();
    let begin = |store: SqliteStore, i: usize| async move {
        let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"f"));
        let got = store.begin(&req, now).await.unwrap();
        assert!(matches!(got, BeginOutcome::Acquired(_)), "{i}: {got:?}");
    };
    let before = SqliteStore::open(&path).unwrap();
    for i in 0..100 {
        begin(before.clone(), i).await;
    }
    drop(before);

    let store = SqliteStore::open(&path).unwrap();
    let known = Arc::clone(store.known.as_ref().unwrap());
    assert_eq!(settled(&known).await, 200, "sized for twice the table");
    for i in 100..400 {
        begin(store.clone(), i).await;
    }
    assert!(settled(&known).await > 200, "grown once outgrown");
    for i in 0..400 {
        assert!(known.may_hold(&key(i)), "key {i} was written");
    }
    let others = (1000..11_000).filter(|i| known.may_hold(&key(*i))).count();
    assert!(
        others < 500,
        "{others} of 10,000 unwritten keys said to be held"
    );
}

/// Begins keys `from..to` through `store`, many at once.
async fn begin_many(store: &SqliteStore, from: usize, to: usize) {
    let now = Timestamp::now();
    let tasks: Vec<_> = (from..to)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"f"));
                store.begin(&req, now).await.unwrap()
            })
        })
        .collect();
    for task in tasks {
        assert!(matches!(task.await.unwrap(), BeginOutcome::Acquired(_)));
    }
}

fn loads(known: &KnownKeys) -> u64 {
    known.read().loads
}

/// A table larger than the largest filter fills it at once; it is loaded again only after
/// half a filter's worth of keys has been learnt since, not over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_past_the_ceiling_is_loaded_again_only_after_many_new_keys() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let options = crate::SqliteOptions {
        synchronous: crate::Synchronous::Normal,
        ..crate::SqliteOptions::default()
    };
    let before = SqliteStore::open_with(&path, options).unwrap();
    begin_many(&before, 0, 600).await;
    drop(before);

    let store = SqliteStore::open_with(&path, options).unwrap();
    let known = Arc::clone(store.known.as_ref().unwrap());
    assert_eq!(settled(&known).await, MAX_CAPACITY);
    assert_eq!(loads(&known), 1);
    begin_many(&store, 600, 700).await;
    settled(&known).await;
    assert_eq!(loads(&known), 1, "100 new keys are not half a filter");
    begin_many(&store, 700, 900).await;
    settled(&known).await;
    assert_eq!(loads(&known), 2, "300 new keys are");
    begin_many(&store, 900, 920).await;
    settled(&known).await;
    assert_eq!(loads(&known), 2);
    for i in 0..920 {
        assert!(known.may_hold(&key(i)), "key {i} was written");
    }
}

/// A key another store wrote after the load is replayed through the writer, which teaches
/// it to the filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_teaches_a_key_written_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let now = Timestamp::now();
    let store = SqliteStore::open(&path).unwrap();
    let known = Arc::clone(store.known.as_ref().unwrap());
    settled(&known).await;
    let other = SqliteStore::open(&path).unwrap();
    let req = BeginRequest::new(key(7), Fingerprint::of_bytes(b"f"));
    let BeginOutcome::Acquired(lease) = other.begin(&req, now).await.unwrap() else {
        panic!("not acquired")
    };
    let answer = idem_core::Bytes::from_static(b"answer");
    other.complete(&req.key, &lease, answer, now).await.unwrap();

    let got = store.begin(&req, now).await.unwrap();
    assert!(
        matches!(&got, BeginOutcome::Replay(r) if &r.response[..] == b"answer"),
        "{got:?}"
    );
    assert!(known.may_hold(&key(7)));
}

/// The scan reads the key index a slice at a time: between two slices it holds no WAL
/// snapshot (a checkpoint may reset the WAL after every write between them), and what is
/// written or purged between them (the key the scan stands at, keys before it) does not
/// make it miss a key the table still holds, across scopes and namespaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scan_holds_no_snapshot_between_slices_and_misses_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).unwrap();
    let now = Timestamp::now();
    let begin = |k: Key| {
        let store = store.clone();
        async move {
            let req = BeginRequest::new(k, Fingerprint::of_bytes(b"f"));
            let got = store.begin(&req, now).await.unwrap();
            assert!(matches!(got, BeginOutcome::Acquired(_)));
        }
    };
    // Two scopes and two namespaces, in an order their client keys do not follow.
    let part = |i: usize| {
        let (scope, namespace) = (["b", "a"][i % 2], ["y", "x"][(i / 2) % 2]);
        Key::parse(scope, namespace, &format!("k{:03}", 119 - i)).unwrap()
    };
    let keys: Vec<Key> = (0..120).map(part).collect();
    for k in &keys {
        begin(k.clone()).await;
    }
    let mut in_order = keys.clone();
    in_order.sort_by_key(|k| {
        (
            k.scope().as_str().to_owned(),
            k.namespace().as_str().to_owned(),
            k.client_key().as_str().to_owned(),
        )
    });
    // A key set of its own: dropping the load below ends its rebuild, not the store's.
    let known = Arc::new(KnownKeys {
        filters: RwLock::new(Filters::default()),
        listings: Arc::clone(&store.listings),
        hasher: RandomState::new(),
    });
    let load = Load::new(Arc::clone(&known));
    let filter = Filter::new(1000);
    let scan = Connection::open(&path).unwrap();
    let other = Connection::open(&path).unwrap();
    let purge = |k: &Key| {
        let deleted = other
            .execute(
                "DELETE FROM idem_records WHERE scope = ?1 AND namespace = ?2 \
                 AND client_key = ?3",
                [
                    k.scope().as_str(),
                    k.namespace().as_str(),
                    k.client_key().as_str(),
                ],
            )
            .unwrap();
        assert_eq!(deleted, 1);
    };

    let mut purged = Vec::new();
    let mut at = load.read_keys(&scan, &filter, None).unwrap();
    let mut slices = 1;
    while let Some(after) = at {
        // Purge the key the scan stands at and the first key still held before it, write a
        // new key, and check that a checkpoint finds no reader in its way.
        let here = in_order
            .iter()
            .position(|k| k.client_key().as_str().as_bytes() == after[2].bytes)
            .unwrap();
        purge(&in_order[here]);
        purged.push(in_order[here].clone());
        if let Some(before) = in_order[..here].iter().find(|k| !purged.contains(k)) {
            purge(before);
            purged.push(before.clone());
        }
        begin(Key::parse("c", "z", &format!("new{slices}")).unwrap()).await;
        let busy: i64 = other
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
            .unwrap();
        assert_eq!(busy, 0, "a checkpoint after slice {slices} is held up");
        at = load.read_keys(&scan, &filter, Some(&after)).unwrap();
        slices += 1;
    }
    assert!(slices >= 120 / ROWS_PER_READ, "{slices} slices");
    for k in keys.iter().filter(|k| !purged.contains(k)) {
        let held = filter.bits.contains_hash(known.hash_key(k));
        assert!(held, "{k:?} was held throughout and is missed");
    }
}

/// When the listings queue has no room for the next slice, the load reads it in the job
/// it is in, rather than failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_does_not_stop_the_scan() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).unwrap();
    begin_many(&store, 0, 100).await;
    // One thread, busy until told, and a queue of one, taken.
    let listings = Arc::new(Readers::new(
        "listings",
        path.clone(),
        Duration::from_secs(1),
        1,
        1,
    ));
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (started, busy) = std::sync::mpsc::channel::<()>();
    listings
        .detach(move |_| {
            let _ = started.send(());
            let _ = held.recv();
        })
        .unwrap();
    busy.recv().unwrap();
    listings.detach(|_| {}).unwrap();
    assert!(listings.detach(|_| {}).is_err(), "the queue is full");
    let known = Arc::new(KnownKeys {
        filters: RwLock::new(Filters::default()),
        listings,
        hasher: RandomState::new(),
    });
    let filter = Arc::new(Filter::new(1000));
    let load = Load::new(Arc::clone(&known));
    load.fill(&Connection::open(&path).unwrap(), Arc::clone(&filter), None);
    release.send(()).unwrap();

    let filters = known.read();
    assert_eq!(filters.loads, 1, "the load finished");
    assert!(Arc::ptr_eq(filters.current.as_ref().unwrap(), &filter));
    drop(filters);
    for i in 0..100 {
        assert!(known.may_hold(&key(i)), "key {i}");
    }
}

/// A load that cannot run leaves every key "maybe held", is tried again only after a pause,
/// and says why in a warning.
#[test]
fn a_failed_load_answers_maybe_and_waits_to_try_again() {
    let dir = tempfile::tempdir().unwrap();
    // No database there: the listings connection cannot open.
    let listings = Arc::new(Readers::new(
        "listings",
        dir.path().join("missing.db"),
        Duration::from_millis(100),
        1,
        4,
    ));
    let log = idem_testkit::logs::Log::default();
    let known = tracing::subscriber::with_default(log.subscriber(), || KnownKeys::load(listings));
    let warning = log.text();
    assert!(
        warning.contains("WARN") && warning.contains("key filter did not load"),
        "{warning}"
    );
    assert!(warning.contains("missing.db"), "the cause: {warning}");
    assert!(warning.contains("failures=1"), "{warning}");
    {
        let filters = known.read();
        assert!(!filters.rebuilding && filters.current.is_none());
        assert_eq!(filters.failures, 1);
        assert!(filters.retry_at.is_some());
    }
    assert!(known.may_hold(&key(1)));
    known.learn(&key(1));
    assert_eq!(known.read().failures, 1, "no second load before the pause");
}
