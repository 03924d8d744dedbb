//! Recovery points through the run-once API: a crash between any two steps resumes at the first
//! unfinished one, on every store; unknown outcomes, other inputs and overtaken attempts.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{
    Clock, Idempotency, Key, ManualClock, MemoryStore, RunError, SharedStore, StepFailure,
    StepOutcome, Steps, Store,
};
use idem_testkit::services::{MYSQL, POSTGRES, REDIS};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

const LEASE: Duration = Duration::from_secs(10);
const STEPS: [&str; 3] = ["debit", "bank", "credit"];

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum BankError {
    Timeout,
}

/// Every store this machine has: memory and SQLite always, the servers when they answer.
async fn stores() -> Vec<(&'static str, SharedStore, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = idem::open(&format!(
        "sqlite://{}",
        dir.path().join("steps.db").display()
    ))
    .await
    .unwrap();
    let mut all: Vec<(&'static str, SharedStore, Option<tempfile::TempDir>)> = vec![
        ("memory", Arc::new(MemoryStore::new()), None),
        ("sqlite", sqlite, Some(dir)),
    ];
    for (name, service) in [("postgres", POSTGRES), ("mysql", MYSQL), ("redis", REDIS)] {
        if let Some(url) = service.url() {
            all.push((name, idem::open(&url).await.unwrap(), None));
        }
    }
    all
}

fn key(store: &str, case: &str) -> Key {
    let run = format!("{:08x}", rand::random::<u32>());
    Key::parse("tests", "steps", &format!("{store}-{case}-{run}")).unwrap()
}

/// How many times each step's work ran, over all attempts.
#[derive(Default)]
struct Runs([AtomicUsize; 3]);

impl Runs {
    fn counts(&self) -> [usize; 3] {
        [0, 1, 2].map(|i| self.0[i].load(Ordering::SeqCst))
    }
}

/// The transfer: three steps, each counted; after `stop_after` of them, it signals `stopped`
/// and waits forever (the process "dies" there: the test forgets the future).
async fn transfer<S: Store + Clone, C: Clock + Clone>(
    s: Steps<S, C>,
    runs: &Runs,
    stop_after: Option<usize>,
    stopped: mpsc::UnboundedSender<()>,
) -> Result<String, StepFailure<BankError>> {
    let mut outputs = Vec::new();
    for (i, name) in STEPS.into_iter().enumerate() {
        if stop_after == Some(i) {
            let _ = stopped.send(());
            std::future::pending::<()>().await;
        }
        let before = outputs.join("+");
        let out: String = s
            .step(name, |cx| async move {
                runs.0[i].fetch_add(1, Ordering::SeqCst);
                Ok::<_, BankError>(format!("{name}({before})[{}]", &cx.key()[..8]))
            })
            .await?;
        outputs.push(out);
    }
    Ok(outputs.join("+"))
}

/// Polls `attempt` until it signals that it stopped, then forgets it: no drop guard runs, as
/// when a process dies.
async fn crash<F: Future>(attempt: F, mut stopped: mpsc::UnboundedReceiver<()>) {
    let mut attempt = Box::pin(attempt);
    tokio::select! {
        _ = &mut attempt => panic!("the attempt finished instead of stopping"),
        _ = stopped.recv() => {}
    }
    std::mem::forget(attempt);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_any_two_steps_resumes_at_the_first_unfinished_one() {
    for (store_name, store, _dir) in stores().await {
        let mut answers = Vec::new();
        for stop_after in 0..=STEPS.len() {
            let clock = ManualClock::starting_now();
            let idem = Idempotency::new(store.clone()).with_clock(clock.clone());
            let key = key(store_name, &format!("crash-{stop_after}"));
            let runs = Runs::default();
            let (tx, rx) = mpsc::unbounded_channel();
            if stop_after < STEPS.len() {
                let first = idem
                    .once(&key)
                    .input(&("alice", "bob", 100))
                    .unwrap()
                    .lease(LEASE)
                    .steps(|s| transfer(s, &runs, Some(stop_after), tx.clone()));
                crash(first, rx).await;
                clock.advance(LEASE);
            }
            let resumed = AtomicUsize::new(usize::MAX);
            let done = idem
                .once(&key)
                .input(&("alice", "bob", 100))
                .unwrap()
                .lease(LEASE)
                .steps(|s| {
                    resumed.store(s.resumed(), Ordering::SeqCst);
                    transfer(s, &runs, None, tx.clone())
                })
                .await
                .unwrap();
            let case = format!("{store_name}, stopped after {stop_after} steps");
            assert_eq!(runs.counts(), [1, 1, 1], "{case}: each step ran once");
            let expect_resumed = if stop_after == STEPS.len() {
                0
            } else {
                stop_after
            };
            assert_eq!(resumed.load(Ordering::SeqCst), expect_resumed, "{case}");
            assert!(!done.replayed);
            // The answer is the one the steps built, the same whatever the crash.
            let answer = done.value.replace(|c: char| c.is_ascii_hexdigit(), "");
            answers.push(answer);
            // A retry replays it and runs nothing.
            let again = idem
                .once(&key)
                .input(&("alice", "bob", 100))
                .unwrap()
                .steps(|s| transfer(s, &runs, None, tx.clone()))
                .await
                .unwrap();
            assert!(again.replayed, "{case}");
            assert_eq!(again.value, done.value, "{case}");
            assert_eq!(runs.counts(), [1, 1, 1], "{case}");
            let record = store.get(&key, clock.now()).await.unwrap().unwrap();
            let names: Vec<&str> = record.steps.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names, STEPS, "{case}");
        }
        assert!(
            answers.windows(2).all(|w| w[0] == w[1]),
            "{store_name}: {answers:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_recorded_and_the_step_runs_again_with_its_key() {
    for (store_name, store, _dir) in stores().await {
        let idem = Idempotency::new(store.clone());
        let key = key(store_name, "unknown");
        let seen = &std::sync::Mutex::new(Vec::new());
        let attempt = || {
            idem.once(&key)
                .input(&"t-9")
                .unwrap()
                .steps(|s| async move {
                    let debit: u32 = s.step("debit", |_| async { Ok::<_, BankError>(7) }).await?;
                    s.call(
                        "bank",
                        |e| *e == BankError::Timeout,
                        |cx| async move {
                            let mut seen = seen.lock().unwrap();
                            seen.push((cx.key().to_owned(), cx.after_unknown()));
                            if seen.len() == 1 {
                                Err(BankError::Timeout)
                            } else {
                                Ok(debit * 2)
                            }
                        },
                    )
                    .await
                })
        };
        match attempt().await {
            Err(RunError::Failed {
                error: BankError::Timeout,
                replayed: false,
            }) => {}
            other => panic!("{store_name}: {other:?}"),
        }
        let record = store.get(&key, idem.clock().now()).await.unwrap().unwrap();
        assert_eq!(
            record.steps[1].outcome,
            StepOutcome::Unknown,
            "{store_name}"
        );
        assert_eq!(attempt().await.unwrap().value, 14, "{store_name}");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2, "{store_name}");
        assert_eq!(
            seen[0].0, seen[1].0,
            "{store_name}: one step key on every attempt"
        );
        assert_eq!(
            (seen[0].1, seen[1].1),
            (false, true),
            "{store_name}: the second try knows"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_input_is_refused_not_resumed() {
    for (store_name, store, _dir) in stores().await {
        let clock = ManualClock::starting_now();
        let idem = Idempotency::new(store.clone()).with_clock(clock.clone());
        let key = key(store_name, "input");
        let runs = Runs::default();
        let (tx, rx) = mpsc::unbounded_channel();
        let first = idem
            .once(&key)
            .input(&("alice", "bob", 100))
            .unwrap()
            .lease(LEASE)
            .steps(|s| transfer(s, &runs, Some(1), tx.clone()));
        crash(first, rx).await;
        clock.advance(LEASE);
        let other = idem
            .once(&key)
            .input(&("alice", "bob", 999))
            .unwrap()
            .steps(|s| transfer(s, &runs, None, tx.clone()))
            .await;
        assert!(
            matches!(other, Err(RunError::Mismatch)),
            "{store_name}: {other:?}"
        );
        assert_eq!(runs.counts(), [1, 0, 0], "{store_name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overtaken_attempt_cannot_record_its_step() {
    let clock = ManualClock::starting_now();
    let idem = Idempotency::new(MemoryStore::new()).with_clock(clock.clone());
    let key = key("memory", "overtaken");
    let (entered, mut in_step) = mpsc::unbounded_channel::<()>();
    let (go_on, wait) = tokio::sync::oneshot::channel::<()>();
    let slow = {
        let (idem, key) = (idem.clone(), key.clone());
        tokio::spawn(async move {
            idem.once(&key)
                .lease(LEASE)
                .steps(|s| async move {
                    s.step("slow", |_| async move {
                        entered.send(()).unwrap();
                        wait.await.unwrap();
                        Ok::<_, BankError>("first".to_owned())
                    })
                    .await
                })
                .await
        })
    };
    in_step.recv().await.unwrap();
    clock.advance(LEASE);
    let second = idem
        .once(&key)
        .steps(|s| async move {
            s.step("slow", |_| async {
                Ok::<_, BankError>("second".to_owned())
            })
            .await
        })
        .await
        .unwrap();
    assert_eq!(second.value, "second");
    go_on.send(()).unwrap();
    let first = slow.await.unwrap();
    assert!(matches!(first, Err(RunError::LeaseLost)), "{first:?}");
    let replay = idem
        .once(&key)
        .steps(|s| async move {
            s.step("slow", |_| async { Ok::<_, BankError>("third".to_owned()) })
                .await
        })
        .await
        .unwrap();
    assert_eq!((replay.value.as_str(), replay.replayed), ("second", true));
}

#[tokio::test]
async fn a_step_the_store_cannot_record_releases_the_key_and_runs_again() {
    use idem_testkit::{Fault, FaultyStore, Op};
    let store = FaultyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store.clone());
    let first_key = key("faulty", "unrecorded");
    let runs = Runs::default();
    let (tx, _rx) = mpsc::unbounded_channel();
    // One failure is retried; three in a row are not.
    store.fail_next(Op::RecordStep, Fault::Unavailable);
    let done = idem
        .once(&first_key)
        .steps(|s| transfer(s, &runs, None, tx.clone()))
        .await
        .unwrap();
    assert_eq!(runs.counts(), [1, 1, 1]);
    assert!(!done.replayed);

    let key = key("faulty", "unrecorded-thrice");
    let runs = Runs::default();
    for _ in 0..3 {
        store.fail_next(Op::RecordStep, Fault::Unavailable);
    }
    let first = idem
        .once(&key)
        .steps(|s| transfer(s, &runs, None, tx.clone()))
        .await;
    assert!(matches!(first, Err(RunError::NotRecorded(_))), "{first:?}");
    assert_eq!(
        runs.counts(),
        [1, 0, 0],
        "the attempt stopped at the unrecorded step"
    );
    // The key was released at once: the retry needs no wait, and runs that step again.
    let done = idem
        .once(&key)
        .steps(|s| transfer(s, &runs, None, tx.clone()))
        .await
        .unwrap();
    assert_eq!(runs.counts(), [2, 1, 1]);
    assert!(!done.replayed);
}

#[tokio::test]
async fn a_resumption_whose_steps_cannot_be_read_runs_nothing() {
    use idem_testkit::{Fault, FaultyStore, Op};
    let store = FaultyStore::new(MemoryStore::new());
    let clock = ManualClock::starting_now();
    let idem = Idempotency::new(store.clone()).with_clock(clock.clone());
    let key = key("faulty", "unread");
    let runs = Runs::default();
    let (tx, rx) = mpsc::unbounded_channel();
    let first = idem
        .once(&key)
        .lease(LEASE)
        .steps(|s| transfer(s, &runs, Some(1), tx.clone()));
    crash(first, rx).await;
    clock.advance(LEASE);
    store.fail_next(Op::Get, Fault::Unavailable);
    let second = idem
        .once(&key)
        .steps(|s| transfer(s, &runs, None, tx.clone()))
        .await;
    assert!(matches!(second, Err(RunError::Store(_))), "{second:?}");
    assert_eq!(runs.counts(), [1, 0, 0]);
    // Released: the next attempt resumes at once.
    let done = idem
        .once(&key)
        .steps(|s| transfer(s, &runs, None, tx.clone()))
        .await
        .unwrap();
    assert_eq!(runs.counts(), [1, 1, 1]);
    assert!(done.value.starts_with("debit"));
}

#[tokio::test]
async fn a_bad_step_name_stops_the_run_and_a_name_used_again_hands_back_its_output() {
    let idem = Idempotency::new(MemoryStore::new());
    let bad = idem
        .once(&key("memory", "bad-name"))
        .steps(|s| async move {
            s.step("no spaces", |_| async { Ok::<_, BankError>(1) })
                .await
        })
        .await;
    assert!(matches!(bad, Err(RunError::Step(_))), "{bad:?}");
    let twice = idem
        .once(&key("memory", "twice"))
        .steps(|s| async move {
            let one = s.step("same", |_| async { Ok::<_, BankError>(1) }).await?;
            // The same name again hands back the first output without running.
            let again = s.step("same", |_| async { Ok::<_, BankError>(2) }).await?;
            Ok((one, again))
        })
        .await
        .unwrap();
    assert_eq!(twice.value, (1, 1));
}

/// A step whose output can never be recorded (it does not encode, it does not decode back, it
/// is larger than a record keeps) ran its effect: the run stores a marker, and a retry gets the
/// same error without running the step again.
#[tokio::test]
async fn a_step_that_ran_but_cannot_be_recorded_is_not_run_again() {
    #[derive(Serialize, Deserialize)]
    struct Unencodable(#[serde(serialize_with = "refuse")] u32);
    fn refuse<S: serde::Serializer>(_: &u32, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("no"))
    }
    let idem = Idempotency::new(MemoryStore::new());
    let ran = AtomicUsize::new(0);
    let effect = &|| {
        ran.fetch_add(1, Ordering::SeqCst);
    };
    let cases: [(&str, &dyn Fn() -> Key); 3] = [
        ("unencodable", &|| key("memory", "unencodable")),
        ("nan", &|| key("memory", "nan")),
        ("too-large", &|| key("memory", "too-large")),
    ];
    for (case, make_key) in cases {
        ran.store(0, Ordering::SeqCst);
        let key = make_key();
        for attempt in 0..2 {
            let run = idem
                .once(&key)
                .steps(|s| async move {
                    match case {
                        "unencodable" => {
                            s.step("effect", |_| async {
                                effect();
                                Ok::<_, BankError>(Unencodable(1))
                            })
                            .await?;
                        }
                        "nan" => {
                            s.step("effect", |_| async {
                                effect();
                                Ok::<_, BankError>(f64::NAN)
                            })
                            .await?;
                        }
                        _ => {
                            s.step("effect", |_| async {
                                effect();
                                Ok::<_, BankError>("x".repeat(2 << 20))
                            })
                            .await?;
                        }
                    }
                    Ok(())
                })
                .await;
            assert!(
                matches!(run, Err(RunError::Codec(_))),
                "{case}, attempt {attempt}: {run:?}"
            );
        }
        assert_eq!(ran.load(Ordering::SeqCst), 1, "{case}: the effect ran once");
    }
}

/// A step past the most a record keeps is refused before it runs.
#[tokio::test]
async fn a_step_past_the_last_a_record_keeps_does_not_run() {
    let idem = Idempotency::new(MemoryStore::new());
    let ran = &AtomicUsize::new(0);
    let run = idem
        .once(&key("memory", "full"))
        .steps(|s| async move {
            for i in 0..idem_core::step::MAX_STEPS {
                s.step(&format!("s{i}"), |_| async { Ok::<_, BankError>(()) })
                    .await?;
            }
            s.step("one-more", |_| async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, BankError>(())
            })
            .await
        })
        .await;
    assert!(matches!(run, Err(RunError::Step(_))), "{run:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// A run with steps on a store chosen at run time (`SharedStore`) is `Send`: it can be spawned,
/// as an HTTP handler's work is.
#[tokio::test]
async fn a_run_with_steps_on_a_shared_store_can_be_spawned() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let idem = Idempotency::new(store);
    let spawned = tokio::spawn(async move {
        let key = Key::parse("t", "spawned", "k").unwrap();
        let once = idem.once(&key).input(&1).unwrap();
        once.steps(|s| async move {
            let a: u32 = s.step("a", |_| async { Ok::<_, String>(1) }).await?;
            s.step("b", |_| async move { Ok::<_, String>(a + 1) }).await
        })
        .await
    });
    assert_eq!(spawned.await.unwrap().unwrap().value, 2);
}

/// The debit of `steps_in_the_callers_transaction`: a row in `ledger`, and, when `in_tx`, the
/// step's recovery point in the same transaction. With `die`, the attempt dies right after the
/// commit, before the step returns.
async fn debit_in_tx(
    store: &idem::PostgresStore,
    ledger: &str,
    (key, lease): (&Key, idem::Lease),
    in_tx: bool,
    die: Option<mpsc::UnboundedSender<()>>,
) -> Result<u64, String> {
    let fail = |e: &dyn std::fmt::Display| e.to_string();
    let mut tx = store.pool().begin().await.map_err(|e| fail(&e))?;
    let insert = format!("INSERT INTO {ledger} (amount) VALUES (100)");
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .execute(&mut *tx)
        .await
        .map_err(|e| fail(&e))?;
    if in_tx {
        let output = serde_json::to_vec(&100u64).map_err(|e| fail(&e))?;
        let step = idem::Step::done(idem::StepName::new("debit").unwrap(), output).unwrap();
        let now = idem::Timestamp::now();
        store
            .record_step_in(&mut tx, key, &lease, &step, now)
            .await
            .map_err(|e| fail(&e))?;
    }
    tx.commit().await.map_err(|e| fail(&e))?;
    if let Some(die) = die {
        let _ = die.send(());
        std::future::pending::<()>().await;
    }
    Ok(100)
}

/// A step whose work writes to the business database records its recovery point in the same
/// transaction (`PostgresStore::record_step_in`): an attempt that dies after the commit, before
/// the step returned, leaves the write and its recovery point together, and the next attempt
/// does not write again. Recorded after the commit instead (as `Steps::step` does on its own),
/// the same death makes the next attempt write twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_recorded_in_the_callers_transaction_is_not_run_again_after_a_crash() {
    let Some(url) = POSTGRES.url() else { return };
    let table = format!("idem_steps_tx_{:08x}", rand::random::<u32>());
    let options = idem::PostgresOptions {
        table: table.clone(),
        ..Default::default()
    };
    let store = idem::PostgresStore::connect_with(&url, options)
        .await
        .unwrap();
    let ledger = format!("{table}_ledger");
    let create = format!("CREATE TABLE {ledger} (amount BIGINT NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(store.pool())
        .await
        .unwrap();
    let idem = Idempotency::new(store.clone());
    let lease = Duration::from_millis(300);
    for in_tx in [true, false] {
        let key = key("postgres", if in_tx { "in-tx" } else { "after-tx" });
        let attempt = |die: Option<mpsc::UnboundedSender<()>>| {
            let (store, ledger, key) = (&store, ledger.as_str(), &key);
            idem.once(key)
                .lease(lease)
                .input(&100)
                .unwrap()
                .steps(move |s| async move {
                    let held = s.lease();
                    let debited: u64 = s
                        .step("debit", |_| {
                            debit_in_tx(store, ledger, (key, held), in_tx, die)
                        })
                        .await?;
                    s.step("credit", |_| async move { Ok::<_, String>(debited) })
                        .await
                })
        };
        let (died, stopped) = mpsc::unbounded_channel();
        crash(attempt(Some(died)), stopped).await;
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        let done = attempt(None).await.unwrap();
        assert_eq!(done.value, 100);
        let sum = format!("SELECT COUNT(*) FROM {ledger}");
        let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sum))
            .fetch_one(store.pool())
            .await
            .unwrap();
        // The ledger is shared: one row from the first case; two more from the second.
        let want = if in_tx { 1 } else { 3 };
        assert_eq!(rows, want, "in the caller's transaction: {in_tx}");
    }
    let tables =
        ["_ledger", "_migrations", "_counters", "_locks", ""].map(|t| format!("{table}{t}"));
    for t in tables {
        let drop = format!("DROP TABLE IF EXISTS {t}");
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(store.pool())
            .await
            .unwrap();
    }
}
