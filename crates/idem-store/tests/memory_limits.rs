//! The memory store's bounds: a full store refuses new keys, purges dead records to make
//! room, never forgets a live one, and still answers for the keys it holds.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, Step, StepError, StepName, Store,
    StoreError, Timestamp,
};
use idem_store::{MemoryLimits, MemoryStore, RECORD_OVERHEAD};

fn req(k: &str) -> BeginRequest {
    BeginRequest::new(
        Key::parse("scope", "ns", k).unwrap(),
        Fingerprint::of_bytes(b"same"),
    )
    .with_lease(Duration::from_secs(10))
    .with_ttl(Duration::from_secs(100))
}

fn at(secs: u64) -> Timestamp {
    Timestamp::from_millis(1_800_000_000_000 + secs * 1000)
}

async fn acquire(store: &MemoryStore, k: &str, now: Timestamp) -> Lease {
    match store.begin(&req(k), now).await.unwrap() {
        BeginOutcome::Acquired(lease) => lease,
        other => panic!("expected acquired, got {other:?}"),
    }
}

fn assert_full(r: Result<BeginOutcome, StoreError>) {
    match r {
        Err(e @ StoreError::Full { .. }) => assert!(e.is_transient()),
        other => panic!("expected a full store, got {other:?}"),
    }
}

/// The size a record of key `k` (in scope "scope", namespace "ns") counts with `response`.
fn size(k: &str, response: usize) -> usize {
    RECORD_OVERHEAD + "scope".len() + "ns".len() + k.len() + response
}

#[tokio::test]
async fn a_full_store_refuses_new_keys_and_answers_for_the_ones_it_holds() {
    let store = MemoryStore::with_limits(MemoryLimits::new(3, usize::MAX));
    let done = acquire(&store, "done", at(0)).await;
    store
        .complete(
            &req("done").key,
            &done,
            Bytes::from_static(b"result"),
            at(0),
        )
        .await
        .unwrap();
    let running = acquire(&store, "running", at(0)).await;
    let late = acquire(&store, "late", at(0)).await;
    assert_eq!(store.usage().0, 3);
    assert_full(store.begin(&req("new"), at(1)).await);
    assert_eq!(store.usage().0, 3, "a refused begin stored nothing");

    // A replay, an in-progress answer and a takeover need no room.
    match store.begin(&req("done"), at(1)).await.unwrap() {
        BeginOutcome::Replay(r) => assert_eq!(&r.response[..], b"result"),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert!(matches!(
        store.begin(&req("running"), at(1)).await.unwrap(),
        BeginOutcome::InProgress { .. }
    ));
    let taken = acquire(&store, "late", at(11)).await;
    assert!(taken.fence > late.fence);
    // Completions are never refused for room.
    store
        .complete(
            &req("running").key,
            &running,
            Bytes::from_static(b"r"),
            at(12),
        )
        .await
        .unwrap();
    assert_full(store.begin(&req("new"), at(12)).await);
}

#[tokio::test]
async fn the_byte_bound_counts_key_response_and_overhead() {
    let max = size("a", 100) + size("b", 0);
    let store = MemoryStore::with_limits(MemoryLimits::new(usize::MAX, max));
    let a = acquire(&store, "a", at(0)).await;
    assert_eq!(store.usage(), (1, size("a", 0)));
    store
        .complete(&req("a").key, &a, Bytes::from(vec![7; 100]), at(0))
        .await
        .unwrap();
    assert_eq!(store.usage(), (1, size("a", 100)));
    acquire(&store, "b", at(0)).await;
    assert_eq!(store.usage(), (2, max));
    assert_full(store.begin(&req("c"), at(0)).await);
}

#[tokio::test]
async fn dead_records_are_purged_to_make_room_and_live_ones_never() {
    let store = MemoryStore::with_limits(MemoryLimits::new(2, usize::MAX));
    let old = acquire(&store, "old", at(0)).await;
    store
        .complete(&req("old").key, &old, Bytes::from_static(b"x"), at(0))
        .await
        .unwrap();
    // In progress from 50: live until its lease end plus the TTL (160).
    acquire(&store, "live", at(50)).await;
    // "old" is replayed until 100, so there is no room before then.
    assert_full(store.begin(&req("new"), at(99)).await);
    assert_eq!(store.usage().0, 2);
    // From 100 it is dead, and purged for the new key; "live" stays.
    acquire(&store, "new", at(100)).await;
    assert_eq!(store.usage().0, 2);
    assert!(store.get(&req("old").key, at(100)).await.unwrap().is_none());
    assert!(
        store
            .get(&req("live").key, at(100))
            .await
            .unwrap()
            .is_some()
    );
    assert_full(store.begin(&req("more"), at(101)).await);
}

#[tokio::test]
async fn purging_and_releasing_give_their_room_back() {
    let store = MemoryStore::with_limits(MemoryLimits::new(1, usize::MAX));
    let lease = acquire(&store, "a", at(0)).await;
    store.release(&req("a").key, &lease, at(1)).await.unwrap();
    // A released record is kept (for its fence) until its retention ends.
    assert_full(store.begin(&req("b"), at(2)).await);
    assert_eq!(store.purge_expired(at(101), 10).await.unwrap(), 1);
    assert_eq!(store.usage(), (0, 0));
    acquire(&store, "b", at(101)).await;
}

#[tokio::test]
async fn a_completion_that_shortens_retention_brings_the_room_forward() {
    let store = MemoryStore::with_limits(MemoryLimits::new(2, usize::MAX));
    // In progress at 0: live until 10 + 100.
    let a = acquire(&store, "a", at(0)).await;
    acquire(&store, "b", at(0)).await;
    assert_full(store.begin(&req("c"), at(5)).await);
    // Completed at 6: live until 106 now.
    store
        .complete(&req("a").key, &a, Bytes::from_static(b"x"), at(6))
        .await
        .unwrap();
    assert_full(store.begin(&req("c"), at(105)).await);
    acquire(&store, "c", at(106)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_begins_never_pass_the_bound() {
    let store = MemoryStore::with_limits(MemoryLimits::new(50, usize::MAX));
    let tasks: Vec<_> = (0..400)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&req(&format!("k{i}")), at(0)).await })
        })
        .collect();
    let (mut acquired, mut full) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(BeginOutcome::Acquired(_)) => acquired += 1,
            Err(StoreError::Full { .. }) => full += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((acquired, full), (50, 350));
    assert_eq!(store.usage().0, 50);
}

/// Recovery points count toward the byte bound, and one that would pass it is refused (after
/// dead records are purged): unlike a completion, a refused step loses nothing, since the next
/// attempt runs it again.
#[tokio::test]
async fn steps_count_and_need_room() {
    let step = |name: &str, n: usize| Step::done(StepName::new(name).unwrap(), vec![1; n]).unwrap();
    let first = step("first", 100);
    let max = size("a", 0) + first.encoded_len() + size("old", 0);
    let store = MemoryStore::with_limits(MemoryLimits::new(usize::MAX, max));
    let old = req("old")
        .with_ttl(Duration::from_secs(5))
        .with_lease(Duration::from_secs(1));
    store.begin(&old, at(0)).await.unwrap();
    let a = acquire(&store, "a", at(0)).await;
    store
        .record_step(&req("a").key, &a, &first, at(0))
        .await
        .unwrap();
    assert_eq!(store.usage(), (2, max));
    match store
        .record_step(&req("a").key, &a, &step("second", 1), at(1))
        .await
    {
        Err(StepError::Store(e @ StoreError::Full { .. })) => assert!(e.is_transient()),
        other => panic!("expected a full store, got {other:?}"),
    }
    // Once the dead record is gone there is room again.
    store
        .record_step(&req("a").key, &a, &step("second", 1), at(6))
        .await
        .unwrap();
    let steps = store
        .get(&req("a").key, at(6))
        .await
        .unwrap()
        .unwrap()
        .steps;
    assert_eq!(steps.len(), 2);
}
