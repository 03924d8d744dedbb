//! Attempts in flight: refused, awaited within a bound, taken over when their lease runs out.

use super::*;

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
        .run(|lease| async move { Ok::<_, PayError>(format!("second@{}", lease.acquisition())) })
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
