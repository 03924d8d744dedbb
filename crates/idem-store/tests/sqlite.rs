//! SQLite store behaviour beyond the conformance suite: failures inside a batch, callers that
//! stop waiting, and a write lock held by another connection.

#![cfg(feature = "sqlite")]
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Counters, Fingerprint, Key, Store, StoreError, Timestamp,
};
use idem_store::{SqliteOptions, SqliteStore};
use idem_testkit::{PATIENCE, within};

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
    let created = |l: &idem_core::Lease| !l.may_resume();
    assert!(matches!(acquired, BeginOutcome::Acquired(l) if created(&l)));
}

/// A store whose writer queue holds one operation: a call that finds it taken is refused at
/// once, so a call that gets in shows that the writer has taken what was waiting there.
/// Without read connections, so that a `begin` polled once is in the writer's queue (with
/// them, its first step is a read, and it reaches the writer only later).
fn open_with_a_queue_of_one(dir: &tempfile::TempDir) -> SqliteStore {
    let mut options = SqliteOptions::default();
    options.busy_timeout = PATIENCE;
    options.max_queue = 1;
    options.read_connections = 0;
    open_with(dir, options)
}

/// `call`, polled once: sent to the writer, and waiting for its answer.
async fn sent<F: Future>(call: F) -> std::pin::Pin<Box<F>> {
    let mut call = Box::pin(call);
    assert!(
        tokio::time::timeout(Duration::ZERO, call.as_mut())
            .await
            .is_err(),
        "answered at once"
    );
    call
}

/// Makes `probe` calls, each polled once, until one gets into the writer's queue (it is
/// left waiting there, and dropped).
async fn until_one_gets_in<T, Fut>(mut probe: impl FnMut() -> Fut)
where
    T: std::fmt::Debug,
    Fut: Future<Output = Result<T, StoreError>>,
{
    within("room in the writer's queue", async {
        loop {
            match tokio::time::timeout(Duration::ZERO, probe()).await {
                Err(_) => return,
                Ok(Err(StoreError::Unavailable { .. })) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(other) => panic!("answered while the writer is stalled: {other:?}"),
            }
        }
    })
    .await;
}

/// `call`, made again while the writer's queue (one place long) is full.
async fn once_in<T, Fut>(mut call: impl FnMut() -> Fut) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, StoreError>>,
{
    within("room in the writer's queue", async {
        loop {
            match call().await {
                Err(StoreError::Unavailable { message, .. })
                    if message.contains("operations waiting") =>
                {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                other => return other,
            }
        }
    })
    .await
}

/// A caller that stops waiting while the writer, stalled on another connection's lock, holds
/// its claim in hand: once the writer resumes, the claim is made for nobody and given back at
/// once, so the next caller takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_made_for_a_caller_that_stopped_waiting_is_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_with_a_queue_of_one(&dir);
    let blocker = Blocker::new(&dir);
    let (k, now) = (req("k"), Timestamp::now());
    let caller = sent(store.begin(&k, now)).await;
    // A probe gets into the queue: the writer has taken the claim. (A counter's step, which
    // only the writer takes; reads go to the read connections.)
    let probe = req("probe").key;
    until_one_gets_in(|| store.advance(&probe, 1)).await;
    // Its caller stops waiting.
    drop(caller);
    drop(blocker);
    match once_in(|| store.begin(&k, now)).await.unwrap() {
        BeginOutcome::Acquired(_) => {}
        other => panic!("the key is still held for a caller that left: {other:?}"),
    }
}

/// A caller that stops waiting while its claim waits in the queue behind the writer's
/// stalled batch: the claim is skipped, never made, and the next caller takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_caller_left_before_its_batch_is_not_made() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_with_a_queue_of_one(&dir);
    let blocker = Blocker::new(&dir);
    let (k, now) = (req("k"), Timestamp::now());
    // The writer takes "first" and waits for the lock with it in hand...
    let first_req = req("first");
    let first = sent(store.begin(&first_req, now)).await;
    // ...and "k" gets into the queue behind it, where its caller leaves.
    until_one_gets_in(|| store.begin(&k, now)).await;
    drop(blocker);
    assert!(matches!(
        within("the first claim", first).await.unwrap(),
        BeginOutcome::Acquired(_)
    ));
    match once_in(|| store.begin(&k, now)).await.unwrap() {
        BeginOutcome::Acquired(_) => {}
        other => panic!("the key is held for a caller that left: {other:?}"),
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

/// Replays, mismatches and `get` are read on read connections: another connection holding the
/// write lock delays only what writes. Without read connections they wait for the writer too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_does_not_wait_for_the_write_lock() {
    for read_connections in [2, 0] {
        let dir = tempfile::tempdir().unwrap();
        let mut options = SqliteOptions::default();
        options.busy_timeout = Duration::from_millis(300);
        options.read_connections = read_connections;
        let store = open_with(&dir, options);
        let now = Timestamp::now();
        let done = req("done");
        completed(&store, "done", now).await;

        let blocker = Blocker::new(&dir);
        let replay = store.begin(&done, now).await;
        let other = BeginRequest::new(done.key.clone(), Fingerprint::of_bytes(b"other"));
        let mismatch = store.begin(&other, now).await;
        let got = store.get(&done.key, now).await;
        let fresh = store.begin(&req("fresh"), now).await;
        drop(blocker);
        assert!(matches!(&fresh, Err(e) if e.is_transient()), "{fresh:?}");
        if read_connections > 0 {
            assert!(matches!(replay, Ok(BeginOutcome::Replay(r)) if &r.response[..] == b"answer"));
            assert_eq!(mismatch.unwrap(), BeginOutcome::Mismatch);
            assert!(got.unwrap().is_some());
        } else {
            assert!(matches!(&replay, Err(e) if e.is_transient()), "{replay:?}");
            assert!(matches!(&got, Err(e) if e.is_transient()), "{got:?}");
        }
    }
}

/// Begins and completes `key` through `store` at `now`, its stored answer `b"answer"`.
async fn completed(store: &SqliteStore, key: &str, now: Timestamp) {
    let BeginOutcome::Acquired(lease) = store.begin(&req(key), now).await.unwrap() else {
        panic!("{key} not acquired")
    };
    let answer = idem_core::Bytes::from_static(b"answer");
    store
        .complete(&req(key).key, &lease, answer, now)
        .await
        .unwrap();
}

/// The key filter only routes a `begin`: a key in the file before the store opened, or written
/// since by another store on the same file, is replayed, and never waits for the write lock
/// once this store has seen it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_written_elsewhere_are_replayed_and_read_without_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = SqliteOptions::default();
    options.busy_timeout = Duration::from_millis(300);
    completed(&open_with(&dir, options), "before", Timestamp::now()).await;
    let store = open_with(&dir, options);
    let other = open_with(&dir, options);
    completed(&other, "elsewhere", Timestamp::now()).await;
    let replayed = |got: Result<BeginOutcome, StoreError>| matches!(got, Ok(BeginOutcome::Replay(r)) if &r.response[..] == b"answer");
    assert!(replayed(
        store.begin(&req("elsewhere"), Timestamp::now()).await
    ));

    let blocker = Blocker::new(&dir);
    for key in ["before", "elsewhere"] {
        let got = store.begin(&req(key), Timestamp::now()).await;
        assert!(replayed(got), "{key}");
    }
    drop(blocker);
}

/// A row another program wrote with a column of another type is that record's corruption,
/// answered to its caller; the other records go on.
#[tokio::test]
async fn a_row_of_the_wrong_types_is_corrupt_and_fails_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Duration::from_secs(5));
    let now = Timestamp::now();
    assert!(matches!(
        store.begin(&req("bad"), now).await.unwrap(),
        BeginOutcome::Acquired(_)
    ));
    let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    conn.execute(
        "UPDATE idem_records SET fence = 'not a number' WHERE client_key = 'bad'",
        [],
    )
    .unwrap();
    drop(conn);
    let bad = store.begin(&req("bad"), now).await;
    assert!(matches!(bad, Err(StoreError::Corrupt(_))), "{bad:?}");
    // Many at once, so that the bad key shares a batch with good ones.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..20 {
        let store = store.clone();
        let k = if i == 10 {
            req("bad")
        } else {
            req(&format!("ok-{i}"))
        };
        calls.spawn(async move { (i, store.begin(&k, now).await) });
    }
    only_one_corrupt(calls, 10, |a| matches!(a, BeginOutcome::Acquired(_))).await;
}

/// The same for a lock's row: that lock answers corrupt, and other locks in its batch go on.
#[tokio::test]
async fn a_lock_row_of_the_wrong_types_is_corrupt_and_fails_nothing_else() {
    use idem_core::{Acquire, LockName, LockOwner, LockStore};
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, Duration::from_secs(5));
    let name = |n: &str| LockName::new(n).unwrap();
    let lease = Duration::from_secs(60);
    let owner = LockOwner::random().digest();
    store.acquire(&name("bad"), owner, lease).await.unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    conn.execute("UPDATE idem_locks SET fence = 'x' WHERE name = 'bad'", [])
        .unwrap();
    drop(conn);
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..20 {
        let store = store.clone();
        let n = if i == 10 {
            name("bad")
        } else {
            name(&format!("ok-{i}"))
        };
        calls.spawn(async move { (i, store.acquire(&n, owner, lease).await) });
    }
    only_one_corrupt(calls, 10, |a| matches!(a, Acquire::Acquired(_))).await;
}

/// Joins `calls`, each answering with its index: the one at `bad` is corrupt, every other `ok`.
async fn only_one_corrupt<T: std::fmt::Debug + 'static>(
    mut calls: tokio::task::JoinSet<(usize, Result<T, StoreError>)>,
    bad: usize,
    ok: fn(&T) -> bool,
) {
    while let Some(done) = calls.join_next().await {
        let (i, answer) = done.unwrap();
        if i == bad {
            assert!(matches!(answer, Err(StoreError::Corrupt(_))), "{answer:?}");
        } else {
            assert!(answer.as_ref().is_ok_and(ok), "{i}: {answer:?}");
        }
    }
}

/// Many openers of one new file at once (processes starting together on the same store) each
/// get a store: SQLite answers a switch to WAL that collides with another's at once with
/// "database is locked", without waiting, and the open tries again within `busy_timeout`.
#[test]
fn a_new_file_opened_by_many_at_once_opens_for_each() {
    for _ in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.db");
        let start = Arc::new(std::sync::Barrier::new(8));
        let openers: Vec<_> = (0..8)
            .map(|_| {
                let (path, start) = (path.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    SqliteStore::open(&path).map(drop)
                })
            })
            .collect();
        for opener in openers {
            opener.join().unwrap().unwrap();
        }
    }
}
