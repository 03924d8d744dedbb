//! A Snowflake generator that keeps its worker id: it replaces one the store forgot, only once
//! every lease the store may have forgotten has run out and above every id it issued; it says
//! what it is doing meanwhile; and it stops for good when released.
//!
//! The store's callers and the generators read one manual clock, and Tokio's timers are
//! paused (they run ahead whenever every task waits), so each step is where the test puts it.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, Counters, Key, ManualClock, SharedStore};
use idem_id::{
    DEFAULT_EPOCH_MS, IdError, Layout, ManagedSnowflake, SnowflakeOptions, WorkerPool, WorkerStatus,
};
use idem_testkit::Op;
use support::{ManualTime, TestStore, Then, When, eventually, small_layout};

const LEASE: Duration = Duration::from_secs(30);

fn pool(store: SharedStore, clock: &ManualClock) -> WorkerPool {
    WorkerPool::new(store, Arc::new(clock.clone()), "orders")
        .lease(LEASE)
        .quarantine(Duration::from_secs(60))
        .time_source(ManualTime::new(clock))
}

async fn start(store: SharedStore, clock: &ManualClock) -> Arc<ManagedSnowflake> {
    ManagedSnowflake::start(
        pool(store, clock),
        small_layout(),
        SnowflakeOptions::default(),
    )
    .await
    .unwrap()
}

/// Lets the keeper run for a while of Tokio's (paused) time, the manual clock standing still.
async fn let_it_run() {
    tokio::time::sleep(Duration::from_secs(5)).await;
}

/// The store forgets everything (a Redis restarted empty) under two processes: A keeps its ids
/// with a `ManagedSnowflake`, B is a plain leased generator that cannot reach the store and so
/// goes on issuing until its lease ends. A says it lost its worker id, issues nothing while
/// B's forgotten lease may still run, then claims a new worker id and issues ids above all of
/// its own and stamped after B's last possible one, whichever worker id it gets.
#[tokio::test(start_paused = true)]
async fn a_worker_id_the_store_forgot_is_replaced_once_every_forgotten_lease_has_ended() {
    let clock = ManualClock::starting_now();
    let store = TestStore::new();
    let a = start(store.clone(), &clock).await;
    let WorkerStatus::Holding { worker: first, .. } = a.status() else {
        panic!("{:?}", a.status());
    };
    assert_eq!(a.worker(), Some(first));
    let b_view = TestStore::over(store.clone());
    let b = pool(b_view.clone(), &clock)
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    let mut a_ids: Vec<u64> = (0..1000).map(|_| a.try_next().unwrap()).collect();
    let mut b_ids: Vec<u64> = (0..1000).map(|_| b.try_next().unwrap()).collect();
    // Both renew (A by itself), then the store forgets, and B loses its way to it.
    b.heartbeat().await.unwrap();
    let_it_run().await;
    let b_lease_end = small_layout()
        .millis_at(b.lease().expires_at.to_system_time())
        .unwrap();
    let lost_at = clock.now();
    store.forget_everything();
    b_view.set_down(true);

    eventually("A notices", || !a.status().is_issuing()).await;
    let WorkerStatus::Claiming {
        since, next_try, ..
    } = a.status()
    else {
        panic!("{:?}", a.status());
    };
    assert_eq!(since, lost_at);
    assert_eq!(next_try, lost_at.saturating_add(LEASE));
    assert_eq!(a.worker(), None);
    assert!(
        matches!(a.try_next(), Err(IdError::NoWorker { retry_after, .. }) if retry_after == LEASE),
        "{:?}",
        a.try_next()
    );

    // Just before B's lease ends, B still issues and A still waits.
    clock.advance(LEASE - Duration::from_secs(1));
    let_it_run().await;
    assert!(matches!(a.status(), WorkerStatus::Claiming { .. }));
    b_ids.extend((0..1000).map(|_| b.try_next().unwrap()));

    // Past it, B refuses by itself, and A holds a worker id again.
    clock.advance(Duration::from_secs(2));
    assert_eq!(b.try_next(), Err(IdError::LeaseExpired));
    eventually("A holds a new worker id", || a.status().is_issuing()).await;
    let WorkerStatus::Holding { since, .. } = a.status() else {
        panic!("{:?}", a.status());
    };
    assert_eq!(since, clock.now());
    let resumed: Vec<u64> = (0..1000).map(|_| a.try_next().unwrap()).collect();
    assert!(resumed[0] > *a_ids.last().unwrap());
    assert!(small_layout().decode(resumed[0]).millis > b_lease_end);
    a_ids.extend(resumed);
    assert!(a_ids.windows(2).all(|w| w[0] < w[1]), "not increasing");
    let a_set: HashSet<u64> = a_ids.iter().copied().collect();
    assert!(
        b_ids.iter().all(|id| !a_set.contains(id)),
        "an id issued twice"
    );

    // The new store's time floor (stored as `time-fence`) is back above A's ids.
    let time_floor = Key::parse("idem.ids", "snowflake.orders", "time-fence").unwrap();
    let_it_run().await;
    let floor = store.raise(&time_floor, 0).await.unwrap();
    assert!(floor >= small_layout().decode(*a_ids.last().unwrap()).millis + DEFAULT_EPOCH_MS);
}

/// A store that cannot be reached past the lease: the status says the lease ran out (and
/// when, and why), ids are refused; once the store answers again the same worker id goes on.
#[tokio::test(start_paused = true)]
async fn a_lease_that_ran_out_unrenewed_is_reported_and_resumes_when_renewed() {
    let clock = ManualClock::starting_now();
    let store = TestStore::new();
    let g = start(store.clone(), &clock).await;
    let worker = g.worker().unwrap();
    g.try_next().unwrap();
    let_it_run().await;
    let lease_end = clock.now().saturating_add(LEASE);

    store.set_down(true);
    clock.advance(LEASE + Duration::from_secs(1));
    let_it_run().await;
    let WorkerStatus::Expired {
        worker: w,
        since,
        reason,
    } = g.status()
    else {
        panic!("{:?}", g.status());
    };
    assert_eq!(w, worker);
    assert_eq!(since, lease_end);
    assert!(reason.contains("unavailable"), "{reason}");
    assert_eq!(g.try_next(), Err(IdError::LeaseExpired));

    // Not taken over meanwhile: the lease may still be renewed, and ids go on.
    store.set_down(false);
    eventually("renewed", || g.status().is_issuing()).await;
    assert_eq!(g.worker(), Some(worker));
    g.try_next().unwrap();
}

/// With no worker id free at start, it starts all the same, says so, answers a clear error,
/// and takes a worker id as soon as one is free.
#[tokio::test(start_paused = true)]
async fn with_no_worker_id_free_it_keeps_claiming_until_one_is() {
    let clock = ManualClock::starting_now();
    let store = TestStore::new();
    let mut others = Vec::new();
    for _ in 0..4 {
        others.push(
            pool(store.clone(), &clock)
                .claim(small_layout(), SnowflakeOptions::default())
                .await
                .unwrap(),
        );
    }
    let g = start(store.clone(), &clock).await;
    let WorkerStatus::Claiming { reason, .. } = g.status() else {
        panic!("{:?}", g.status());
    };
    assert!(reason.contains("no worker id is free"), "{reason}");
    assert!(matches!(g.try_next(), Err(IdError::NoWorker { .. })));
    let_it_run().await;
    assert!(!g.status().is_issuing());

    // One of the others stops without releasing (a crash): its lease runs out.
    let gone = others.pop().unwrap().worker();
    clock.advance(LEASE + Duration::from_secs(1));
    for other in &others {
        other.heartbeat().await.unwrap();
    }
    eventually("a worker id is claimed", || g.status().is_issuing()).await;
    assert_eq!(g.worker(), Some(gone));
    g.try_next().unwrap();
}

/// Released, it stops for good (a released generator is not replaced), and its worker id is
/// kept from reuse for the quarantine. A release dropped before the store answered stops it
/// all the same.
#[tokio::test(start_paused = true)]
async fn released_it_stops_for_good_even_if_the_release_is_dropped() {
    let clock = ManualClock::starting_now();
    let store = TestStore::new();
    let g = start(store.clone(), &clock).await;
    let released = g.worker();
    g.try_next().unwrap();
    g.release().await.unwrap();
    assert!(matches!(g.status(), WorkerStatus::Stopped { .. }));
    assert_eq!(g.try_next(), Err(IdError::WorkerLost));
    clock.advance(LEASE);
    let_it_run().await;
    assert!(matches!(g.status(), WorkerStatus::Stopped { .. }));

    // The store's answer to a second generator's release is held; its caller goes away.
    let h = start(store.clone(), &clock).await;
    assert!(h.worker().is_some() && h.worker() != released);
    let complete = store.stall(Op::Complete, 0, When::Before);
    let release = tokio::spawn({
        let h = h.clone();
        async move { h.release().await }
    });
    complete.reached().await;
    release.abort();
    assert!(release.await.unwrap_err().is_cancelled());
    complete.end(Then::Answer);
    assert!(matches!(h.status(), WorkerStatus::Stopped { .. }));
    assert_eq!(h.try_next(), Err(IdError::WorkerLost));
    let_it_run().await;
    assert!(matches!(h.status(), WorkerStatus::Stopped { .. }));
}

/// Redis restarted empty (no persistence) under a running generator: it replaces its worker
/// id and issues strictly increasing ids throughout, on a real server of the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_empty_is_survived() {
    use idem_store::{RedisOptions, RedisStore};
    use idem_testkit::services::RedisServer;

    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let options = RedisOptions {
        response_timeout: Duration::from_secs(1),
        ..RedisOptions::default()
    };
    let store: SharedStore = Arc::new(RedisStore::connect(&server.url(), options).await.unwrap());
    let lease = Duration::from_secs(1);
    let pool = WorkerPool::new(store, Arc::new(idem_core::SystemClock), "orders")
        .lease(lease)
        .quarantine(Duration::from_secs(2));
    let g = ManagedSnowflake::start(pool, Layout::default(), SnowflakeOptions::default())
        .await
        .unwrap();
    assert!(g.status().is_issuing());
    let mut ids = vec![g.try_next().unwrap()];
    server.restart();

    // Ids until it has been without a worker id and is back, and a while after. `lost`: when
    // it lost its worker id, and how many ids came before (all later ones are the new
    // generator's: the old one was marked lost before the status said so).
    let mut lost = None;
    let issued = tokio::time::timeout(Duration::from_secs(30), async {
        while lost.is_none_or(|(_, before)| ids.len() < before + 100) {
            match g.try_next() {
                Ok(id) => ids.push(id),
                Err(IdError::LeaseExpired | IdError::NoWorker { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            if let WorkerStatus::Claiming { since, .. } = g.status() {
                lost.get_or_insert((since, ids.len()));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(issued.is_ok(), "no ids again within 30 s: {:?}", g.status());
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "not increasing");
    // The new generator's ids are stamped more than a lease after the loss.
    let (lost, before) = lost.unwrap();
    let lost = Layout::default().millis_at(lost.to_system_time()).unwrap();
    let first_after = Layout::default().decode(ids[before]).millis;
    assert!(first_after > lost + 1000, "{first_after} vs {lost}");
    g.release().await.unwrap();
}
