//! Segment ids: unique across allocators sharing a store, the next range fetched before the
//! current one runs out, the step adapted to the pace, and serving from memory while the
//! store is away.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Counters, Key, SharedStore};
use idem_id::{IdError, SegmentOptions, SegmentStatus, Segments};
use idem_store::MemoryStore;
use idem_testkit::{FaultyStore, Op};
use support::{TestStore, Then, When};

/// Long enough for anything in these tests; a wait this long means a caller was stranded.
const STRANDED: Duration = Duration::from_secs(30);

fn options(step: u64) -> SegmentOptions {
    SegmentOptions {
        initial_step: step,
        min_step: step,
        max_step: step * 64,
        ..SegmentOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocators_sharing_a_store_never_hand_out_one_id_twice() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            // Each task is a process with an allocator of its own.
            let segments = Segments::new(store.clone(), "orders", options(100)).unwrap();
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for _ in 0..5_000 {
                    ids.push(segments.next().await.unwrap());
                }
                ids
            })
        })
        .collect();
    let mut all = HashSet::new();
    for t in tasks {
        let ids = t.await.unwrap();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "not increasing within an allocator"
        );
        for id in ids {
            assert!(all.insert(id), "{id} handed out twice");
        }
    }
    assert_eq!(all.len(), 20_000);
    // Another tag is another sequence.
    let other = Segments::new(store, "invoices", options(100)).unwrap();
    assert_eq!(other.next().await.unwrap(), 1);
}

#[tokio::test]
async fn the_next_range_is_fetched_before_the_current_one_runs_out() {
    let store = Arc::new(MemoryStore::new());
    let segments = Segments::new(store.clone(), "orders", options(100)).unwrap();
    let key = Key::parse("idem.ids", "idem.segment", "orders").unwrap();
    assert_eq!(segments.next().await.unwrap(), 1);
    for _ in 0..20 {
        segments.try_next().unwrap();
    }
    // A tenth used: the range ahead arrives in the background.
    for _ in 0..100 {
        if segments.remaining() > 100 {
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(segments.remaining() > 100, "no range fetched ahead");
    // The store's counter is past the range in use: someone else would start above it.
    assert!(store.advance(&key, 1).await.unwrap() > 200);
    // Used up quickly (far faster than the 60 s target), the step grows.
    assert!(segments.step() > 100);
}

#[tokio::test]
async fn a_store_outage_is_served_from_memory_until_it_runs_dry() {
    let faulty = Arc::new(FaultyStore::new(MemoryStore::new()));
    let store: SharedStore = faulty.clone();
    let segments = Segments::new(store, "orders", options(100)).unwrap();
    let first = segments.next().await.unwrap();
    // Let the range ahead arrive, then lose the store.
    for _ in 0..30 {
        segments.try_next().unwrap();
    }
    for _ in 0..100 {
        if segments.remaining() > 100 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    faulty.set_down(true);
    let runway = segments.remaining();
    assert!(runway > 100);
    assert!(segments.runway().is_some());
    let mut last = first;
    for _ in 0..runway {
        let id = segments.next().await.unwrap();
        assert!(id > last);
        last = id;
    }
    // Dry, with the store away: a clear error, not a made-up id.
    assert!(matches!(segments.next().await, Err(IdError::Store(_))));
    assert!(segments.last_error().is_some());
    faulty.set_down(false);
    assert!(segments.next().await.unwrap() > last);
}

/// Many callers finding memory empty at once share one fetch: ranges are neither taken twice
/// nor dropped (the store's counter moves by at most the range in use and the one ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_find_memory_empty_together_share_one_fetch() {
    // SQLite answers from its writer thread, so callers really wait for it together.
    let dir = tempfile::tempdir().unwrap();
    let store: SharedStore =
        Arc::new(idem_store::SqliteStore::open(dir.path().join("ids.db")).unwrap());
    let segments = Segments::new(store.clone(), "orders", options(100)).unwrap();
    let callers: Vec<_> = (0..16)
        .map(|_| {
            let segments = segments.clone();
            tokio::spawn(async move { segments.next().await.unwrap() })
        })
        .collect();
    let mut ids = HashSet::new();
    for c in callers {
        assert!(ids.insert(c.await.unwrap()));
    }
    // A range fetched ahead in the background may still be on its way: wait (within a bound
    // that only keeps a broken fetch from hanging the test) until memory and store agree.
    let key = Key::parse("idem.ids", "idem.segment", "orders").unwrap();
    let mut taken = 0;
    for _ in 0..1000 {
        taken = store.raise(&key, 0).await.unwrap(); // reads the counter
        if segments.remaining() + 16 == taken {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        taken <= 2 * 100,
        "{taken} ids taken from the store for 16 served"
    );
    assert_eq!(segments.remaining() + 16, taken);
}

fn key(tag: &str) -> Key {
    Key::parse("idem.ids", "idem.segment", tag).unwrap()
}

/// `n` callers of `next` in tasks of their own.
fn callers(
    segments: &Arc<Segments>,
    n: usize,
) -> Vec<tokio::task::JoinHandle<Result<u64, IdError>>> {
    (0..n)
        .map(|_| {
            let segments = segments.clone();
            tokio::spawn(async move { segments.next().await })
        })
        .collect()
}

/// What each caller got (none may panic), each within [`STRANDED`].
async fn answers(
    callers: Vec<tokio::task::JoinHandle<Result<u64, IdError>>>,
) -> Vec<Result<u64, IdError>> {
    let mut answers = Vec::new();
    for caller in callers {
        let answer = tokio::time::timeout(STRANDED, caller)
            .await
            .expect("a caller was stranded");
        answers.push(answer.expect("a caller panicked"));
    }
    answers
}

/// A caller that goes away while the store is answering its fetch (a client that hung up, a
/// timeout) strands nobody: the fetch ends without it, and the range the store handed out
/// serves the callers already waiting and those that come later, none skipped.
#[tokio::test]
async fn a_caller_dropped_while_its_fetch_is_stalled_strands_nobody() {
    let store = TestStore::new();
    let segments = Segments::new(store.clone(), "orders", options(100)).unwrap();
    // The store applies the first fetch; its answer is held.
    let stall = store.stall(Op::Advance, 0, When::After);
    let first = callers(&segments, 1).remove(0);
    stall.reached().await;
    let waiting = callers(&segments, 1).remove(0);
    tokio::task::yield_now().await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    stall.end(Then::Answer);
    let a = answers(vec![waiting]).await.remove(0).unwrap();
    let b = tokio::time::timeout(STRANDED, segments.next())
        .await
        .expect("the tag answers no more")
        .unwrap();
    let mut served = [a, b];
    served.sort_unstable();
    assert_eq!(served, [1, 2]);
    // One range taken from the store, and it is the one in use.
    assert_eq!(store.raise(&key("orders"), 0).await.unwrap(), 100);
    assert_eq!(segments.remaining(), 98);
}

/// A fetch that panics (a broken store driver) fails the callers waiting for it instead of
/// leaving them waiting, and the next call fetches again.
#[tokio::test]
async fn a_fetch_that_panics_fails_its_callers_and_the_next_call_fetches_again() {
    let store = TestStore::new();
    let segments = Segments::new(store.clone(), "orders", options(100)).unwrap();
    let stall = store.stall(Op::Advance, 0, When::Before);
    let waiting = callers(&segments, 3);
    stall.reached().await;
    stall.end(Then::Panic);
    for answer in answers(waiting).await {
        assert!(matches!(answer, Err(IdError::Store(_))), "{answer:?}");
    }
    let next = tokio::time::timeout(STRANDED, segments.next()).await;
    assert_eq!(next.expect("the tag answers no more").unwrap(), 1);
}

/// A fetch that fails while callers wait for it fails them all, at once; the status says so
/// (ids left, since when, why); the next call after the store recovers succeeds.
#[tokio::test]
async fn a_failed_fetch_fails_every_waiter_and_the_next_call_after_recovery_succeeds() {
    let store = TestStore::new();
    let segments = Segments::new(store.clone(), "orders", options(100)).unwrap();
    assert_eq!(segments.status(), SegmentStatus::Ready { remaining: 0 });
    let stall = store.stall(Op::Advance, 0, When::Before);
    let waiting = callers(&segments, 3);
    stall.reached().await;
    stall.end(Then::Fail);
    for answer in answers(waiting).await {
        assert!(matches!(answer, Err(IdError::Store(_))), "{answer:?}");
    }
    let SegmentStatus::Failing {
        reason, remaining, ..
    } = segments.status()
    else {
        panic!("{:?}", segments.status());
    };
    assert!(reason.contains("unavailable"), "{reason}");
    assert_eq!(remaining, 0);

    let next = tokio::time::timeout(STRANDED, segments.next()).await;
    assert_eq!(next.expect("the tag answers no more").unwrap(), 1);
    assert_eq!(segments.status(), SegmentStatus::Ready { remaining: 99 });
}

/// Segments on a Redis of the test's own that keeps nothing on disk: taken before and after a
/// restart, no id repeats. Such a server would reset the counter and hand out the same ranges
/// again, so its counters are refused, with a message that says why and what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_never_repeat_across_a_restart_of_a_redis_that_keeps_nothing() {
    use idem_store::{RedisOptions, RedisStore};
    use idem_testkit::services::RedisServer;

    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let redis = RedisOptions {
        response_timeout: Duration::from_secs(1),
        ..RedisOptions::default()
    };
    let mut seen = HashSet::new();
    let mut refusals = Vec::new();
    for life in 0..2 {
        if life == 1 {
            server.restart();
        }
        // Each life is a process started afresh against the server.
        let store: SharedStore = Arc::new(
            RedisStore::connect(&server.url(), redis.clone())
                .await
                .unwrap(),
        );
        let segments = Segments::new(store, "orders", options(100)).unwrap();
        for _ in 0..250 {
            match segments.next().await {
                Ok(id) => assert!(seen.insert(id), "{id} handed out twice"),
                Err(e) => {
                    refusals.push(e.to_string());
                    break;
                }
            }
        }
    }
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert!(
        refusals.iter().all(|r| r.contains("appendonly yes")),
        "{refusals:?}"
    );
}
