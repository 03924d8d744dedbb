//! SQLite store behaviour beyond the conformance suite: failures inside a batch, callers that
//! stop waiting, and a write lock held by another connection.

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
    SqliteStore::open_with(dir.path().join("idem.db"), options).unwrap()
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
async fn a_claim_for_a_caller_that_stopped_waiting_is_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Duration::from_secs(5));
    // Another connection holds the write lock, so the writer waits with the begin in hand.
    let blocker = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let now = Timestamp::now();
    let gave_up =
        tokio::time::timeout(Duration::from_millis(100), store.begin(&req("k"), now)).await;
    assert!(gave_up.is_err(), "the begin should still be waiting");
    blocker.execute_batch("COMMIT").unwrap();
    // The orphaned claim is released right after its batch; this begin is queued behind it.
    match store.begin(&req("k"), now).await.unwrap() {
        BeginOutcome::Acquired(lease) => assert!(lease.fence >= 1),
        other => panic!("the key is still held for a caller that left: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_past_busy_timeout_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open(&dir, Duration::from_millis(100)));
    let blocker = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let result = store.begin(&req("k"), Timestamp::now()).await;
    assert!(
        matches!(&result, Err(e) if e.is_transient()),
        "expected store unavailable, got {result:?}"
    );
    blocker.execute_batch("ROLLBACK").unwrap();
    assert!(matches!(
        store.begin(&req("k"), Timestamp::now()).await.unwrap(),
        BeginOutcome::Acquired(_)
    ));
}
