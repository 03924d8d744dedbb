//! The run-once API: at most once per key, stored results replayed, failures classified,
//! in-flight attempts rejected or awaited, store failures failing closed.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{
    Done, Idempotency, InFlight, Key, ManualClock, MemoryStore, RunError, Status, Store, Timestamp,
};
use idem_testkit::{Fault, FaultyStore, Op, PATIENCE, Stall, within};
use serde::{Deserialize, Serialize};

fn key(k: &str) -> Key {
    Key::parse("tests", "run", k).unwrap()
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum PayError {
    Declined,
    Timeout,
}

#[tokio::test]
async fn runs_once_and_replays_the_value() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = &AtomicUsize::new(0);
    for i in 0..3 {
        let done = idem
            .once(&key("a"))
            .input(&serde_json::json!({"amount": 5, "to": "bob"}))
            .unwrap()
            .run(|lease| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, PayError>(format!("tx-{}", lease.fence))
            })
            .await
            .unwrap();
        assert_eq!(done.value, "tx-1");
        assert_eq!(done.replayed, i > 0);
        assert_eq!(done.fence, 1);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn input_key_order_does_not_matter_but_values_do() {
    let idem = Idempotency::new(MemoryStore::new());
    let run = |input: serde_json::Value| {
        let idem = idem.clone();
        async move {
            idem.once(&key("b"))
                .input(&input)
                .unwrap()
                .run(|_| async { Ok::<_, PayError>(1) })
                .await
        }
    };
    assert!(
        !run(serde_json::json!({"a": 1, "b": 2}))
            .await
            .unwrap()
            .replayed
    );
    assert!(
        run(serde_json::json!({"b": 2, "a": 1}))
            .await
            .unwrap()
            .replayed
    );
    assert!(matches!(
        run(serde_json::json!({"a": 1, "b": 3})).await,
        Err(RunError::Mismatch)
    ));
}

#[tokio::test]
async fn retryable_error_releases_the_key() {
    let idem = Idempotency::new(MemoryStore::new());
    let first = idem
        .once(&key("c"))
        .run(|_| async { Err::<u8, _>(PayError::Timeout) })
        .await;
    assert!(matches!(
        first,
        Err(RunError::Failed {
            error: PayError::Timeout,
            replayed: false
        })
    ));
    let second = idem
        .once(&key("c"))
        .run(|lease| async move { Ok::<_, PayError>(lease.fence) })
        .await
        .unwrap();
    assert_eq!(second.value, 2, "ran again, under a higher fence");
    assert!(!second.replayed);
}

#[tokio::test]
async fn permanent_error_is_stored_and_replayed() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    for i in 0..2 {
        let result = idem
            .once(&key("d"))
            .permanent_if(|e: &PayError| *e == PayError::Declined)
            .run(|_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<u8, _>(PayError::Declined)
            })
            .await;
        match result {
            Err(RunError::Failed { error, replayed }) => {
                assert_eq!(error, PayError::Declined);
                assert_eq!(replayed, i > 0);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Starts a run whose work waits for `go`, and returns once it holds the key.
async fn start_blocked<S: Store + Clone>(
    idem: &Idempotency<S, ManualClock>,
    k: &str,
    lease: Duration,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<idem::Done<String>, RunError<PayError>>>,
) {
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let idem = idem.clone();
    let k = key(k);
    let handle = tokio::spawn(async move {
        idem.once(&k)
            .lease(lease)
            .run(|_| async move {
                started_tx.send(()).unwrap();
                let _ = wait.await;
                Ok::<_, PayError>("first".to_owned())
            })
            .await
    });
    started.await.unwrap();
    (go, handle)
}

#[tokio::test]
async fn in_flight_is_rejected_with_retry_after() {
    let clock = ManualClock::starting_now();
    let idem = Idempotency::new(MemoryStore::new()).with_clock(clock.clone());
    let (go, first) = start_blocked(&idem, "e", Duration::from_secs(30)).await;
    clock.advance(Duration::from_secs(10));
    let runs = AtomicUsize::new(0);
    let second = idem
        .once(&key("e"))
        .run(|_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, PayError>("second".to_owned())
        })
        .await;
    match second {
        Err(RunError::InProgress { retry_after }) => {
            assert_eq!(retry_after, Duration::from_secs(20));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    go.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap().value, "first");
}

#[tokio::test]
async fn in_flight_wait_replays_the_first_result() {
    let idem = Idempotency::new(MemoryStore::new()).with_clock(ManualClock::starting_now());
    let (go, first) = start_blocked(&idem, "f", Duration::from_secs(30)).await;
    let waiter = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.once(&key("f"))
                .in_flight(InFlight::Wait(Duration::from_secs(10)))
                .run(|_| async { Ok::<_, PayError>("waiter ran".to_owned()) })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    go.send(()).unwrap();
    let waited = waiter.await.unwrap().unwrap();
    assert_eq!(waited.value, "first");
    assert!(waited.replayed);
    assert!(!first.await.unwrap().unwrap().replayed);
}

#[tokio::test]
async fn in_flight_wait_gives_up_at_its_bound() {
    let idem = Idempotency::new(MemoryStore::new()).with_clock(ManualClock::starting_now());
    let (go, first) = start_blocked(&idem, "g", Duration::from_secs(30)).await;
    let started = tokio::time::Instant::now();
    let result = idem
        .once(&key("g"))
        .in_flight(InFlight::Wait(Duration::from_millis(50)))
        .run(|_| async { Ok::<_, PayError>("waiter ran".to_owned()) })
        .await;
    assert!(
        matches!(result, Err(RunError::InProgress { .. })),
        "{result:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(50));
    go.send(()).unwrap();
    first.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_lease_that_runs_out_is_taken_over_and_the_old_result_is_refused() {
    let clock = ManualClock::starting_now();
    let idem = Idempotency::new(MemoryStore::new()).with_clock(clock.clone());
    let (go, first) = start_blocked(&idem, "h", Duration::from_secs(5)).await;
    clock.advance(Duration::from_secs(6));
    let second = idem
        .once(&key("h"))
        .in_flight(InFlight::Wait(Duration::from_secs(1)))
        .run(|lease| async move { Ok::<_, PayError>(format!("second@{}", lease.fence)) })
        .await
        .unwrap();
    assert_eq!(second.value, "second@2");
    go.send(()).unwrap();
    assert!(matches!(first.await.unwrap(), Err(RunError::LeaseLost)));
    let replay = idem
        .once(&key("h"))
        .run(|_| async { Ok::<_, PayError>(String::new()) })
        .await
        .unwrap();
    assert_eq!(replay.value, "second@2");
}

#[tokio::test]
async fn store_down_fails_closed_and_never_runs_the_work() {
    let store = FaultyStore::new(MemoryStore::new());
    store.set_down(true);
    let idem = Idempotency::new(store.clone());
    let runs = AtomicUsize::new(0);
    let result = idem
        .once(&key("i"))
        .run(|_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, PayError>(())
        })
        .await;
    assert!(matches!(result, Err(RunError::Store(_))), "{result:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_lost_complete_reply_is_retried_safely() {
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next(Op::Complete, Fault::LostReply);
    let idem = Idempotency::new(store.clone());
    let done = idem
        .once(&key("j"))
        .run(|_| async { Ok::<_, PayError>(7) })
        .await
        .unwrap();
    assert_eq!(done.value, 7);
    let rec = store
        .inner()
        .get(&key("j"), Timestamp::now())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.status, Status::Completed);
}

#[tokio::test]
async fn a_complete_that_keeps_failing_is_reported_not_recorded() {
    let store = FaultyStore::new(MemoryStore::new());
    for _ in 0..3 {
        store.fail_next(Op::Complete, Fault::Unavailable);
    }
    let idem = Idempotency::new(store.clone());
    let result = idem
        .once(&key("k"))
        .run(|_| async { Ok::<_, PayError>(7) })
        .await;
    assert!(
        matches!(result, Err(RunError::NotRecorded(_))),
        "{result:?}"
    );
    let rec = store
        .inner()
        .get(&key("k"), Timestamp::now())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rec.status,
        Status::InProgress,
        "left for its lease to run out"
    );
}

#[tokio::test]
async fn a_cancelled_run_releases_the_key() {
    let idem = Idempotency::new(MemoryStore::new());
    let cancelled = tokio::time::timeout(
        Duration::from_millis(20),
        idem.once(&key("l")).run(|_| async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok::<_, PayError>(0)
        }),
    )
    .await;
    assert!(cancelled.is_err());
    // the release runs in the background
    let mut released = false;
    for _ in 0..100 {
        let rec = idem.store().get(&key("l"), Timestamp::now()).await.unwrap();
        if rec.is_some_and(|r| r.status == Status::Released) {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(released);
    let retry = idem
        .once(&key("l"))
        .run(|lease| async move { Ok::<_, PayError>(lease.fence) })
        .await
        .unwrap();
    assert_eq!(retry.value, 2);
}

#[tokio::test]
async fn a_panicking_run_releases_the_key() {
    let idem = Idempotency::new(MemoryStore::new());
    let panicked = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.once(&key("m"))
                .run(|_| async {
                    if true {
                        panic!("work panicked");
                    }
                    Ok::<_, PayError>(0)
                })
                .await
        })
        .await
    };
    assert!(panicked.is_err());
    // The release runs in the background; without it this would wait out the 60 s lease.
    let retry = idem
        .once(&key("m"))
        .in_flight(InFlight::Wait(Duration::from_secs(5)))
        .run(|_| async { Ok::<_, PayError>(1) })
        .await
        .unwrap();
    assert!(!retry.replayed);
}

#[tokio::test]
async fn concurrent_runs_execute_the_work_once() {
    let store = MemoryStore::new();
    let idem = Idempotency::new(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (idem, runs) = (idem.clone(), runs.clone());
            tokio::spawn(async move {
                idem.once(&key("n"))
                    .in_flight(InFlight::Wait(Duration::from_secs(5)))
                    .run(|_| async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, PayError>(42)
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().value, 42);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn works_on_the_sqlite_store() {
    let dir = tempfile::tempdir().unwrap();
    let idem = Idempotency::new(idem::SqliteStore::open(dir.path().join("x.db")).unwrap());
    let a = idem
        .once(&key("o"))
        .run(|_| async { Ok::<_, PayError>(vec![1, 2]) })
        .await
        .unwrap();
    let b = idem
        .once(&key("o"))
        .run(|_| async { Ok::<_, PayError>(vec![3]) })
        .await
        .unwrap();
    assert_eq!(
        (a.value, b.value, b.replayed),
        (vec![1, 2], vec![1, 2], true)
    );
}

#[tokio::test]
async fn an_unencodable_result_is_not_run_again() {
    use std::collections::HashMap;
    let idem = Idempotency::new(MemoryStore::new());
    let runs = &AtomicUsize::new(0);
    for _ in 0..2 {
        let result = idem
            .once(&key("p"))
            .run(|_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                // JSON object keys must be strings: this map cannot be serialised.
                Ok::<_, PayError>(HashMap::from([(vec![1u8], 1u8)]))
            })
            .await;
        assert!(matches!(result, Err(RunError::Codec(_))), "{result:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_panicking_error_policy_releases_the_key() {
    let idem = Idempotency::new(MemoryStore::new());
    let panicked = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.once(&key("q"))
                .permanent_if(|_: &PayError| panic!("policy panicked"))
                .run(|_| async { Err::<u8, _>(PayError::Declined) })
                .await
        })
        .await
    };
    assert!(panicked.is_err());
    let retry = idem
        .once(&key("q"))
        .in_flight(InFlight::Wait(Duration::from_secs(5)))
        .run(|lease| async move { Ok::<_, PayError>(lease.fence) })
        .await
        .unwrap();
    assert_eq!(retry.value, 2);
}

#[tokio::test]
async fn an_unbounded_wait_does_not_overflow() {
    let idem = Idempotency::new(MemoryStore::new()).with_clock(ManualClock::starting_now());
    let (go, first) = start_blocked(&idem, "r", Duration::from_secs(30)).await;
    let waiter = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.once(&key("r"))
                .in_flight(InFlight::Wait(Duration::MAX))
                .run(|_| async { Ok::<_, PayError>("waiter ran".to_owned()) })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    go.send(()).unwrap();
    assert_eq!(waiter.await.unwrap().unwrap().value, "first");
    first.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_failed_release_still_reports_the_works_error() {
    let store = FaultyStore::new(MemoryStore::new());
    for _ in 0..3 {
        store.fail_next(Op::Release, Fault::Unavailable);
    }
    let idem = Idempotency::new(store);
    let result = idem
        .once(&key("s"))
        .run(|_| async { Err::<u8, _>(PayError::Timeout) })
        .await;
    assert!(
        matches!(
            result,
            Err(RunError::Failed {
                error: PayError::Timeout,
                replayed: false
            })
        ),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_store_chosen_at_run_time_works_in_a_spawned_task() {
    // `SharedStore` (an `Arc<dyn DynStore>`) inside a `Send` future: an axum handler or a
    // spawned task.
    let store: idem::SharedStore = Arc::new(MemoryStore::new());
    let idem = Arc::new(Idempotency::new(store));
    let task = tokio::spawn(async move {
        idem.once(&key("spawned"))
            .run(|_| async { Ok::<_, PayError>(7) })
            .await
            .map(|done| done.value)
    });
    assert_eq!(task.await.unwrap().unwrap(), 7);
}

// A caller that gives up (its future dropped at an `.await`, as a timeout or a client that
// hangs up drops it) while the store is stalled leaves no key held for nobody: the next
// caller is served.

type Stallable = Idempotency<FaultyStore<MemoryStore>, ManualClock>;

/// The engine over a memory store that can be stalled, on a clock that never moves: a key
/// left held stays held for the whole test.
fn stallable() -> (FaultyStore<MemoryStore>, Stallable) {
    let store = FaultyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store.clone()).with_clock(ManualClock::starting_now());
    (store, idem)
}

/// A run of `k`, in a future of its own, whose work counts itself in `runs` and answers
/// `answer`.
fn counted(
    idem: &Stallable,
    k: &'static str,
    runs: &Arc<AtomicUsize>,
    answer: Result<u32, PayError>,
) -> impl Future<Output = Result<Done<u32>, RunError<PayError>>> + Send + 'static {
    let (idem, runs) = (idem.clone(), runs.clone());
    async move {
        idem.once(&key(k))
            .run(|_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                answer
            })
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_the_store_takes_the_key_leaves_the_key_free() {
    let (store, idem) = stallable();
    let runs = Arc::new(AtomicUsize::new(0));
    let stall = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(stall.clone()));
    stall.abandon(counted(&idem, "c1", &runs, Ok(1))).await;
    stall.release();
    within("the abandoned begin to land", stall.landed()).await;
    // It took the key (fence 1) for a caller that is gone. The next caller runs the work,
    // rather than being told "in progress" until the lease ends (never, on this clock).
    let done = idem
        .once(&key("c1"))
        .in_flight(InFlight::Wait(PATIENCE))
        .run(|_| async { Ok::<_, PayError>(2) })
        .await
        .unwrap();
    assert_eq!((done.value, done.replayed, done.fence), (2, false, 2));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A run whose work answers `answer` is dropped while `op` settles its record. The settling
/// lands all the same, and the next run of the key (whose work answers 9) sees it: it answers
/// `then` (value, replayed), the work having run `runs` times in all.
async fn dropped_while_settling(
    op: Op,
    answer: Result<u32, PayError>,
    then: (u32, bool),
    runs: usize,
) {
    let (store, idem) = stallable();
    let counter = Arc::new(AtomicUsize::new(0));
    let stall = store.stall_next(op);
    stall.abandon(counted(&idem, "c2", &counter, answer)).await;
    assert_eq!(counter.load(Ordering::SeqCst), 1);
    stall.release();
    within("the record to be settled", stall.landed()).await;
    let again = counted(&idem, "c2", &counter, Ok(9)).await.unwrap();
    assert_eq!((again.value, again.replayed), then);
    assert_eq!(counter.load(Ordering::SeqCst), runs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_its_result_is_stored_still_stores_it() {
    dropped_while_settling(Op::Complete, Ok(7), (7, true), 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_giving_the_key_back_still_gives_it_back() {
    dropped_while_settling(Op::Release, Err(PayError::Timeout), (9, false), 2).await;
}

/// Already safe: a waiter keeps nothing while it waits for another attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_waiting_for_another_attempt_leaves_nothing_behind() {
    let (store, idem) = stallable();
    let entered = Arc::new(tokio::sync::Notify::new());
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let first = tokio::spawn({
        let (idem, entered) = (idem.clone(), entered.clone());
        async move {
            idem.once(&key("c4"))
                .run(|_| async move {
                    entered.notify_one();
                    let _ = finished.await;
                    Ok::<_, PayError>(1)
                })
                .await
        }
    });
    within("the first attempt to start", entered.notified()).await;
    // The waiter's first begin is told "in progress"; it is dropped while it waits to ask
    // again.
    let asked = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(asked.clone()));
    let waiter = tokio::spawn({
        let idem = idem.clone();
        async move {
            idem.once(&key("c4"))
                .in_flight(InFlight::Wait(PATIENCE))
                .run(|_| async { Ok::<_, PayError>(2) })
                .await
        }
    });
    asked.release();
    within("the waiter to be answered", asked.landed()).await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    finish.send(()).unwrap();
    within("the first attempt", first).await.unwrap().unwrap();
    let replay = counted(&idem, "c4", &Arc::default(), Ok(3)).await.unwrap();
    assert_eq!((replay.value, replay.replayed), (1, true));
}

/// On PostgreSQL with group commit: a run dropped while its `begin` is in a batch in flight
/// (the table locked by another session, so every statement waits) leaves the key free once
/// the table is unlocked. The batch takes the key for a caller that is gone; it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_its_batch_is_in_flight_leaves_the_key_free_on_postgres() {
    use sqlx::Connection as _;

    let Some(url) = idem_testkit::services::POSTGRES.url() else {
        return;
    };
    let options = idem::PostgresOptions {
        table: "idem_test_cancel".into(),
        lock_timeout: PATIENCE,
        ..idem::PostgresOptions::default()
    };
    let store = idem::PostgresStore::connect_with(&url, options)
        .await
        .unwrap();
    let idem = Idempotency::new(store).with_clock(ManualClock::starting_now());
    let run = |k: String, waits: Duration| {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.once(&key(&k))
                .in_flight(InFlight::Wait(waits))
                .run(|_| async { Ok::<_, PayError>(k) })
                .await
        })
    };
    let mut locker = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE idem_test_cancel IN EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    let waiting = "SELECT count(*) FROM pg_locks WHERE relation = 'idem_test_cancel'::regclass AND NOT granted";
    let mut until_waiting = async |n: i64| {
        within("statements to wait for the table", async {
            while sqlx::query_scalar::<_, i64>(waiting)
                .fetch_one(&mut locker)
                .await
                .unwrap()
                < n
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    };
    let n: u64 = rand::random();
    // The first caller's begin runs on its own (the lanes are idle) and waits for the table;
    // the second's is queued behind it and sent by a lane, as a batch, which waits too.
    let first = run(format!("first-{n:x}"), Duration::ZERO);
    until_waiting(1).await;
    let gone = run(format!("gone-{n:x}"), Duration::ZERO);
    until_waiting(2).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut locker)
        .await
        .unwrap();
    within("the first run", first).await.unwrap().unwrap();
    let next = run(format!("gone-{n:x}"), PATIENCE).await.unwrap().unwrap();
    assert!(!next.replayed);
}
