//! A caller that gives up (its future dropped at an `.await`, as a timeout or a client that
//! hangs up drops it) while the store is stalled leaves no key held for nobody: the next
//! caller is served.

use super::*;

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
    // It took the key (its first acquisition) for a caller that is gone. The next caller runs the work,
    // rather than being told "in progress" until the lease ends (never, on this clock).
    let done = idem
        .once(&key("c1"))
        .in_flight(InFlight::Wait(PATIENCE))
        .run(|_| async { Ok::<_, PayError>(2) })
        .await
        .unwrap();
    let acquisition = idem::Lease::acquisition_of(done.fence);
    assert_eq!((done.value, done.replayed, acquisition), (2, false, 2));
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
