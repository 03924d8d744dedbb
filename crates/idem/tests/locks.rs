//! Locks on every backend: mutual exclusion under contention, a paused holder fenced out,
//! renewal, release on drop, waiters woken by releases, a Redis restarted while a lock is
//! held, and a holding lost with its ZooKeeper session. Server backends are skipped (with a note) when their server is missing, except under
//! `CI=true`.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem::{LockError, LockOwner, LockStore, Locks, MemoryStore, SqliteStore};
use idem_store::{Fenced, PostgresOptions, PostgresStore, RedisOptions, RedisStore, SqlFences};
use idem_testkit::services::{POSTGRES, REDIS, RedisServer};
use idem_testkit::{Fault, FaultyStore, Op, PATIENCE, Stall, within};

const LONG: Duration = Duration::from_secs(60);

fn unique(prefix: &str) -> String {
    let n: u64 = rand::random();
    format!("{prefix}:{n:016x}")
}

async fn redis() -> Option<RedisStore> {
    let url = REDIS.url()?;
    let options = RedisOptions {
        prefix: "idem-test:".into(),
        ..RedisOptions::default()
    };
    Some(RedisStore::connect(&url, options).await.unwrap())
}

async fn postgres() -> Option<PostgresStore> {
    let url = POSTGRES.url()?;
    let options = PostgresOptions {
        table: "idem_test_locks".into(),
        ..PostgresOptions::default()
    };
    Some(PostgresStore::connect_with(&url, options).await.unwrap())
}

fn sqlite() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (SqliteStore::open(dir.path().join("idem.db")).unwrap(), dir)
}

/// 16 tasks × 200 increments of a counter that is read, yielded on, then written: without the
/// lock, increments are lost.
async fn mutual_exclusion(store: impl LockStore) {
    let locks = Locks::new(store);
    let name = unique("counter");
    let counter = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (locks, name, counter) = (locks.clone(), name.clone(), Arc::clone(&counter));
            tokio::spawn(async move {
                for _ in 0..200 {
                    let guard = locks.acquire(&name, LONG, LONG).await.unwrap();
                    let seen = counter.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    counter.store(seen + 1, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(counter.load(Ordering::SeqCst), 16 * 200);
}

/// A backend shared by hand (`Arc<MemoryStore>`) and one chosen at run time
/// (`SharedLockStore`) are lock backends themselves, and hand out one lock between them.
#[tokio::test]
async fn a_backend_behind_an_arc_is_a_lock_backend() {
    let store = Arc::new(MemoryStore::new());
    let shared: idem::SharedLockStore = store.clone();
    let by_hand = Locks::new(Arc::clone(&store));
    let guard = by_hand
        .try_acquire("arc", Duration::from_secs(10))
        .await
        .unwrap();
    let refused = Locks::new(shared)
        .try_acquire("arc", Duration::from_secs(10))
        .await;
    assert!(
        matches!(refused, Err(LockError::Held { .. })),
        "{refused:?}"
    );
    assert_eq!(LockStore::kind(&store), "memory");
    drop(guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_in_memory() {
    mutual_exclusion(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_on_sqlite() {
    let (store, _dir) = sqlite();
    mutual_exclusion(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_on_redis() {
    if let Some(store) = redis().await {
        mutual_exclusion(store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_on_postgres() {
    if let Some(store) = postgres().await {
        mutual_exclusion(store).await;
    }
}

/// A resource guarded by fences, as the paused-holder test writes to it.
trait Resource: Send + Sync {
    fn write(&self, fence: u64) -> impl Future<Output = Fenced> + Send;
}

struct RedisResource(RedisStore, String);

impl Resource for RedisResource {
    async fn write(&self, fence: u64) -> Fenced {
        self.0
            .fenced_set(&self.1, fence, format!("written by {fence}").as_bytes())
            .await
            .unwrap()
    }
}

struct PgResource(PostgresStore, SqlFences, String);

impl Resource for PgResource {
    async fn write(&self, fence: u64) -> Fenced {
        let mut tx = self.0.pool().begin().await.unwrap();
        let answer = self.1.check_pg(&mut tx, &self.2, fence).await.unwrap();
        // The protected writes would go here, in `tx`.
        if answer.is_accepted() {
            tx.commit().await.unwrap();
        }
        answer
    }
}

struct SqliteResource(std::sync::Mutex<rusqlite::Connection>, SqlFences);

impl Resource for SqliteResource {
    async fn write(&self, fence: u64) -> Fenced {
        let mut conn = self.0.lock().unwrap();
        let tx = conn.transaction().unwrap();
        let answer = self.1.check_sqlite(&tx, "ledger", fence).unwrap();
        if answer.is_accepted() {
            tx.commit().unwrap();
        }
        answer
    }
}

/// A holder whose process stops (its runtime thread blocked, the renewal task with it) past
/// its lease: another owner acquires with a higher fence and writes; when the first resumes,
/// its guard says lost, renewing is refused, and its fenced write is turned away.
///
/// Each side connects on its own runtime (`connect` runs once in each), as two processes
/// would: a connection driven by the stopped runtime would stop with it.
fn a_stopped_holder_is_fenced_out<S, R, F, Fut>(connect: F)
where
    S: LockStore,
    R: Resource + 'static,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = (S, R)>,
{
    let connect = Arc::new(connect);
    let lease = Duration::from_millis(400);
    let name = unique("paused");
    let (acquired_tx, acquired_rx) = std::sync::mpsc::channel();
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
    let holder = {
        let (connect, name) = (Arc::clone(&connect), name.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (store, resource) = connect().await;
                let guard = Locks::new(store)
                    .try_acquire(&name, lease)
                    .await
                    .unwrap()
                    .auto_renew();
                assert_eq!(resource.write(guard.fence()).await, Fenced::Accepted);
                acquired_tx.send(guard.fence()).unwrap();
                // The process stops: nothing on this runtime runs, renewals included.
                resume_rx.recv().unwrap();
                assert!(guard.is_lost(), "a guard past its lease must say so");
                tokio::time::timeout(Duration::from_secs(1), guard.lost())
                    .await
                    .expect("lost() resolves once lost");
                assert!(matches!(guard.renew(lease).await, Err(LockError::Lost)));
                let refused = resource.write(guard.fence()).await;
                assert!(matches!(refused, Fenced::Stale { highest } if highest > guard.fence()));
                assert!(matches!(guard.release().await, Err(LockError::NotOwner)));
            });
        })
    };
    let old_fence = acquired_rx.recv().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (store, resource) = connect().await;
        let locks = Locks::new(store);
        // Taken over once the holder's lease ran out during the stop.
        let guard = locks
            .acquire(&name, LONG, Duration::from_secs(10))
            .await
            .unwrap();
        assert!(guard.fence() > old_fence);
        assert_eq!(resource.write(guard.fence()).await, Fenced::Accepted);
        resume_tx.send(()).unwrap();
        holder.join().unwrap();
        guard.release().await.unwrap();
    });
}

#[test]
fn a_stopped_holder_is_fenced_out_on_redis() {
    let key = unique("idem-test:fenced");
    if REDIS.url().is_none() {
        return;
    }
    a_stopped_holder_is_fenced_out(move || {
        let key = key.clone();
        async move {
            let store = redis().await.unwrap();
            (store.clone(), RedisResource(store, key))
        }
    });
}

#[test]
fn a_stopped_holder_is_fenced_out_on_postgres() {
    if POSTGRES.url().is_none() {
        return;
    }
    let resource = unique("ledger");
    a_stopped_holder_is_fenced_out(move || {
        let resource = resource.clone();
        async move {
            let store = postgres().await.unwrap();
            let fences = SqlFences::new("idem_test_fences").unwrap();
            sqlx::query(sqlx::AssertSqlSafe(fences.create_table_sql()))
                .execute(store.pool())
                .await
                .unwrap();
            (store.clone(), PgResource(store, fences, resource))
        }
    });
}

#[test]
fn a_stopped_holder_is_fenced_out_on_sqlite() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    a_stopped_holder_is_fenced_out(move || {
        let dir = Arc::clone(&dir);
        async move {
            // Two stores on one file, as two processes would open it.
            let store = SqliteStore::open(dir.path().join("idem.db")).unwrap();
            let conn = rusqlite::Connection::open(dir.path().join("shop.db")).unwrap();
            conn.busy_timeout(Duration::from_secs(5)).unwrap();
            let fences = SqlFences::new("fences").unwrap();
            conn.execute(&fences.create_table_sql(), []).unwrap();
            (store, SqliteResource(conn.into(), fences))
        }
    });
}

/// A fence past the exact range (which Redis's Lua numbers would round, so that two fences
/// compare equal) is refused, not rounded: a lower one never passes for a higher.
#[tokio::test]
async fn a_fence_past_the_exact_range_is_refused() {
    let max = idem_store::fenced::MAX_FENCE;
    let conn = rusqlite::Connection::open_in_memory().unwrap();
    let fences = SqlFences::new("fences").unwrap();
    conn.execute(&fences.create_table_sql(), []).unwrap();
    assert!(fences.check_sqlite(&conn, "r", max).unwrap().is_accepted());
    assert!(fences.check_sqlite(&conn, "r", max + 2).is_err());
    let Some(store) = redis().await else { return };
    let key = unique("fenced-range");
    assert_eq!(
        store.fenced_set(&key, max + 2, b"high").await.ok(),
        None,
        "refused"
    );
    assert!(
        store
            .fenced_set(&key, max, b"exact")
            .await
            .unwrap()
            .is_accepted()
    );
    assert!(store.fenced_set(&key, max + 1, b"past").await.is_err());
}

/// Renewal in the background keeps a lock well past its first lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_renew_keeps_the_lock() {
    let locks = Locks::new(MemoryStore::new());
    let lease = Duration::from_millis(200);
    let guard = locks
        .try_acquire("renewed", lease)
        .await
        .unwrap()
        .auto_renew();
    tokio::time::sleep(lease * 4).await;
    assert!(!guard.is_lost());
    assert!(matches!(
        locks.try_acquire("renewed", lease).await,
        Err(LockError::Held { .. })
    ));
    guard.release().await.unwrap();
    locks.try_acquire("renewed", lease).await.unwrap();
}

/// Without renewal, a guard is lost once its lease ends, and stays lost.
#[tokio::test]
async fn a_lease_that_ends_is_lost_for_good() {
    let locks = Locks::new(MemoryStore::new());
    let guard = locks
        .try_acquire("ends", Duration::from_millis(100))
        .await
        .unwrap();
    assert!(!guard.is_lost());
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .unwrap();
    assert!(guard.is_lost());
    assert!(matches!(guard.renew(LONG).await, Err(LockError::Lost)));
    assert!(guard.is_lost());
}

/// A holding in ZooKeeper is lost once the ensemble stops vouching for the store's session
/// (here its server stops answering, SIGSTOP): within the 8 s of its 10 s session that the
/// ensemble surely keeps it, long before its minute's lease would end, and without a renewal
/// to find out, since the ensemble may give the lock to the next owner after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holding_is_lost_with_its_zookeeper_session() {
    let Some(zk) = idem_testkit::coordination::ZooKeeper::start() else {
        return;
    };
    let store = idem_store::ZooKeeperLocks::connect(&zk.hosts(), Default::default())
        .await
        .unwrap();
    let locks = Locks::new(store);
    let guard = locks.try_acquire("session", LONG).await.unwrap();
    assert!(!guard.is_lost());
    zk.pause(0);
    let heard = tokio::time::timeout(Duration::from_secs(11), guard.lost()).await;
    zk.resume(0);
    heard.expect("the guard hears the silence within the 8 s its session is vouched for");
    assert!(guard.is_lost());
}

/// Memory locks whose session has ended already, as a ZooKeeper or etcd store's may have by
/// the time its acquire answers.
struct EndedSession(MemoryStore);

impl LockStore for EndedSession {
    fn kind(&self) -> &'static str {
        "ended-session"
    }
    async fn acquire(
        &self,
        name: &idem::LockName,
        owner: idem_core::OwnerDigest,
        lease: Duration,
    ) -> Result<idem_core::Acquire, idem::StoreError> {
        self.0.acquire(name, owner, lease).await
    }
    async fn renew(
        &self,
        name: &idem::LockName,
        owner: idem_core::OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<idem_core::Held, LockError> {
        self.0.renew(name, owner, fence, lease).await
    }
    async fn release(
        &self,
        name: &idem::LockName,
        owner: idem_core::OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        self.0.release(name, owner, fence).await
    }
    fn listen(&self) -> Option<Box<dyn idem_core::ReleaseListener>> {
        self.0.listen()
    }
    fn session_end(&self) -> Option<idem_core::BoxFuture<'static, ()>> {
        Some(Box::pin(std::future::ready(())))
    }
}

/// A guard whose session ended before the acquire answered is lost as soon as the runtime
/// runs its watcher: here, a one-thread runtime, at the caller's first yield.
#[tokio::test]
async fn a_guard_whose_session_ended_is_lost_at_once() {
    let locks = Locks::new(EndedSession(MemoryStore::new()));
    let guard = locks.try_acquire("ended", LONG).await.unwrap();
    tokio::task::yield_now().await;
    assert!(guard.is_lost());
    tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .expect("lost() answers at once");
}

/// A dropped guard releases its lock: a waiter gets it long before the lease would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_guard_releases_the_lock() {
    let locks = Locks::new(MemoryStore::new());
    let guard = locks.try_acquire("dropped", LONG).await.unwrap();
    drop(guard);
    locks
        .acquire("dropped", LONG, Duration::from_secs(10))
        .await
        .unwrap();
}

/// A waiter is woken by the release itself: its timer alone (a minute) would let it time out.
/// Another waiter that gave up before (its future dropped while it waited) takes nothing with
/// it: the release feed still reaches the next one.
async fn a_release_wakes_the_waiter(store: impl LockStore) {
    let store = FaultyStore::new(store);
    let locks = Locks::new(store.clone()).poll_interval(LONG);
    let name = unique("handoff");
    let guard = locks.try_acquire(&name, LONG).await.unwrap();
    // A waiter, once told the lock is busy, waits for a release.
    let waiter = || {
        let told_busy = Stall::new();
        store.fail_next(Op::LockAcquire, Fault::StallThenLand(told_busy.clone()));
        told_busy.release();
        let (locks, name) = (locks.clone(), name.clone());
        let task = tokio::spawn(async move { locks.acquire(&name, LONG, PATIENCE).await });
        (task, told_busy)
    };
    let (gave_up, told_busy) = waiter();
    within("the first waiter's attempt", told_busy.landed()).await;
    gave_up.abort();
    assert!(gave_up.await.unwrap_err().is_cancelled());
    let (waiting, told_busy) = waiter();
    within("the next waiter's attempt", told_busy.landed()).await;
    guard.release().await.unwrap();
    let next = within("the waiter", waiting)
        .await
        .unwrap()
        .expect("woken by the release");
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_in_memory() {
    a_release_wakes_the_waiter(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_on_sqlite() {
    let (store, _dir) = sqlite();
    a_release_wakes_the_waiter(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_on_redis() {
    if let Some(store) = redis().await {
        a_release_wakes_the_waiter(store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_on_postgres() {
    if let Some(store) = postgres().await {
        a_release_wakes_the_waiter(store).await;
    }
}

/// A bounded wait ends with `Timeout`; a zero wait answers `Held` with the holder's lease end.
#[tokio::test]
async fn waits_are_bounded() {
    let locks = Locks::new(MemoryStore::new());
    let guard = locks.try_acquire("bounded", LONG).await.unwrap();
    match locks.try_acquire("bounded", LONG).await {
        Err(LockError::Held { until }) => assert_eq!(until, guard.expires_at()),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        locks
            .acquire("bounded", LONG, Duration::from_millis(200))
            .await,
        Err(LockError::Timeout)
    ));
    assert!(matches!(
        locks.try_acquire("", LONG).await,
        Err(LockError::Invalid(_))
    ));
}

/// An acquire dropped after the backend granted it (its answer on the way) leaves the lock
/// free: the grant is released for the caller that left, instead of holding the lock for its
/// whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_while_the_backend_grants_it_leaves_the_lock_free() {
    let store = FaultyStore::new(MemoryStore::new());
    let locks = Locks::new(store.clone());
    let granted = Stall::new();
    store.fail_next(Op::LockAcquire, Fault::StallThenLand(granted.clone()));
    let caller = {
        let locks = locks.clone();
        async move { locks.acquire("orphan", LONG, LONG).await }
    };
    granted.abandon(caller).await;
    granted.release();
    within("the grant", granted.landed()).await;
    let next = locks.acquire("orphan", LONG, PATIENCE).await.unwrap();
    next.release().await.unwrap();
}

/// Already so: an acquire for an owner id the caller keeps, dropped after the backend granted
/// it, leaves the holding to that id (its keeper gets it back by asking again), since the same
/// id may have held the lock before the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_as_dropped_leaves_the_holding_to_its_owner() {
    let store = FaultyStore::new(MemoryStore::new());
    let locks = Locks::new(store.clone());
    let owner = LockOwner::random();
    let granted = Stall::new();
    store.fail_next(Op::LockAcquire, Fault::StallThenLand(granted.clone()));
    let caller = {
        let (locks, owner) = (locks.clone(), owner.clone());
        async move { locks.acquire_as("kept", owner, LONG, LONG).await }
    };
    granted.abandon(caller).await;
    granted.release();
    within("the grant", granted.landed()).await;
    assert!(matches!(
        locks.try_acquire("kept", LONG).await,
        Err(LockError::Held { .. })
    ));
    let again = locks
        .acquire_as("kept", owner, LONG, Duration::ZERO)
        .await
        .unwrap();
    again.release().await.unwrap();
    locks.try_acquire("kept", LONG).await.unwrap();
}

/// A guard's release dropped before the backend answered (here: before it reached it) still
/// releases the lock, as dropping the guard does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_dropped_midway_still_releases_the_lock() {
    let store = FaultyStore::new(MemoryStore::new());
    let locks = Locks::new(store.clone());
    let guard = locks.try_acquire("midway", LONG).await.unwrap();
    let stall = store.stall_next(Op::LockRelease);
    stall.abandon(guard.release()).await;
    stall.release();
    let next = locks.acquire("midway", LONG, PATIENCE).await.unwrap();
    next.release().await.unwrap();
}

/// Redis restarted (losing everything: no persistence) while a lock is held: the next holder
/// still gets a higher fence, and the old holder's renewal is refused, so it learns it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_keeps_fences_rising_and_makes_the_holder_lost() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let options = RedisOptions {
        response_timeout: Duration::from_secs(1),
        ..RedisOptions::default()
    };
    let store = RedisStore::connect(&server.url(), options).await.unwrap();
    let locks = Locks::new(store);
    let lease = Duration::from_millis(900);
    let old = locks
        .try_acquire("restart", lease)
        .await
        .unwrap()
        .auto_renew();
    server.restart();
    let new = locks
        .acquire("restart", LONG, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(new.fence() > old.fence());
    tokio::time::timeout(Duration::from_secs(10), old.lost())
        .await
        .expect("the old holder learns it lost the lock");
    assert!(matches!(old.release().await, Err(LockError::NotOwner)));
    new.release().await.unwrap();
}
