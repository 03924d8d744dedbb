//! Purging: expired records are deleted in batches, live ones are kept, and a failing store
//! is reported (and retried by the loop) rather than ending it.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use idem::purge::{BATCH, purge_all, purge_loop};
use idem::{
    BeginOutcome, BeginRequest, Bytes, Clock, Fingerprint, Key, ManualClock, MemoryStore,
    SharedStore, Store, Timestamp,
};
use idem_testkit::{Fault, FaultyStore, Op};

fn request(i: usize, ttl: Duration) -> BeginRequest {
    let key = Key::parse("tests", "purge", &format!("k{i}")).unwrap();
    BeginRequest::new(key, Fingerprint::of_bytes(b"x")).with_ttl(ttl)
}

async fn completed<S: Store>(store: &S, i: usize, ttl: Duration, now: Timestamp) {
    let req = request(i, ttl);
    let BeginOutcome::Acquired(lease) = store.begin(&req, now).await.unwrap() else {
        panic!("fresh key not acquired");
    };
    store
        .complete(&req.key, &lease, Bytes::from_static(b"ok"), now)
        .await
        .unwrap();
}

#[tokio::test]
async fn purge_all_deletes_every_expired_record_across_batches_and_keeps_live_ones() {
    let store = MemoryStore::new();
    let now = Timestamp::from_millis(1_000_000);
    let expired = BATCH * 2 + 5;
    for i in 0..expired {
        completed(&store, i, Duration::from_secs(1), now).await;
    }
    completed(&store, expired, Duration::from_secs(3600), now).await;

    let later = now.saturating_add(Duration::from_secs(60));
    assert_eq!(purge_all(&store, later).await.unwrap(), expired as u64);
    assert_eq!(purge_all(&store, later).await.unwrap(), 0);
    let live = store
        .get(&request(expired, Duration::ZERO).key, later)
        .await;
    assert!(live.unwrap().is_some(), "a live record was purged");
}

#[tokio::test(start_paused = true)]
async fn the_loop_survives_a_failing_store_and_purges_at_the_next_tick() {
    let faulty = Arc::new(FaultyStore::new(MemoryStore::new()));
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_000_000)));
    completed(&*faulty, 0, Duration::from_secs(1), clock.now()).await;
    clock.advance(Duration::from_secs(10));
    faulty.fail_next(Op::Purge, Fault::Unavailable);

    let store: SharedStore = faulty.clone();
    let task = tokio::spawn(purge_loop(store, clock.clone(), Duration::from_secs(60)));
    // The first pass runs at once and fails; the record is still there.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(faulty.inner().len(), 1);
    // The next tick purges it.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(faulty.inner().len(), 0);
    assert!(!task.is_finished());
    task.abort();
}

/// A zero interval does not stop the loop: it purges, at most once a second.
#[tokio::test(start_paused = true)]
async fn a_zero_interval_still_purges() {
    let store = Arc::new(MemoryStore::new());
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_000_000)));
    completed(&*store, 0, Duration::from_secs(1), clock.now()).await;
    clock.advance(Duration::from_secs(10));
    let shared: SharedStore = store.clone();
    let task = tokio::spawn(purge_loop(shared, clock.clone(), Duration::ZERO));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(store.len(), 0);
    assert!(!task.is_finished(), "the loop runs on");
    task.abort();
}
