//! The record operations of the real stores are linearizable: several threads call `begin`,
//! `complete`, `release`, `renew`, `record_step` and `get` at once on one key (or two), every
//! call's invocation and answer goes into a history, and stateright's
//! [`LinearizabilityTester`] finds for each history an order of the calls, one at a time,
//! in which the real state machine ([`RecordSpec`]) gives every answer the store gave.
//!
//! Many short rounds, each on keys of its own: the tester's search grows exponentially with the
//! calls that overlap, and a few threads of a few calls each already overlap in every way that
//! matters to one record. Each call carries its own `now`, as the store API does: every thread
//! has a clock of its own that starts a little apart from the others and moves on by a few
//! milliseconds (and now and then by more than a lease) before each call, against leases of a
//! few milliseconds and retention either as short or of a minute, so leases run out, are
//! taken over and renewed, and records outlive their retention, within a round. A store never
//! reads a clock to decide, so the answers are a function of the calls alone.
//!
//! The memory and SQLite stores always run; PostgreSQL, MariaDB and Redis run on the servers
//! of `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL` and `IDEM_TEST_REDIS_URL` (skipped with a
//! note when nothing answers there, a failure under `CI=true`). `IDEM_LINEARIZABLE_ROUNDS`
//! sets the rounds per store (default 300); `--nocapture` shows the figures of each run.
//!
//! Every history is also held to the rules of [`oracle`], which need no specification: the
//! specification is idem-core's state machine, which the memory and SQLite stores run too, so a
//! failure says whether the store or idem-core is the one to doubt.
//!
//! The check can fail: a history in which two `begin`s both acquire with one fence is
//! rejected, and so is a store whose `begin` reads and then writes in two steps.

#![allow(clippy::unwrap_used)]
// The figures of each run, and a history that is not linearizable, are printed.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::step::Step;
use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, LeaseError, LeaseId, StepError,
    StepName, Store, Timestamp,
};
use idem_model::linearizable::{Op, RecordSpec, Ret};
use idem_model::oracle::{self, Call};
use idem_store::{
    MySqlOptions, MySqlStore, PostgresOptions, PostgresStore, RedisOptions, RedisStore, SqliteStore,
};
use idem_testkit::services::{MYSQL, POSTGRES, REDIS};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

/// Threads calling the store at once in each round.
const THREADS: usize = 3;
/// Calls each thread makes in a round.
const CALLS: usize = 5;
/// The table and key prefix of the shared servers' runs.
const NAME: &str = "idem_test_linearizable";

/// A small generator (xorshift), seeded by round and thread. A round cannot be replayed from
/// its seed (the threads' timing is the machine's), so a failing round prints its history.
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

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[usize::try_from(self.below(items.len() as u64)).unwrap()]
    }
}

/// What the history records of a call that went to the store: the answer, or the store's
/// failure (the call's effect is then unknown, and it stays in flight).
type Answer = Result<Ret, String>;

/// Something that answers the record operations: a real store, or a planted bug.
trait Target: Send + Sync + 'static {
    fn call(&self, op: &Op) -> impl Future<Output = Answer> + Send;
}

/// A real store, called through the [`Store`] trait.
struct Real<S>(S);

impl<S: Store> Target for Real<S> {
    async fn call(&self, op: &Op) -> Answer {
        let s = &self.0;
        let settled = |r: Result<(), LeaseError>| match r {
            Ok(()) => Ok(Ret::Settled(Ok(()))),
            Err(LeaseError::Stale(e)) => Ok(Ret::Settled(Err(e))),
            Err(e) => Err(e.to_string()),
        };
        match op {
            Op::Begin { req, now } => s.begin(req, *now).await.map(Ret::Begun).map_err(str),
            Op::Complete {
                key,
                lease,
                response,
                now,
            } => settled(s.complete(key, lease, response.clone(), *now).await),
            Op::Release { key, lease, now } => settled(s.release(key, lease, *now).await),
            Op::Renew {
                key,
                lease,
                length,
                now,
            } => match s.renew(key, lease, *length, *now).await {
                Ok(renewed) => Ok(Ret::Renewed(Ok(renewed))),
                Err(LeaseError::Stale(e)) => Ok(Ret::Renewed(Err(e))),
                Err(e) => Err(e.to_string()),
            },
            Op::Step {
                key,
                lease,
                step,
                now,
            } => match s.record_step(key, lease, step, *now).await {
                Ok(()) => Ok(Ret::Stepped(Ok(()))),
                Err(StepError::Refused(e)) => Ok(Ret::Stepped(Err(e))),
                Err(e) => Err(e.to_string()),
            },
            Op::Get { key, now } => s.get(key, *now).await.map(Ret::Got).map_err(str),
        }
    }
}

fn str(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A store with a planted bug: `begin` reads the record, lets other calls run, and then
/// writes what it decided from what it read (a get, then a put). Every other call is one
/// atomic step of the real state machine.
#[derive(Default)]
struct TornBegin(Mutex<RecordSpec>);

impl Target for TornBegin {
    async fn call(&self, op: &Op) -> Answer {
        if !matches!(op, Op::Begin { .. }) {
            return Ok(self.0.lock().unwrap().apply(op, LeaseId::generate()));
        }
        let mut read = self.0.lock().unwrap().clone();
        let answer = read.apply(op, LeaseId::generate());
        // The read and the write are two round trips to a server.
        tokio::time::sleep(Duration::from_micros(200)).await;
        *self.0.lock().unwrap() = read;
        Ok(answer)
    }
}

/// A call or answer of a round, briefly: times from the round's start.
struct Show<'a, T>(Timestamp, &'a T);

impl Show<'_, ()> {
    fn at(start: Timestamp, t: Timestamp) -> String {
        format!(
            "+{}",
            i128::from(t.as_millis()) - i128::from(start.as_millis())
        )
    }

    fn lease(start: Timestamp, l: &Lease) -> String {
        format!(
            "{}({}:{} until {})",
            &format!("{:?}", l.id)[8..12],
            Self::fence(start, l.fence),
            l.fence % 1000,
            Self::at(start, l.expires_at)
        )
    }

    fn fence(start: Timestamp, fence: u64) -> String {
        Self::at(start, Timestamp::from_millis(fence / 1000))
    }

    fn key(k: &Key) -> String {
        format!("{k:?}")
            .split("client_key_tag: \"")
            .nth(1)
            .map_or(String::new(), |t| t[..4].to_owned())
    }
}

impl std::fmt::Display for Show<'_, Op> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        type S = Show<'static, ()>;
        let start = self.0;
        match self.1 {
            Op::Begin { req, now } => write!(
                f,
                "begin {} at {} fp {:?} lease {:?} ttl {:?}",
                S::key(&req.key),
                S::at(start, *now),
                req.fingerprint,
                req.lease,
                req.ttl
            ),
            Op::Complete {
                key,
                lease,
                response,
                now,
            } => write!(
                f,
                "complete {} at {} with {} answer {response:?}",
                S::key(key),
                S::at(start, *now),
                S::lease(start, lease)
            ),
            Op::Release { key, lease, now } => write!(
                f,
                "release {} at {} with {}",
                S::key(key),
                S::at(start, *now),
                S::lease(start, lease)
            ),
            Op::Renew {
                key,
                lease,
                length,
                now,
            } => write!(
                f,
                "renew {} at {} with {} for {length:?}",
                S::key(key),
                S::at(start, *now),
                S::lease(start, lease)
            ),
            Op::Step {
                key,
                lease,
                step,
                now,
            } => write!(
                f,
                "step {} at {} with {}: {} {:?}",
                S::key(key),
                S::at(start, *now),
                S::lease(start, lease),
                step.name.as_str(),
                step.outcome
            ),
            Op::Get { key, now } => write!(f, "get {} at {}", S::key(key), S::at(start, *now)),
        }
    }
}

impl std::fmt::Display for Show<'_, Ret> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        type S = Show<'static, ()>;
        let start = self.0;
        match self.1 {
            Ret::Begun(BeginOutcome::Acquired(l)) => write!(f, "acquired {}", S::lease(start, l)),
            Ret::Begun(BeginOutcome::Replay(r)) => write!(
                f,
                "replay {:?} of fence {}:{} completed {} expires {}",
                r.response,
                S::fence(start, r.fence),
                r.fence % 1000,
                S::at(start, r.completed_at),
                S::at(start, r.expires_at)
            ),
            Ret::Begun(BeginOutcome::InProgress { lease_expires_at }) => {
                write!(f, "in progress until {}", S::at(start, *lease_expires_at))
            }
            Ret::Got(Some(r)) => write!(
                f,
                "{:?} {}({}:{}) lease until {} expires {} answer {:?} steps {:?}",
                r.status,
                &format!("{:?}", r.lease_id)[8..12],
                S::fence(start, r.fence),
                r.fence % 1000,
                S::at(start, r.lease_expires_at),
                S::at(start, r.expires_at),
                r.response,
                r.steps
                    .iter()
                    .map(|s| (s.name.as_str(), &s.outcome))
                    .collect::<Vec<_>>()
            ),
            Ret::Renewed(Ok(l)) => write!(f, "renewed {}", S::lease(start, l)),
            other => write!(f, "{other:?}"),
        }
    }
}

/// The figures of a run.
#[derive(Debug, Default)]
struct Figures {
    rounds: u64,
    calls: u64,
    /// Calls during which another thread's call began or answered.
    overlapping: u64,
    /// Calls the store failed (left in flight: their effect is unknown).
    failed: u64,
    acquired: u64,
    takeovers: u64,
    replays: u64,
    refused: u64,
    /// Rounds whose history is not linearizable: the store and idem-core disagree.
    violations: u64,
    /// Rounds whose history breaks a rule checked without idem-core ([`oracle`]).
    broken: u64,
}

/// What the threads of a round share: the history, what each call saw of the others, and the
/// leases handed out so far (a thread may use another's, as a stale holder would).
struct Shared {
    tester: LinearizabilityTester<usize, RecordSpec>,
    events: u64,
    /// The history as text, to print when it is not linearizable.
    log: Vec<String>,
    leases: Vec<(Key, Lease)>,
    /// The history for the checks without a specification.
    calls: Vec<Call>,
    figures: Figures,
}

/// One thread's calls in one round.
async fn thread(
    target: Arc<impl Target>,
    shared: Arc<Mutex<Shared>>,
    t: usize,
    keys: Arc<Vec<Key>>,
    start: Timestamp,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let mut clock = start.as_millis() + rng.below(3);
    let mut mine: Option<(Key, Lease)> = None;
    for _ in 0..CALLS {
        clock += *rng.pick(&[0, 0, 1, 1, 2, 3, 12]);
        let now = Timestamp::from_millis(clock);
        let key = rng.pick(&keys).clone();
        let known = {
            let s = shared.lock().unwrap();
            if rng.chance(70) && mine.is_some() {
                mine.clone()
            } else if s.leases.is_empty() {
                None
            } else {
                Some(rng.pick(&s.leases).clone())
            }
        };
        // Now and then a lease goes with another key than its own.
        let known = known.map(|(own, lease)| {
            let other = keys.len() > 1 && rng.chance(20);
            (if other { key.clone() } else { own }, lease)
        });
        let op = match (rng.below(10), known) {
            (0..=3, _) | (4..=8, None) => Op::Begin {
                req: BeginRequest::new(
                    key,
                    Fingerprint::of_bytes(if rng.chance(90) { b"pay" } else { b"refund" }),
                )
                .with_lease(Duration::from_millis(2 + rng.below(6)))
                .with_ttl(if rng.chance(50) {
                    Duration::from_millis(4)
                } else {
                    Duration::from_secs(60)
                }),
                now,
            },
            (4..=5, Some((key, lease))) => Op::Complete {
                key,
                lease,
                response: Bytes::from_static(if rng.chance(80) { b"ok" } else { b"other" }),
                now,
            },
            (6, Some((key, lease))) => Op::Release { key, lease, now },
            (7, Some((key, lease))) => Op::Renew {
                key,
                lease,
                length: Duration::from_millis(1 + rng.below(6)),
                now,
            },
            (8, Some((key, lease))) => {
                let name = StepName::new(*rng.pick(&["debit", "credit"])).unwrap();
                let step = if rng.chance(25) {
                    Step::unknown(name)
                } else {
                    Step::done(name, vec![u8::try_from(rng.below(2)).unwrap()]).unwrap()
                };
                Op::Step {
                    key,
                    lease,
                    step,
                    now,
                }
            }
            _ => Op::Get { key, now },
        };
        let (invoked, call) = {
            let mut s = shared.lock().unwrap();
            s.tester.on_invoke(t, op.clone()).unwrap();
            s.log.push(format!("t{t} calls   {}", Show(start, &op)));
            s.events += 1;
            let invoked = s.events;
            s.calls.push(Call {
                op: op.clone(),
                ret: None,
                invoked,
                answered: u64::MAX,
            });
            (invoked, s.calls.len() - 1)
        };
        let answer = target.call(&op).await;
        let mut guard = shared.lock().unwrap();
        let s = &mut *guard;
        let ret = match answer {
            Ok(ret) => ret,
            Err(e) => {
                // Its effect is unknown: it stays in flight, and this thread calls no more.
                eprintln!("thread {t}: {op:?} failed: {e}");
                s.log.push(format!("t{t} failed  {e}"));
                s.figures.failed += 1;
                return;
            }
        };
        s.events += 1;
        s.log.push(format!("t{t} answers {}", Show(start, &ret)));
        s.calls[call].ret = Some(ret.clone());
        s.calls[call].answered = s.events;
        let f = &mut s.figures;
        f.calls += 1;
        f.overlapping += u64::from(s.events - invoked > 1);
        match &ret {
            Ret::Begun(BeginOutcome::Acquired(lease)) => {
                f.acquired += 1;
                f.takeovers += u64::from(lease.may_resume());
                let Op::Begin { req, .. } = &op else {
                    unreachable!()
                };
                mine = Some((req.key.clone(), *lease));
                s.leases.push((req.key.clone(), *lease));
            }
            Ret::Begun(BeginOutcome::Replay(_)) => f.replays += 1,
            Ret::Renewed(Ok(renewed)) => {
                if let Op::Renew { key, .. } = &op {
                    mine = Some((key.clone(), *renewed));
                    s.leases.push((key.clone(), *renewed));
                }
            }
            Ret::Settled(Err(_)) | Ret::Renewed(Err(_)) | Ret::Stepped(Err(_)) => f.refused += 1,
            _ => {}
        }
        s.tester.on_return(t, ret).unwrap();
    }
}

/// Runs `rounds` rounds against `target` and answers the figures; a history that is not
/// linearizable is printed, and counted in `violations`.
async fn run(target: impl Target, what: &str, rounds: u64) -> Figures {
    let target = Arc::new(target);
    // Keys of this run's own: a shared server keeps earlier runs' records.
    let run = Timestamp::now().as_millis();
    let mut figures = Figures::default();
    for round in 0..rounds {
        // One key in most rounds; two in every third, so calls on one key meet calls on
        // another (and leases of one key are tried on the other).
        let keys: Vec<Key> = (0..1 + u64::from(round % 3 == 2))
            .map(|k| Key::parse("linearizable", what, &format!("{run:x}-{round}-{k}")).unwrap())
            .collect();
        let keys = Arc::new(keys);
        let shared = Arc::new(Mutex::new(Shared {
            tester: LinearizabilityTester::new(RecordSpec::new()),
            events: 0,
            log: Vec::new(),
            leases: Vec::new(),
            calls: Vec::new(),
            figures: Figures::default(),
        }));
        let start = Timestamp::now();
        // Each thread of calls on an OS thread of its own, all starting at once: a memory
        // store answers in microseconds, and calls that quick overlap only on threads that run
        // side by side (tasks of one runtime tend to run one after the other on one worker).
        let ready = Arc::new(std::sync::Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let seed = round * 1_000 + t as u64 + 1;
                let calls = thread(target.clone(), shared.clone(), t, keys.clone(), start, seed);
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
        figures.overlapping += f.overlapping;
        figures.failed += f.failed;
        figures.acquired += f.acquired;
        figures.takeovers += f.takeovers;
        figures.replays += f.replays;
        figures.refused += f.refused;
        let linearizable = s.tester.serialized_history().is_some();
        // Retention is 4 ms or a minute: a record kept a minute outlives the round.
        let broken = oracle::violations(&s.calls, Duration::from_secs(30));
        if !linearizable || !broken.is_empty() {
            let first = figures.violations + figures.broken == 0;
            figures.violations += u64::from(!linearizable);
            figures.broken += u64::from(!broken.is_empty());
            if first {
                eprintln!(
                    "{what}: round {round}: {} (times in ms from {start:?}, fences as \
                     ms:acquisition, lease ids by their first hex digits):\n{}",
                    verdict(linearizable, &broken),
                    s.log.join("\n")
                );
            }
        }
    }
    figures
}

/// Where a round that failed points: at the store when its history breaks the rules checked
/// without idem-core, at idem-core when the store agrees with it and still breaks them; when
/// only the linearizability check fails, the two disagree and either may be wrong.
fn verdict(linearizable: bool, broken: &[String]) -> String {
    let rules = broken.join("; ");
    match (linearizable, broken.is_empty()) {
        (false, true) => "store and idem-core disagree: no order of the calls gives every \
                          answer idem-core's state machine gives, and the history keeps every \
                          rule checked without it"
            .to_owned(),
        (true, false) => format!(
            "the store agrees with idem-core, and the history breaks rules checked without \
             it, so idem-core's state machine is wrong: {rules}"
        ),
        _ => format!(
            "store and idem-core disagree, and the store's history breaks rules checked \
             without idem-core, so the store is wrong: {rules}"
        ),
    }
}

fn rounds() -> u64 {
    std::env::var("IDEM_LINEARIZABLE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// Runs the rounds on `store` and asserts that every history was linearizable.
async fn check<S: Store>(store: S, kind: &str) {
    let began = Instant::now();
    let f = run(Real(store), kind, rounds()).await;
    println!(
        "{kind}: {} rounds of {THREADS} threads, {} calls ({} overlapping another, {} failed), \
         {} acquired ({} after another lease), {} replays, {} refused: {:.1?}",
        f.rounds,
        f.calls,
        f.overlapping,
        f.failed,
        f.acquired,
        f.takeovers,
        f.replays,
        f.refused,
        began.elapsed()
    );
    assert_eq!(
        f.violations, 0,
        "{kind}: store and idem-core disagree (not linearizable): {f:?}"
    );
    assert_eq!(
        f.broken, 0,
        "{kind}: histories break rules checked without idem-core: {f:?}"
    );
    // The rounds did what they are for: leases passed from one attempt to the next, answers
    // were replayed and stale leases refused. (Calls that overlap are counted, not required:
    // the memory store answers in microseconds under one lock, and on a busy machine its
    // threads' calls may never meet.)
    assert!(f.takeovers > 0 && f.replays > 0 && f.refused > 0, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_memory_store_is_linearizable() {
    check(idem_store::MemoryStore::new(), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sqlite_store_is_linearizable() {
    let dir = tempfile::tempdir().unwrap();
    check(
        SqliteStore::open(dir.path().join("idem.db")).unwrap(),
        "sqlite",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_postgres_store_is_linearizable() {
    let Some(url) = POSTGRES.url() else { return };
    let options = PostgresOptions {
        table: NAME.into(),
        ..PostgresOptions::default()
    };
    let store = PostgresStore::connect_with(&url, options).await.unwrap();
    store
        .purge_expired(Timestamp::now(), 100_000)
        .await
        .unwrap();
    check(store, "postgres").await;
}

/// MySQL/MariaDB as it ships, with group commit: concurrent `begin`s go to the server
/// together, an upsert of many rows and a read of which rows it took, in one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mysql_store_is_linearizable() {
    check_mysql(MySqlOptions::default().max_batch, "mysql").await;
}

/// MySQL/MariaDB with every call on its own (`max_batch: 1`), the one-record statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mysql_store_without_group_commit_is_linearizable() {
    check_mysql(1, "mysql-unbatched").await;
}

async fn check_mysql(max_batch: usize, kind: &str) {
    let Some(url) = MYSQL.url() else { return };
    let options = MySqlOptions {
        // A table per test: the two run at once, and one's purge must not take records the
        // other's calls, their clocks behind the purge's, still see.
        table: format!("{NAME}_{}", kind.replace('-', "_")),
        max_batch,
        ..MySqlOptions::default()
    };
    let store = MySqlStore::connect_with(&url, options).await.unwrap();
    store
        .purge_expired(Timestamp::now(), 100_000)
        .await
        .unwrap();
    check(store, kind).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_redis_store_is_linearizable() {
    let Some(url) = REDIS.url() else { return };
    let prefix = format!("{NAME}:");
    let options = RedisOptions {
        prefix: prefix.clone(),
        ..RedisOptions::default()
    };
    check(RedisStore::connect(&url, options).await.unwrap(), "redis").await;
    idem_testkit::services::forget_redis_keys(&url, &prefix).await;
}

/// The check can fail: a store whose `begin` is not one atomic step gives histories the tester
/// rejects (two `begin`s that read the same absent record both acquire it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_begin_that_reads_then_writes_is_not_linearizable() {
    let f = run(TornBegin::default(), "torn", 50).await;
    println!("a torn begin: {f:?}");
    assert!(f.violations > 0, "the tester found nothing: {f:?}");
}

/// The tester rejects, by hand, two overlapping `begin`s of one key that both acquire it with
/// one fence, and accepts the same history when the second answers that the key is taken.
#[test]
fn two_begins_that_both_acquire_are_not_linearizable() {
    let key = Key::parse("linearizable", "by-hand", "order-1").unwrap();
    let now = Timestamp::from_millis(1_000_000);
    let req =
        BeginRequest::new(key, Fingerprint::of_bytes(b"pay")).with_lease(Duration::from_secs(10));
    let begin = Op::Begin {
        req: req.clone(),
        now,
    };
    let lease = |n: u8| Lease {
        id: LeaseId::from_bytes([n; 16]),
        fence: idem_core::Lease::first_fence(now),
        expires_at: now.saturating_add(req.lease),
    };
    let history = |second: Ret| {
        let mut tester = LinearizabilityTester::new(RecordSpec::new());
        tester
            .on_invoke(0, begin.clone())
            .unwrap()
            .on_invoke(1, begin.clone())
            .unwrap()
            .on_return(0, Ret::Begun(BeginOutcome::Acquired(lease(1))))
            .unwrap()
            .on_return(1, second)
            .unwrap();
        tester.is_consistent()
    };
    assert!(!history(Ret::Begun(BeginOutcome::Acquired(lease(2)))));
    assert!(history(Ret::Begun(BeginOutcome::InProgress {
        lease_expires_at: lease(1).expires_at,
    })));
}
