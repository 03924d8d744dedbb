//! The store failing and runs failing: closed when the store is down, a key given back after
//! a cancelled or panicking run.

use super::*;

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
        .run(|lease| async move { Ok::<_, PayError>(lease.acquisition()) })
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
