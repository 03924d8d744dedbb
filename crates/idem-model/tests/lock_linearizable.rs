//! The lock operations of the real lock backends are linearizable: several threads acquire,
//! renew and release one lock (or two) at once, every call's invocation and answer goes into a
//! history, and stateright's [`LinearizabilityTester`] finds for each history an order of the
//! calls, one at a time, in which [`LockSpec`] gives every answer the backend gave: one holder
//! at a time, the holder's repeated acquire keeping its fence, every new holding fenced above
//! all before it, renewals and releases the holder's alone (stale ones from earlier holdings,
//! and forged fences, are in every round).
//!
//! Leases are a minute long and never run out within a round: backends decide expiry by their
//! own clock, which a history does not hold (the lock conformance suite and the fault harness
//! cover leases that end).
//!
//! Memory and SQLite always run; PostgreSQL and Redis on the servers of
//! `IDEM_TEST_POSTGRES_URL` and `IDEM_TEST_REDIS_URL`, ZooKeeper and etcd (feature `etcd`) on
//! a server the test starts (each skipped with a note when missing, a failure under
//! `CI=true`).
//! `IDEM_LINEARIZABLE_ROUNDS` sets the rounds per backend (default 150).
//!
//! The check can fail: a backend that answers `Acquired` to a second owner while the first
//! holds is rejected (`a_lock_granted_twice_is_not_linearizable`).

#![allow(clippy::unwrap_used)]
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{
    Acquire, DynLockStore, LockError, LockName, LockOwner, OwnerDigest, SharedLockStore,
};
use idem_model::lock_spec::{LockOp, LockRet, LockSpec};
use idem_store::{PostgresOptions, PostgresStore, RedisOptions, RedisStore, SqliteStore};
use idem_testkit::services::{POSTGRES, REDIS};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

/// Threads calling at once in each round, each with two owners of its own.
const THREADS: usize = 3;
/// Calls each thread makes in a round.
const CALLS: usize = 6;
/// Never runs out within a round.
const LEASE: Duration = Duration::from_secs(60);

/// A small generator (xorshift), seeded by round and thread.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One round's names and owners, as the backend sees them.
struct Cast {
    names: Vec<LockName>,
    owners: Vec<OwnerDigest>,
}

/// The answer of `op` from `store`, or its failure (the call's effect is then unknown).
async fn call(store: &dyn DynLockStore, cast: &Cast, op: &LockOp) -> Result<LockRet, String> {
    let (name, owner) = match *op {
        LockOp::Acquire { name, owner }
        | LockOp::Renew { name, owner, .. }
        | LockOp::Release { name, owner, .. } => (
            &cast.names[usize::from(name)],
            cast.owners[usize::from(owner)],
        ),
    };
    let settled = |r: Result<(), LockError>| match r {
        Ok(()) => Ok(LockRet::Ok),
        Err(LockError::NotOwner) => Ok(LockRet::NotOwner),
        Err(e) => Err(e.to_string()),
    };
    match *op {
        LockOp::Acquire { .. } => match store.acquire(name, owner, LEASE).await {
            Ok(Acquire::Acquired(held)) => Ok(LockRet::Acquired(held.fence)),
            Ok(Acquire::Busy { .. }) => Ok(LockRet::Busy),
            Err(e) => Err(e.to_string()),
        },
        LockOp::Renew { fence, .. } => {
            settled(store.renew(name, owner, fence, LEASE).await.map(drop))
        }
        LockOp::Release { fence, .. } => settled(store.release(name, owner, fence).await),
    }
}

#[derive(Debug, Default)]
struct Figures {
    rounds: u64,
    calls: u64,
    failed: u64,
    acquired: u64,
    busy: u64,
    refused: u64,
    violations: u64,
}

struct Shared {
    tester: LinearizabilityTester<usize, LockSpec>,
    log: Vec<String>,
    /// Holdings answered so far: (name, owner, fence).
    holdings: Vec<(u8, u8, u64)>,
    figures: Figures,
}

async fn thread(
    store: SharedLockStore,
    cast: Arc<Cast>,
    shared: Arc<Mutex<Shared>>,
    t: usize,
    names: u8,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let first = u8::try_from(2 * t).unwrap();
    let own = [first, first + 1];
    for _ in 0..CALLS {
        let op = {
            let s = shared.lock().unwrap();
            let name = u8::try_from(rng.below(u64::from(names))).unwrap();
            let owner = own[usize::try_from(rng.below(2)).unwrap()];
            let known: Vec<_> = s.holdings.iter().filter(|h| h.0 == name).collect();
            match rng.below(10) {
                0..=4 => LockOp::Acquire { name, owner },
                _ if known.is_empty() => LockOp::Acquire { name, owner },
                k => {
                    // Mostly a holding of its own owners; now and then anyone's, or a forged
                    // fence.
                    let mine: Vec<_> = known.iter().filter(|h| own.contains(&h.1)).collect();
                    let mine: Vec<(u8, u8, u64)> = mine.into_iter().map(|h| **h).collect();
                    let known: Vec<(u8, u8, u64)> = known.into_iter().copied().collect();
                    let pool = if !mine.is_empty() && rng.chance(70) {
                        &mine
                    } else {
                        &known
                    };
                    let (_, who, fence) =
                        pool[usize::try_from(rng.below(pool.len() as u64)).unwrap()];
                    let fence = if rng.chance(10) { fence + 1 } else { fence };
                    if k <= 7 {
                        LockOp::Renew {
                            name,
                            owner: who,
                            fence,
                        }
                    } else {
                        LockOp::Release {
                            name,
                            owner: who,
                            fence,
                        }
                    }
                }
            }
        };
        {
            let mut s = shared.lock().unwrap();
            s.tester.on_invoke(t, op.clone()).unwrap();
            s.log.push(format!("t{t} calls   {op:?}"));
        }
        let answer = call(&*store, &cast, &op).await;
        let mut s = shared.lock().unwrap();
        let ret = match answer {
            Ok(ret) => ret,
            Err(e) => {
                s.log.push(format!("t{t} failed  {e}"));
                s.figures.failed += 1;
                return;
            }
        };
        s.log.push(format!("t{t} answers {ret:?}"));
        s.figures.calls += 1;
        match (&op, &ret) {
            (LockOp::Acquire { name, owner }, LockRet::Acquired(fence)) => {
                s.figures.acquired += 1;
                s.holdings.push((*name, *owner, *fence));
            }
            (_, LockRet::Busy) => s.figures.busy += 1,
            (_, LockRet::NotOwner) => s.figures.refused += 1,
            _ => {}
        }
        s.tester.on_return(t, ret).unwrap();
    }
}

/// Runs the rounds on `store` and answers the figures; a history that is not linearizable is
/// printed, and counted.
async fn run(store: SharedLockStore, what: &str, rounds: u64) -> Figures {
    let run = Instant::now().elapsed().as_nanos() ^ u128::from(rand_seed());
    let mut figures = Figures::default();
    for round in 0..rounds {
        let names = 1 + u8::from(round % 3 == 2);
        let cast = Arc::new(Cast {
            names: (0..names)
                .map(|n| {
                    LockName::new(&format!("linearizable:{what}:{run:x}:{round}:{n}")).unwrap()
                })
                .collect(),
            owners: (0..2 * THREADS)
                .map(|_| LockOwner::random().digest())
                .collect(),
        });
        let shared = Arc::new(Mutex::new(Shared {
            tester: LinearizabilityTester::new(LockSpec::new()),
            log: Vec::new(),
            holdings: Vec::new(),
            figures: Figures::default(),
        }));
        let ready = Arc::new(std::sync::Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let seed = round * 1_000 + t as u64 + 1;
                let calls = thread(store.clone(), cast.clone(), shared.clone(), t, names, seed);
                let (ready, runtime) = (ready.clone(), tokio::runtime::Handle::current());
                tokio::task::spawn_blocking(move || {
                    ready.wait();
                    runtime.block_on(calls);
                })
            })
            .collect();
        for t in threads {
            t.await.unwrap();
        }
        let s = Arc::into_inner(shared).unwrap().into_inner().unwrap();
        let f = s.figures;
        figures.rounds += 1;
        figures.calls += f.calls;
        figures.failed += f.failed;
        figures.acquired += f.acquired;
        figures.busy += f.busy;
        figures.refused += f.refused;
        if s.tester.serialized_history().is_none() {
            if figures.violations == 0 {
                eprintln!(
                    "{what}: round {round}: no order of the calls gives every answer a lock \
                     must:\n{}",
                    s.log.join("\n")
                );
            }
            figures.violations += 1;
        }
    }
    figures
}

fn rand_seed() -> u64 {
    u64::from(std::process::id()) << 20
        ^ u64::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos(),
        )
}

fn rounds() -> u64 {
    std::env::var("IDEM_LINEARIZABLE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150)
}

async fn check(store: SharedLockStore, kind: &str) {
    let began = Instant::now();
    let f = run(store, kind, rounds()).await;
    println!("{kind}: {f:?} in {:.1?}", began.elapsed());
    assert_eq!(f.violations, 0, "{kind}: not linearizable: {f:?}");
    // The rounds did what they are for: locks were taken, refused while held, and stale or
    // forged renewals and releases refused.
    assert!(f.acquired > 0 && f.busy > 0 && f.refused > 0, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_locks_are_linearizable() {
    check(Arc::new(idem_store::MemoryStore::new()), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_locks_are_linearizable() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.db")).unwrap();
    check(Arc::new(store), "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_locks_are_linearizable() {
    let Some(url) = POSTGRES.url() else { return };
    let options = PostgresOptions {
        table: "idem_test_lock_linearizable".into(),
        ..PostgresOptions::default()
    };
    let store = PostgresStore::connect_with(&url, options).await.unwrap();
    check(Arc::new(store), "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_locks_are_linearizable() {
    let Some(url) = REDIS.url() else { return };
    let prefix = "idem_test_lock_linearizable:".to_owned();
    let options = RedisOptions {
        prefix: prefix.clone(),
        ..RedisOptions::default()
    };
    check(
        Arc::new(RedisStore::connect(&url, options).await.unwrap()),
        "redis",
    )
    .await;
    idem_testkit::services::forget_redis_keys(&url, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zookeeper_locks_are_linearizable() {
    let Some(zk) = tokio::task::spawn_blocking(idem_testkit::coordination::ZooKeeper::start)
        .await
        .unwrap()
    else {
        return;
    };
    let locks = idem_store::open_locks(&zk.url("/linearizable"))
        .await
        .unwrap();
    check(locks, "zookeeper").await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_locks_are_linearizable() {
    let Some(etcd) = tokio::task::spawn_blocking(idem_testkit::coordination::Etcd::start)
        .await
        .unwrap()
    else {
        return;
    };
    let locks = idem_store::open_locks(&etcd.url("/linearizable"))
        .await
        .unwrap();
    check(locks, "etcd").await;
}

/// The check can fail: a backend that grants a held lock to a second owner, at a higher
/// fence, gives histories the tester rejects.
#[test]
fn a_lock_granted_twice_is_not_linearizable() {
    let mut tester = LinearizabilityTester::new(LockSpec::new());
    tester
        .on_invoke(0, LockOp::Acquire { name: 0, owner: 0 })
        .unwrap()
        .on_return(0, LockRet::Acquired(10))
        .unwrap()
        .on_invoke(1, LockOp::Acquire { name: 0, owner: 1 })
        .unwrap()
        .on_return(1, LockRet::Acquired(11))
        .unwrap();
    assert!(!tester.is_consistent());
    // The same history with the second owner told it is held is fine.
    let mut tester = LinearizabilityTester::new(LockSpec::new());
    tester
        .on_invoke(0, LockOp::Acquire { name: 0, owner: 0 })
        .unwrap()
        .on_return(0, LockRet::Acquired(10))
        .unwrap()
        .on_invoke(1, LockOp::Acquire { name: 0, owner: 1 })
        .unwrap()
        .on_return(1, LockRet::Busy)
        .unwrap();
    assert!(tester.is_consistent());
}
