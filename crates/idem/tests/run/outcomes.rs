//! What a run answers: its value once and replays after, its errors kept or given back.

use super::*;

#[tokio::test]
async fn runs_once_and_replays_the_value() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = &AtomicUsize::new(0);
    let mut fence = None;
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
        assert_eq!(done.value, format!("tx-{}", done.fence));
        assert_eq!(done.replayed, i > 0);
        assert_eq!(
            *fence.get_or_insert(done.fence),
            done.fence,
            "one run's fence"
        );
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
        .run(|lease| async move { Ok::<_, PayError>(lease.acquisition()) })
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
        .run(|lease| async move { Ok::<_, PayError>(lease.acquisition()) })
        .await
        .unwrap();
    assert_eq!(retry.value, 2);
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

#[tokio::test]
async fn a_retryable_failure_of_an_overtaken_run_is_a_lost_lease() {
    // A relay's POST refused by a fenced target because a newer attempt already delivered it
    // is such a failure: the newer attempt's answer is the key's, and this one must not be
    // reported (or dead-lettered) as the work's own failure.
    let clock = ManualClock::starting_now();
    let idem = Idempotency::new(MemoryStore::new()).with_clock(clock.clone());
    let lease = Duration::from_secs(5);
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let first = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.once(&key("overtaken"))
                .lease(lease)
                .run(|_| async move {
                    started_tx.send(()).unwrap();
                    let _ = wait.await;
                    Err::<u8, _>(PayError::Timeout)
                })
                .await
        })
    };
    started.await.unwrap();
    clock.advance(lease + Duration::from_secs(1));
    let second = idem
        .once(&key("overtaken"))
        .run(|_| async { Ok::<_, PayError>(2) })
        .await
        .unwrap();
    assert_eq!(second.value, 2);
    go.send(()).unwrap();
    let first = first.await.unwrap();
    assert!(matches!(first, Err(RunError::LeaseLost)), "{first:?}");
    let replay = idem
        .once(&key("overtaken"))
        .run(|_| async { Ok::<_, PayError>(3) })
        .await
        .unwrap();
    assert_eq!((replay.value, replay.replayed), (2, true));
}
