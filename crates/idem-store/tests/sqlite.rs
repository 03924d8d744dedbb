//! SQLite store behaviour beyond the conformance suite: failures inside a batch, callers that
//! stop waiting, and a write lock held by another connection.

#![cfg(feature = "sqlite")]
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, StoreError, Timestamp};
use idem_store::{SqliteOptions, SqliteStore};

fn req(k: &str) -> BeginRequest {
    BeginRequest::new(
        Key::parse("s", "n", k).unwrap(),
        Fingerprint::of_bytes(b"f"),
    )
}

fn open(dir: &tempfile::TempDir, busy: Duration) -> SqliteStore {
    let mut options = SqliteOptions::default();
    options.busy_timeout = busy;
    open_with(dir, options)
}

fn open_with(dir: &tempfile::TempDir, options: SqliteOptions) -> SqliteStore {
    SqliteStore::open_with(dir.path().join("idem.db"), options).unwrap()
}

/// Holds SQLite's write lock from another connection until dropped.
struct Blocker(rusqlite::Connection);

impl Blocker {
    fn new(dir: &tempfile::TempDir) -> Self {
        let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
        conn.execute_batch("BEGIN IMMEDIATE").unwrap();
        Self(conn)
    }
}

impl Drop for Blocker {
    fn drop(&mut self) {
        let _ = self.0.execute_batch("ROLLBACK");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_batch_gives_every_caller_the_real_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Duration::from_secs(5));
    let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    conn.execute_batch(
        "CREATE TRIGGER boom BEFORE INSERT ON idem_records WHEN NEW.client_key = 'boom'
         BEGIN SELECT RAISE(ABORT, 'boom'); END;",
    )
    .unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let store = store.clone();
            let k = if i == 100 {
                "boom".to_owned()
            } else {
                format!("k{i}")
            };
            tokio::spawn(async move { (k.clone(), store.begin(&req(&k), Timestamp::now()).await) })
        })
        .collect();
    let mut failed = 0;
    for t in tasks {
        let (k, result) = t.await.unwrap();
        match result {
            Ok(BeginOutcome::Acquired(_)) => assert_ne!(k, "boom"),
            Err(StoreError::Backend { message, .. }) => {
                assert!(message.contains("boom"), "{k}: {message}");
                failed += 1;
            }
            other => panic!("{k}: {other:?}"),
        }
    }
    assert!(failed >= 1);
    // Whatever failed was not half-applied: those keys are still free.
    conn.execute_batch("DROP TRIGGER boom").unwrap();
    let acquired = store.begin(&req("boom"), Timestamp::now()).await.unwrap();
    assert!(matches!(acquired, BeginOutcome::Acquired(l) if l.fence == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_for_a_caller_that_stopped_waiting_is_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Duration::from_secs(5));
    let blocker = Blocker::new(&dir);
    let now = Timestamp::now();
    // The idle writer takes this begin at once, then waits for the lock with it in hand.
    let gave_up =
        tokio::time::timeout(Duration::from_millis(100), store.begin(&req("k"), now)).await;
    assert!(gave_up.is_err(), "the begin should still be waiting");
    drop(blocker);
    // The claim was made (fence 1) for nobody and released in the next transaction, so this
    // begin, queued behind that release, acquires with fence 2.
    match store.begin(&req("k"), now).await.unwrap() {
        BeginOutcome::Acquired(lease) => assert_eq!(lease.fence, 2),
        other => panic!("the key is still held for a caller that left: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_caller_left_before_its_batch_is_not_made() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Duration::from_secs(5));
    let blocker = Blocker::new(&dir);
    let now = Timestamp::now();
    // The writer is stuck on the lock with "first"; "k" waits in the queue behind it.
    let first = {
        let store = store.clone();
        tokio::spawn(async move { store.begin(&req("first"), now).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let gave_up =
        tokio::time::timeout(Duration::from_millis(50), store.begin(&req("k"), now)).await;
    assert!(gave_up.is_err());
    drop(blocker);
    assert!(matches!(
        first.await.unwrap().unwrap(),
        BeginOutcome::Acquired(_)
    ));
    // "k" was skipped, never claimed: the first real claim has fence 1.
    match store.begin(&req("k"), now).await.unwrap() {
        BeginOutcome::Acquired(lease) => assert_eq!(lease.fence, 1),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_unavailable_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = SqliteOptions::default();
    options.max_queue = 2;
    let store = open_with(&dir, options);
    let blocker = Blocker::new(&dir);
    let now = Timestamp::now();
    let spawn = |k: String| {
        let store = store.clone();
        tokio::spawn(async move { store.begin(&req(&k), now).await })
    };
    // One operation in the writer's hands (it waits for the lock)...
    let mut held = vec![spawn("held0".into())];
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...and two waiting behind it: the queue is full.
    held.extend((1..3).map(|i| spawn(format!("held{i}"))));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let result = store.begin(&req("extra"), now).await;
    match &result {
        Err(StoreError::Unavailable { message, .. }) => {
            assert!(message.contains("2 operations waiting"), "{message}");
        }
        other => panic!("expected a full queue, got {other:?}"),
    }
    drop(blocker);
    for h in held {
        assert!(matches!(
            h.await.unwrap().unwrap(),
            BeginOutcome::Acquired(_)
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_past_busy_timeout_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(&dir, Duration::from_millis(100)));
    let blocker = Blocker::new(&dir);
    let result = store.begin(&req("k"), Timestamp::now()).await;
    assert!(
        matches!(&result, Err(e) if e.is_transient()),
        "expected store unavailable, got {result:?}"
    );
    drop(blocker);
    assert!(matches!(
        store.begin(&req("k"), Timestamp::now()).await.unwrap(),
        BeginOutcome::Acquired(_)
    ));
}
