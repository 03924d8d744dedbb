//! Leased worker ids: distinct per live process, given up by a process that lost its lease,
//! kept from reuse during the quarantine, a time floor for the next holder, and no id issued
//! twice when a worker id's record vanishes under its holder.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, Counters, Key, ManualClock, SharedStore, SystemClock};
use idem_id::{ISSUE_WINDOW, IdError, LeasedSnowflake, SnowflakeOptions, WorkerPool};
use idem_store::MemoryStore;
use idem_testkit::Op;
use support::{ManualTime, TestStore, Then, When, delete_record, small_layout, worker_key};

fn store() -> SharedStore {
    Arc::new(MemoryStore::new())
}

/// A pool of the `orders` id space on `store`, with 30 s leases, whose generators read time
/// from `clock`.
fn manual_pool(store: SharedStore, clock: &ManualClock) -> WorkerPool {
    WorkerPool::new(store, Arc::new(clock.clone()), "orders")
        .lease(Duration::from_secs(30))
        .time_source(ManualTime::new(clock))
}

/// Claims all four worker ids of [`small_layout`] in `pool`.
async fn claim_every_worker_id(pool: &WorkerPool) -> Vec<Arc<idem_id::LeasedSnowflake>> {
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(
            pool.claim(small_layout(), SnowflakeOptions::default())
                .await
                .unwrap(),
        );
    }
    held
}

/// Moves the clock past a fresh claim's wait and renews: `g` may issue.
async fn past_the_claims_wait(clock: &ManualClock, g: &LeasedSnowflake) {
    clock.advance(ISSUE_WINDOW + Duration::from_millis(1));
    g.heartbeat().await.unwrap();
}

/// The first id of a fresh claim on the system clock, renewing every `beat` until the claim's
/// wait is over (at most 30 s).
async fn first_id(g: &LeasedSnowflake, beat: Duration) -> u64 {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match g.try_next() {
                Ok(id) => return id,
                Err(IdError::Starting { .. } | IdError::LeaseExpired) => {
                    tokio::time::sleep(beat).await;
                    g.heartbeat().await.unwrap();
                }
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await;
    waited.expect("no id within 30 s")
}

/// The `orders` id space's time floor counter.
fn time_floor() -> Key {
    Key::parse("idem.ids", "snowflake.orders", "time-fence").unwrap()
}

#[tokio::test]
async fn live_processes_never_share_a_worker_id() {
    let store = store();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // Four "processes" with pools of their own on one store.
    let mut workers = HashSet::new();
    let mut held = Vec::new();
    for _ in 0..4 {
        let pool = WorkerPool::new(store.clone(), clock.clone(), "orders");
        let g = pool
            .claim(small_layout(), SnowflakeOptions::default())
            .await
            .unwrap();
        assert!(
            workers.insert(g.worker()),
            "worker {} given twice",
            g.worker()
        );
        held.push(g);
    }
    let pool = WorkerPool::new(store.clone(), clock.clone(), "orders");
    let e = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e, IdError::NoWorkerFree);
    // Another name is another id space.
    let other = WorkerPool::new(store, clock, "payments");
    assert!(
        other
            .claim(small_layout(), SnowflakeOptions::default())
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn a_process_past_its_lease_stops_issuing_and_a_stale_renewal_stops_it_for_good() {
    let store = store();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let lease = Duration::from_millis(300);
    let pool = WorkerPool::new(store.clone(), clock.clone(), "orders").lease(lease);
    let a = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    first_id(&a, lease / 3).await;
    // A pauses past its lease without renewing: it refuses by itself.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(a.try_next(), Err(IdError::LeaseExpired));
    // Others take every worker id, A's included.
    let others = claim_every_worker_id(&pool).await;
    assert!(others.iter().any(|g| g.worker() == a.worker()));
    // A's renewal finds its lease taken: lost for good.
    assert_eq!(a.heartbeat().await, Err(IdError::WorkerLost));
    assert_eq!(a.try_next(), Err(IdError::WorkerLost));
    // A holder that renews in time keeps issuing.
    let b = &others[0];
    first_id(b, lease / 3).await;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.heartbeat().await.unwrap();
    }
    assert!(b.try_next().is_ok());
}

#[tokio::test]
async fn a_released_worker_id_waits_out_its_quarantine_and_sets_the_next_holders_floor() {
    let store = store();
    let clock = ManualClock::starting_now();
    let shared: Arc<dyn Clock> = Arc::new(clock.clone());
    let time = ManualTime::new(&clock);
    let pool = WorkerPool::new(store.clone(), shared, "orders")
        .lease(Duration::from_secs(30))
        .quarantine(Duration::from_secs(60))
        .time_source(time);
    let a = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    past_the_claims_wait(&clock, &a).await;
    let last_of_a = a.try_next().unwrap();
    let a_lease_end = a.lease().expires_at;
    a.release().await.unwrap();
    assert_eq!(a.try_next(), Err(IdError::WorkerLost));

    // During the quarantine nobody gets A's worker id: the other three, then none.
    let mut during = Vec::new();
    for _ in 0..3 {
        during.push(
            pool.claim(small_layout(), SnowflakeOptions::default())
                .await
                .unwrap(),
        );
    }
    assert!(during.iter().all(|g| g.worker() != a.worker()));
    assert_eq!(
        pool.claim(small_layout(), SnowflakeOptions::default())
            .await
            .unwrap_err(),
        IdError::NoWorkerFree
    );

    // After it (the others renewing meanwhile), the next holder of A's worker id issues ids
    // above all of A's: it could claim only once its clock was past everything A recorded.
    for step in [25, 25, 11] {
        clock.advance(Duration::from_secs(step));
        for g in &during {
            g.heartbeat().await.unwrap();
        }
    }
    let next = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    assert_eq!(next.worker(), a.worker());
    past_the_claims_wait(&clock, &next).await;
    let first = next.try_next().unwrap();
    let l = small_layout();
    assert!(
        first > last_of_a,
        "{:?} vs {:?}",
        l.decode(first),
        l.decode(last_of_a)
    );
    let time_floor = small_layout()
        .millis_at(a_lease_end.to_system_time())
        .unwrap();
    assert!(small_layout().decode(first).millis >= time_floor);
}

/// A process restarted while the wall clock is an hour behind still issues ids above every id
/// issued before (the id space's time floor), under another worker id (the old one still looks
/// held by the rolled-back clock).
#[tokio::test]
async fn a_restart_after_a_clock_rollback_issues_above_everything_before() {
    let store = store();
    let before_clock = ManualClock::starting_now();
    let pool = |clock: &ManualClock| {
        let shared: Arc<dyn Clock> = Arc::new(clock.clone());
        let time = ManualTime::new(clock);
        WorkerPool::new(store.clone(), shared, "orders").time_source(time)
    };
    let a = pool(&before_clock)
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    past_the_claims_wait(&before_clock, &a).await;
    let issued: Vec<u64> = (0..1000).map(|_| a.try_next().unwrap()).collect();
    a.release().await.unwrap();

    let hour_back = before_clock.now().as_millis() - 3_600_000;
    let rolled_back = ManualClock::new(idem_core::Timestamp::from_millis(hour_back));
    let b = pool(&rolled_back)
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    assert_ne!(b.worker(), a.worker());
    past_the_claims_wait(&rolled_back, &b).await;
    let first = b.try_next().unwrap();
    assert!(issued.iter().all(|id| *id < first));
}

/// A holder whose generator runs ahead of the clock (the id space's time floor is an hour
/// ahead, as after the clock was stepped back) issues ids past the end of its window by the
/// clock; when it dies, the next holder of its worker id starts after every one of them.
#[tokio::test]
async fn the_next_holder_of_a_worker_id_starts_after_a_holder_that_ran_ahead() {
    let store = store();
    let clock = ManualClock::starting_now();
    let pool = manual_pool(store.clone(), &clock);
    store
        .raise(&time_floor(), clock.now().as_millis() + 3_600_000)
        .await
        .unwrap();
    let a = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    past_the_claims_wait(&clock, &a).await;
    let mut issued = vec![a.try_next().unwrap()];
    clock.advance(Duration::from_secs(1));
    a.heartbeat().await.unwrap();
    // Near the end of the renewal's window, an hour ahead: issued, but no floor records it.
    clock.advance(ISSUE_WINDOW - Duration::from_millis(1));
    issued.push(a.try_next().unwrap());
    let worker = a.worker();
    // A dies without a word; its lease runs out.
    std::mem::forget(a);
    clock.advance(Duration::from_secs(31));
    let others = claim_every_worker_id(&pool).await;
    let b = others.iter().find(|g| g.worker() == worker).unwrap();
    past_the_claims_wait(&clock, b).await;
    let first = b.try_next().unwrap();
    assert!(
        issued.iter().all(|id| *id < first),
        "{issued:?} against {first}"
    );
}

/// A heartbeat writes the time floor only when ids were issued since the last write.
#[tokio::test]
async fn an_idle_heartbeat_leaves_the_time_floor_alone() {
    let store = store();
    let clock = ManualClock::starting_now();
    let pool = manual_pool(store.clone(), &clock);
    let g = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    past_the_claims_wait(&clock, &g).await;
    clock.advance(Duration::from_secs(1));
    g.heartbeat().await.unwrap();
    // Nothing issued: nothing written.
    assert_eq!(store.raise(&time_floor(), 0).await.unwrap(), 0);
    // Once ids are issued, the next beat writes their time.
    let id = g.try_next().unwrap();
    g.heartbeat().await.unwrap();
    let written = store.raise(&time_floor(), 0).await.unwrap();
    assert_eq!(
        written,
        small_layout().decode(id).millis + small_layout().epoch_ms()
    );
}

/// A claim dropped after the store granted it a worker id (its caller went away while it
/// recorded the time floor) gives the worker id back at once, rather than leaving it held by
/// nobody until its lease runs out; and gives it back cut to end now, so the next holder's ids
/// do not start a lease ahead of the clock.
#[tokio::test]
async fn a_claim_dropped_after_its_worker_id_was_granted_gives_it_back() {
    let store = TestStore::new();
    let clock = ManualClock::starting_now();
    let pool = manual_pool(store.clone(), &clock);
    // Ids were issued in this space before: once granted, a claim records the time floor
    // (stored under its older name, `time-fence`).
    store
        .raise(&time_floor(), clock.now().as_millis())
        .await
        .unwrap();
    // The claim's second raise (the time floor, after the grant) is held; its caller goes away.
    let raise = store.stall(Op::Raise, 1, When::Before);
    let given_back = store.stall(Op::Renew, 0, When::After);
    let claim = tokio::spawn({
        let pool = pool.clone();
        async move {
            pool.claim(small_layout(), SnowflakeOptions::default())
                .await
        }
    });
    raise.reached().await;
    claim.abort();
    assert!(claim.await.unwrap_err().is_cancelled());
    given_back.reached().await;
    given_back.end(Then::Answer);

    // A millisecond on, with no lease run out, every worker id can be claimed, and none of
    // the new holders starts ahead of the clock once its claim's wait is over.
    clock.advance(Duration::from_millis(1));
    let held = claim_every_worker_id(&pool).await;
    clock.advance(ISSUE_WINDOW + Duration::from_millis(1));
    let now = small_layout()
        .millis_at(clock.now().to_system_time())
        .unwrap();
    for g in held {
        g.heartbeat().await.unwrap();
        let first = small_layout().decode(g.try_next().unwrap());
        assert!(first.millis <= now + 1, "{} ms ahead", first.millis - now);
    }
}

/// A worker id's record deleted under its live holder (by hand here; a Redis that keeps nothing
/// restarting, or a failover that lost the last writes, does the same): another process
/// claims the worker id at once, while the holder goes on until its next renewal tells it.
/// Both issue and renew as they would, and no id is issued twice: the holder stamps nothing
/// past the window of its last confirmed renewal, the claimer nothing before its wait is over.
#[tokio::test]
async fn a_worker_record_deleted_under_its_holder_never_lets_an_id_be_issued_twice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ids.db");
    let store: SharedStore = Arc::new(idem_store::SqliteStore::open(&path).unwrap());
    let clock = ManualClock::starting_now();
    let pool = manual_pool(store, &clock);
    // Every other worker id is held, so the claimer can only get A's.
    let mut held = claim_every_worker_id(&pool).await;
    let a = held.remove(0);
    past_the_claims_wait(&clock, &a).await;
    let mut a_ids: Vec<u64> = (0..100).map(|_| a.try_next().unwrap()).collect();

    let deleted = rusqlite::Connection::open(&path)
        .unwrap()
        .execute(
            "DELETE FROM idem_records WHERE namespace = 'snowflake.orders' AND client_key = ?1",
            [format!("worker-{}", a.worker())],
        )
        .unwrap();
    assert_eq!(deleted, 1);
    let b = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    assert_eq!(b.worker(), a.worker());

    // Five seconds in steps of 100 ms, each renewing once a second.
    let mut b_ids = Vec::new();
    for step in 1..=50 {
        for _ in 0..100 {
            a_ids.extend(a.try_next());
            b_ids.extend(b.try_next());
        }
        clock.advance(Duration::from_millis(100));
        if step % 10 == 0 {
            let _ = a.heartbeat().await;
            b.heartbeat().await.unwrap();
        }
    }
    assert_eq!(a.try_next(), Err(IdError::WorkerLost));
    assert!(a_ids.len() > 100, "A issued nothing after the deletion");
    assert!(!b_ids.is_empty(), "B never issued");
    let a_set: HashSet<u64> = a_ids.iter().copied().collect();
    let twice: Vec<u64> = b_ids.into_iter().filter(|id| a_set.contains(id)).collect();
    assert!(twice.is_empty(), "{} ids issued twice", twice.len());
}

/// Every store the pool runs on: memory, SQLite, and the PostgreSQL, MariaDB and Redis on
/// loopback (each skipped with a note when it is not there, a failure under `CI=true`).
async fn every_store() -> Vec<(SharedStore, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = idem_store::SqliteStore::open(dir.path().join("ids.db")).unwrap();
    let mut stores: Vec<(SharedStore, Option<tempfile::TempDir>)> =
        vec![(store(), None), (Arc::new(sqlite), Some(dir))];
    let table = || idem_store::SqlOptions {
        table: "idem_test_ids".into(),
        ..idem_store::SqlOptions::default()
    };
    if let Some(url) = idem_testkit::services::POSTGRES.url() {
        let pg = idem_store::PostgresStore::connect_with(&url, table());
        stores.push((Arc::new(pg.await.unwrap()), None));
    }
    if let Some(url) = idem_testkit::services::MYSQL.url() {
        let maria = idem_store::MySqlStore::connect_with(&url, table());
        stores.push((Arc::new(maria.await.unwrap()), None));
    }
    if let Some(url) = idem_testkit::services::REDIS.url() {
        let options = idem_store::RedisOptions {
            prefix: "idem-test:".into(),
            ..idem_store::RedisOptions::default()
        };
        let redis = idem_store::RedisStore::connect(&url, options);
        stores.push((Arc::new(redis.await.unwrap()), None));
    }
    stores
}

/// An id space of its own on a store the tests share, with its clock.
struct Space {
    name: String,
    store: SharedStore,
    clock: ManualClock,
    pool: WorkerPool,
}

impl Space {
    fn new(store: SharedStore) -> Self {
        let clock = ManualClock::starting_now();
        let name = format!("reach-{:016x}", rand::random::<u64>());
        let pool = WorkerPool::new(store.clone(), Arc::new(clock.clone()), &name)
            .lease(Duration::from_secs(30))
            .quarantine(Duration::from_secs(60))
            .time_source(ManualTime::new(&clock));
        Self {
            name,
            store,
            clock,
            pool,
        }
    }

    async fn claim(&self) -> Arc<LeasedSnowflake> {
        self.pool
            .claim(small_layout(), SnowflakeOptions::default())
            .await
            .unwrap()
    }

    /// Claims all four worker ids, and waits out the first claims' wait (the store's memory
    /// of a new id space is younger than the window).
    async fn claim_every_worker_id(&self) -> Vec<Arc<LeasedSnowflake>> {
        let held = claim_every_worker_id(&self.pool).await;
        self.clock.advance(ISSUE_WINDOW + Duration::from_millis(1));
        for g in &held {
            g.heartbeat().await.unwrap();
        }
        held
    }

    /// Moves the clock on by `by` in steps of 20 s, `held` renewing at each.
    async fn pass(&self, by: Duration, held: &[Arc<LeasedSnowflake>]) {
        let mut left = by;
        while !left.is_zero() {
            let step = left.min(Duration::from_secs(20));
            self.clock.advance(step);
            left -= step;
            for g in held {
                g.heartbeat().await.unwrap();
            }
        }
    }
}

/// `n` ids from `g`, each at once.
fn take(g: &LeasedSnowflake, n: usize) -> Vec<u64> {
    (0..n).map(|_| g.try_next().unwrap()).collect()
}

/// A worker id nobody ever held issues its first id at once (once the store's memory of the
/// id space is older than the window: the first claims in a new space wait it out, as the
/// store may have just forgotten everything).
#[tokio::test]
async fn a_worker_id_never_held_issues_at_once() {
    for (store, _dir) in every_store().await {
        let space = Space::new(store);
        let a = space.claim().await;
        assert!(matches!(a.try_next(), Err(IdError::Starting { .. })));
        past_the_claims_wait(&space.clock, &a).await;
        let a_ids = take(&a, 100);
        let b = space.claim().await;
        assert_ne!(b.worker(), a.worker());
        let b_ids = take(&b, 100);
        assert!(a_ids.iter().all(|id| !b_ids.contains(id)));
    }
}

/// How a holder gives its worker id up.
#[derive(Debug, Clone, Copy)]
enum Leaving {
    /// It releases it.
    Released,
    /// It stops without a word: no renewal, no release.
    Crashed,
}

/// A holder issues ids and leaves its worker id as `leaving` says; once the worker id is free
/// again (after the quarantine, or once the lease has run out) the next holder of it issues at
/// once, above every id the last one issued: by then the last holder's window (a window after
/// its last renewal) has long closed.
async fn the_next_holder_issues_at_once_above_the_last(leaving: Leaving) {
    for (store, _dir) in every_store().await {
        let space = Space::new(store);
        let mut held = space.claim_every_worker_id().await;
        let a = held.remove(0);
        let a_ids = take(&a, 1000);
        let worker = a.worker();
        let free_after = match leaving {
            Leaving::Released => {
                a.release().await.unwrap();
                Duration::from_secs(61)
            }
            Leaving::Crashed => {
                drop(a);
                Duration::from_secs(31)
            }
        };
        space.pass(free_after, &held).await;
        let next = space.claim().await;
        assert_eq!(next.worker(), worker);
        let first = next.try_next().unwrap();
        assert!(a_ids.iter().all(|id| *id < first), "{leaving:?}");
    }
}

#[tokio::test]
async fn a_worker_id_released_cleanly_issues_at_once_above_its_last_holder() {
    the_next_holder_issues_at_once_above_the_last(Leaving::Released).await;
}

#[tokio::test]
async fn a_worker_id_whose_holder_crashed_issues_at_once_once_its_lease_ran_out() {
    the_next_holder_issues_at_once_above_the_last(Leaving::Crashed).await;
}

/// A holder's record deleted right after it renewed: the next holder of its worker id, a
/// second later, waits until the window that renewal opened has closed (not a whole window
/// from its own claim), while the old holder stamps up to the end of that window; then the old
/// holder refuses by itself and the new one issues, above all of its ids.
#[tokio::test]
async fn a_claim_waits_while_a_holder_whose_record_vanished_may_stamp() {
    for (store, _dir) in every_store().await {
        let space = Space::new(store);
        let mut held = space.claim_every_worker_id().await;
        let a = held.remove(0);
        let mut a_ids = take(&a, 100);
        space.clock.advance(Duration::from_millis(500));
        a.heartbeat().await.unwrap();
        let key = worker_key(&space.name, a.worker());
        assert!(delete_record(&space.store, &key, space.clock.now()).await);
        space.clock.advance(Duration::from_secs(1));
        let b = space.claim().await;
        assert_eq!(b.worker(), a.worker());
        // The last millisecond of A's window.
        space.clock.advance(ISSUE_WINDOW - Duration::from_secs(1));
        a_ids.extend(take(&a, 100));
        assert!(matches!(b.try_next(), Err(IdError::Starting { .. })));
        space.clock.advance(Duration::from_millis(1));
        assert_eq!(a.try_next(), Err(IdError::LeaseExpired));
        let b_ids = take(&b, 100);
        assert!(a_ids.iter().all(|id| *id < b_ids[0]));
    }
}

/// A pool told to trust no record waits a whole window after every claim, for a worker id
/// never held too.
#[tokio::test]
async fn a_pool_that_always_waits_waits_for_a_worker_id_never_held() {
    let clock = ManualClock::starting_now();
    let pool = manual_pool(store(), &clock).always_wait(true);
    let a = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    past_the_claims_wait(&clock, &a).await;
    a.try_next().unwrap();
    let b = pool
        .claim(small_layout(), SnowflakeOptions::default())
        .await
        .unwrap();
    assert!(matches!(b.try_next(), Err(IdError::Starting { .. })));
    clock.advance(ISSUE_WINDOW);
    assert!(matches!(b.try_next(), Err(IdError::Starting { .. })));
    clock.advance(Duration::from_millis(1));
    b.heartbeat().await.unwrap();
    b.try_next().unwrap();
}

/// What happens to the processes sharing an id space, in a [`no_id_is_issued_twice`] run.
#[derive(Debug, Clone)]
enum Event {
    /// A process claims a worker id.
    Claim,
    /// A process (by index among those alive) asks for ids.
    Issue(usize, u8),
    /// Time passes (milliseconds).
    Advance(u32),
    /// A process renews its lease.
    Beat(usize),
    /// A process releases its worker id and stops.
    Release(usize),
    /// A process stops without a word.
    Crash(usize),
    /// A process's worker id record is deleted by hand; the process goes on.
    DeleteRecord(usize),
    /// The store forgets every record and counter (a Redis without persistence restarts).
    ForgetEverything,
}

fn event() -> impl proptest::strategy::Strategy<Value = Event> {
    use proptest::prelude::*;
    let advance = prop_oneof![
        0..3u32,
        990..1010u32,
        2990..3010u32,
        29_990..30_010u32,
        59_990..60_010u32,
    ];
    prop_oneof![
        3 => Just(Event::Claim),
        8 => (any::<usize>(), 1..20u8).prop_map(|(p, n)| Event::Issue(p, n)),
        5 => advance.prop_map(Event::Advance),
        4 => any::<usize>().prop_map(Event::Beat),
        1 => any::<usize>().prop_map(Event::Release),
        1 => any::<usize>().prop_map(Event::Crash),
        1 => any::<usize>().prop_map(Event::DeleteRecord),
        1 => Just(Event::ForgetEverything),
    ]
}

/// Plays `events` on processes sharing one id space of two worker ids, and answers the first
/// id issued twice, if any.
async fn play(events: &[Event]) -> Option<u64> {
    let layout = idem_id::Layout::new(
        41,
        1,
        21,
        std::time::UNIX_EPOCH + Duration::from_millis(idem_id::DEFAULT_EPOCH_MS),
    )
    .unwrap();
    let store = TestStore::new();
    let clock = ManualClock::starting_now();
    let pool = manual_pool(store.clone(), &clock);
    let mut alive: Vec<Arc<LeasedSnowflake>> = Vec::new();
    let mut issued = HashSet::new();
    for event in events {
        let pick = |p: &usize| (!alive.is_empty()).then(|| p % alive.len());
        match event {
            Event::Claim => {
                if let Ok(g) = pool.claim(layout, SnowflakeOptions::default()).await {
                    alive.push(g);
                }
            }
            Event::Issue(p, n) => {
                let Some(i) = pick(p) else { continue };
                for _ in 0..*n {
                    if let Ok(id) = alive[i].try_next()
                        && !issued.insert(id)
                    {
                        return Some(id);
                    }
                }
            }
            Event::Advance(ms) => clock.advance(Duration::from_millis(u64::from(*ms))),
            Event::Beat(p) => {
                if let Some(i) = pick(p) {
                    let _ = alive[i].heartbeat().await;
                }
            }
            Event::Release(p) => {
                if let Some(i) = pick(p) {
                    let _ = alive.swap_remove(i).release().await;
                }
            }
            Event::Crash(p) => {
                if let Some(i) = pick(p) {
                    alive.swap_remove(i);
                }
            }
            Event::DeleteRecord(p) => {
                if let Some(i) = pick(p) {
                    let key = worker_key("orders", alive[i].worker());
                    store.delete_record(&key, clock.now()).await;
                }
            }
            Event::ForgetEverything => store.forget_everything(),
        }
    }
    None
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Processes claim, issue, renew or not, release, crash, lose their records and see the
    /// store forget everything, in any order and at any pace: no id is ever issued twice.
    #[test]
    fn no_id_is_issued_twice(events in proptest::collection::vec(event(), 1..80)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let twice = rt.block_on(play(&events));
        proptest::prop_assert!(twice.is_none(), "id {:?} issued twice", twice);
    }
}
