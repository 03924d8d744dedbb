//! A Snowflake generator that keeps its worker id: it replaces one the store forgot at once,
//! issuing only once no earlier holder can still be issuing, and above every id it issued; it
//! says what it is doing meanwhile; and it stops for good when released.
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
    DEFAULT_EPOCH_MS, ISSUE_WINDOW, IdError, Layout, ManagedSnowflake, SnowflakeOptions,
    WorkerPool, WorkerStatus,
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

/// Moves the clock past a fresh claim's wait, and lets the keeper renew.
async fn past_the_claims_wait(clock: &ManualClock) {
    clock.advance(ISSUE_WINDOW + Duration::from_millis(1));
    let_it_run().await;
}

/// The store forgets everything (a Redis restarted empty) under two processes: A keeps its ids
/// with a `ManagedSnowflake`, B is a plain leased generator that cannot reach the store and so
/// goes on issuing until the window of its last renewal ends. A says it lost its worker id,
/// claims a new one at once, issues nothing while B may still issue, then issues ids above all
/// of its own and stamped after B's last possible one, whichever worker id it gets.
#[tokio::test(start_paused = true)]
async fn a_worker_id_the_store_forgot_is_replaced_once_no_earlier_holder_can_issue() {
    let clock = ManualClock::starting_now();
    let store = TestStore::new();
    let a = start(store.clone(), &clock).await;
    let WorkerStatus::Starting {
        worker: first,
        since,
        ready_at,
    } = a.status()
    else {
        panic!("{:?}", a.status());
    };
    assert_eq!(a.worker(), Some(first));
    assert!(ready_at > since.saturating_add(ISSUE_WINDOW));
    assert!(matches!(a.try_next(), Err(IdError::Starting { .. })));
    let b_view = TestStore::over(store.clone());
    let b = pool(b_view.clone(), &clock)
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    past_the_claims_wait(&clock).await;
    assert!(a.status().is_issuing(), "{:?}", a.status());
    b.heartbeat().await.unwrap();
    let mut a_ids: Vec<u64> = (0..1000).map(|_| a.try_next().unwrap()).collect();
    let mut b_ids: Vec<u64> = (0..1000).map(|_| b.try_next().unwrap()).collect();
    // B's last renewal: it may issue until ISSUE_WINDOW after it.
    b.heartbeat().await.unwrap();
    let b_window_end = small_layout()
        .millis_at(clock.now().saturating_add(ISSUE_WINDOW).to_system_time())
        .unwrap();
    let lost_at = clock.now();
    store.forget_everything();
    b_view.set_down(true);

    eventually("A claims again", || {
        matches!(a.status(), WorkerStatus::Starting { .. })
    })
    .await;
    let WorkerStatus::Starting {
        since, ready_at, ..
    } = a.status()
    else {
        panic!("{:?}", a.status());
    };
    assert_eq!(since, lost_at);
    assert!(ready_at > lost_at.saturating_add(ISSUE_WINDOW));
    assert!(
        matches!(a.try_next(), Err(IdError::Starting { .. })),
        "{:?}",
        a.try_next()
    );

    // Just before B's window ends, B still issues and A still waits.
    clock.advance(ISSUE_WINDOW - Duration::from_millis(1));
    b_ids.extend((0..1000).map(|_| b.try_next().unwrap()));
    assert!(matches!(a.try_next(), Err(IdError::Starting { .. })));

    // Past it, B refuses by itself, and A issues.
    clock.advance(Duration::from_millis(2));
    assert_eq!(b.try_next(), Err(IdError::LeaseExpired));
    let_it_run().await;
    eventually("A issues again", || a.status().is_issuing()).await;
    let resumed: Vec<u64> = (0..1000).map(|_| a.try_next().unwrap()).collect();
    assert!(resumed[0] > *a_ids.last().unwrap());
    assert!(small_layout().decode(resumed[0]).millis > b_window_end);
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

/// A store that cannot be reached past the window of the last renewal: the status says the
/// lease ran out (and when, and why), ids are refused; once the store answers again the same
/// worker id goes on.
#[tokio::test(start_paused = true)]
async fn a_lease_that_ran_out_unrenewed_is_reported_and_resumes_when_renewed() {
    let clock = ManualClock::starting_now();
    let store = TestStore::new();
    let g = start(store.clone(), &clock).await;
    let worker = g.worker().unwrap();
    past_the_claims_wait(&clock).await;
    g.try_next().unwrap();
    // The window of the last renewal.
    let window_end = clock.now().saturating_add(ISSUE_WINDOW);

    store.set_down(true);
    clock.advance(ISSUE_WINDOW + Duration::from_secs(1));
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
    assert_eq!(since, window_end);
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
    eventually("a worker id is claimed", || g.worker().is_some()).await;
    assert_eq!(g.worker(), Some(gone));
    past_the_claims_wait(&clock).await;
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
    past_the_claims_wait(&clock).await;
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
    eventually("the first ids", || g.status().is_issuing()).await;
    let mut ids = vec![g.try_next().unwrap()];
    server.restart();

    // Ids until it has been without a worker id and is back, and a while after. `lost`: when
    // it lost its worker id (or claimed the next), and how many ids came before (all later
    // ones are the new generator's: the old one was marked lost before the status said so).
    let mut lost = None;
    let issued = tokio::time::timeout(Duration::from_secs(30), async {
        while lost.is_none_or(|(_, before)| ids.len() < before + 100) {
            match g.try_next() {
                Ok(id) => ids.push(id),
                Err(
                    IdError::LeaseExpired | IdError::NoWorker { .. } | IdError::Starting { .. },
                ) => {}
                Err(e) => panic!("{e}"),
            }
            if let WorkerStatus::Claiming { since, .. } | WorkerStatus::Starting { since, .. } =
                g.status()
            {
                lost.get_or_insert((since, ids.len()));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(issued.is_ok(), "no ids again within 30 s: {:?}", g.status());
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "not increasing");
    // The new generator's ids are stamped at least ISSUE_WINDOW after the claim it reports
    // (`lost` is that claim's time). The earlier holder stamps no id past its last renewal's
    // send time plus the window, and that renewal was sent before Redis lost the worker id,
    // so before the claim: an id at exactly the claim plus the window is above all of them,
    // and the generator issues from that millisecond on.
    let (lost, before) = lost.unwrap();
    let lost = Layout::default().millis_at(lost.to_system_time()).unwrap();
    let first_after = Layout::default().decode(ids[before]).millis;
    assert!(first_after >= lost + 3000, "{first_after} vs {lost}");
    g.release().await.unwrap();
}
