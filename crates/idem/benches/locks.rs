//! Locks and one-time tokens: throughput and hand-off latency, next to the engine's own limit
//! in the same run.
//!
//! `cargo bench -p idem --bench locks` (`IDEM_BENCH_SECONDS`, default 5 per scenario;
//! `IDEM_BENCH_BACKENDS=redis,postgres,sqlite,memory,zookeeper` or a part of it). Redis
//! is the one at `IDEM_TEST_REDIS_URL` (default `redis://127.0.0.1:6379`); PostgreSQL and
//! SQLite are measured too, when PostgreSQL answers. ZooKeeper is the one at
//! `IDEM_BENCH_ZK_HOSTS`, or a server the bench starts (Debian's `zookeeper`); all its
//! clients share one session, as an `idem serve`'s do. etcd (`--features etcd`,
//! `IDEM_BENCH_BACKENDS=etcd`) is the one at `IDEM_BENCH_ETCD_ENDPOINTS`, or a server the
//! bench starts (Debian's `etcd-server`), its clients sharing one session too.
//!
//! Lock scenarios, the same as the peers' harness (`bench/peers/`), lease 10 s:
//! - `uncontended` (1 and 8 clients): each client acquires and releases its own lock in a loop;
//! - `contended` (8 clients): all acquire (waiting) and release one lock; the hand-off latency
//!   is the time from one client starting its release to another client's acquire returning.
//!
//! The Redis limits, each measured beside idem in every round (`IDEM_BENCH_ROUNDS`, default 1):
//! - the *floor*: the very scripts an acquire and a release run, sent by the leanest client
//!   there is (redis-rs's blocking connection, one OS thread per client, `EVALSHA`), in the
//!   same sequence on the same lock state as `uncontended` (acquire, then release of what was
//!   acquired, on the client's own lock): what any client of these scripts can reach;
//! - `redis-benchmark` running the same scripts (`EVAL`, a random key each time), with as
//!   many connections as clients, combined into pairs per second (`1 / (1/acquire +
//!   1/release)`), and the same for the bare commands of the classic lock (`SET NX PX`,
//!   `DEL`). Its release finds no lock at its random key and stops after reading it, so this
//!   limit is of a cheaper release than the one a lock pays.

#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::cast_precision_loss,
    missing_docs
)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::{Locks, SqliteStore, SystemClock, Tokens};
use idem_core::{SharedLockStore, SharedStore};
use idem_store::{
    PostgresOptions, PostgresStore, RedisOptions, RedisStore, ZooKeeperLocks, ZooKeeperOptions,
};
use idem_testkit::coordination::ZooKeeper;
use idem_testkit::services::{POSTGRES, REDIS};

const LEASE: Duration = Duration::from_secs(10);

fn seconds() -> Duration {
    let s = std::env::var("IDEM_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    Duration::from_secs(s)
}

fn run_id() -> u64 {
    rand::random::<u64>() & 0xffff_ffff
}

/// Pairs per second with `clients` clients, each on its own lock.
async fn uncontended(locks: &Locks, clients: usize, run: Duration) -> f64 {
    let id = run_id();
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let locks = locks.clone();
            tokio::spawn(async move {
                let name = format!("bench:{id}:{c}");
                let mut pairs = 0u64;
                while start.elapsed() < run {
                    let g = locks.try_acquire(&name, LEASE).await.unwrap();
                    g.release().await.unwrap();
                    pairs += 1;
                }
                pairs
            })
        })
        .collect();
    let mut pairs = 0;
    for t in tasks {
        pairs += t.await.unwrap();
    }
    pairs as f64 / start.elapsed().as_secs_f64()
}

struct Contended {
    per_sec: f64,
    handoffs: usize,
    p50: Duration,
    p99: Duration,
}

/// Pairs per second and hand-off latency with `clients` clients on one lock.
async fn contended(locks: &Locks, clients: usize, run: Duration) -> Contended {
    let name = format!("bench:{}:shared", run_id());
    // (when, client, is_release_start)
    let events = Arc::new(Mutex::new(Vec::<(Instant, usize, bool)>::new()));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (locks, name, events) = (locks.clone(), name.clone(), Arc::clone(&events));
            tokio::spawn(async move {
                let mut pairs = 0u64;
                while start.elapsed() < run {
                    let g = locks
                        .acquire(&name, LEASE, Duration::from_secs(60))
                        .await
                        .unwrap();
                    events.lock().unwrap().push((Instant::now(), c, false));
                    tokio::task::yield_now().await;
                    events.lock().unwrap().push((Instant::now(), c, true));
                    g.release().await.unwrap();
                    pairs += 1;
                }
                pairs
            })
        })
        .collect();
    let mut pairs = 0;
    for t in tasks {
        pairs += t.await.unwrap();
    }
    let elapsed = start.elapsed();
    let mut events = std::mem::take(&mut *events.lock().unwrap());
    events.sort_by_key(|e| e.0);
    let mut last_release: Option<(Instant, usize)> = None;
    let mut handoffs = Vec::new();
    for (at, client, release) in events {
        if release {
            last_release = Some((at, client));
        } else if let Some((r, from)) = last_release
            && from != client
        {
            handoffs.push(at - r);
        }
    }
    handoffs.sort_unstable();
    let pct = |p: usize| {
        handoffs
            .get((handoffs.len().saturating_sub(1)) * p / 100)
            .copied()
            .unwrap_or_default()
    };
    Contended {
        per_sec: pairs as f64 / elapsed.as_secs_f64(),
        handoffs: handoffs.len(),
        p50: pct(50),
        p99: pct(99),
    }
}

/// Issue+consume pairs per second with `clients` clients.
async fn tokens(tokens: &Tokens, clients: usize, run: Duration) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let tokens = tokens.clone();
            tokio::spawn(async move {
                let mut pairs = 0u64;
                while start.elapsed() < run {
                    let t = tokens
                        .issue("bench", "form", Duration::from_secs(600))
                        .await
                        .unwrap();
                    tokens.consume("bench", &t.token, "form").await.unwrap();
                    pairs += 1;
                }
                pairs
            })
        })
        .collect();
    let mut pairs = 0;
    for t in tasks {
        pairs += t.await.unwrap();
    }
    pairs as f64 / start.elapsed().as_secs_f64()
}

/// `redis-benchmark`'s requests per second for `command` with `clients` connections.
fn redis_benchmark(url: &str, clients: usize, command: &[&str]) -> Option<f64> {
    let port = url.rsplit(':').next()?.trim_end_matches('/');
    let out = std::process::Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", port, "-q", "-r", "100000000"])
        .args(["-c", &clients.to_string(), "-n", "100000"])
        .args(command)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(line) = text
        .lines()
        .rev()
        .find(|l| l.contains("requests per second"))
    else {
        eprintln!(
            "redis-benchmark {}: {}",
            command[0],
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    };
    let figure = line.split("requests per second").next()?;
    figure.rsplit(' ').find(|w| !w.is_empty())?.parse().ok()
}

fn pair_rate(a: f64, b: f64) -> f64 {
    1.0 / (1.0 / a + 1.0 / b)
}

/// The Redis limits for `clients` connections: (our scripts, SET NX PX + DEL) in pairs/s.
fn redis_limits(url: &str, clients: usize) -> Option<(f64, f64)> {
    let (acquire, release) = idem_store::lock_scripts();
    let owner = "0".repeat(64);
    let key = "idem-bench:lock:{__rand_int__}";
    let acq = redis_benchmark(
        url,
        clients,
        &["EVAL", &acquire, "1", key, &owner, "10000", "3600000", "n"],
    )?;
    let rel = redis_benchmark(
        url,
        clients,
        &[
            "EVAL",
            &release,
            "1",
            key,
            &owner,
            "1",
            "3600000",
            "idem-bench:ch",
            "n",
        ],
    )?;
    // Keys of their own, apart from the lock states.
    let key = "idem-bench:set:{__rand_int__}";
    let set = redis_benchmark(url, clients, &["SET", key, &owner, "NX", "PX", "10000"])?;
    let del = redis_benchmark(url, clients, &["DEL", key])?;
    Some((pair_rate(acq, rel), pair_rate(set, del)))
}

fn redis_flush_bench_keys(url: &str) {
    let port = url
        .rsplit(':')
        .next()
        .unwrap_or("6379")
        .trim_end_matches('/');
    let _ = std::process::Command::new("redis-cli")
        .args(["-p", port, "--scan", "--pattern", "idem-bench:*"])
        .output()
        .map(|out| {
            for chunk in String::from_utf8_lossy(&out.stdout)
                .lines()
                .collect::<Vec<_>>()
                .chunks(500)
            {
                let _ = std::process::Command::new("redis-cli")
                    .args(["-p", port, "DEL"])
                    .args(chunk)
                    .output();
            }
        });
}

/// Acquire+release pairs per second of the lock scripts sent by a minimal blocking client:
/// `clients` OS threads, each with its own connection and lock, acquiring and releasing it
/// in a loop as [`uncontended`] does through the store.
fn script_floor(url: &str, clients: usize, run: Duration) -> f64 {
    let (acquire, release) = idem_store::lock_scripts();
    let (acquire, release) = (redis::Script::new(&acquire), redis::Script::new(&release));
    let client = redis::Client::open(url).unwrap();
    {
        let mut con = client.get_connection().unwrap();
        acquire.prepare_invoke().load(&mut con).unwrap();
        release.prepare_invoke().load(&mut con).unwrap();
    }
    let (lease, retention) = (LEASE.as_millis().to_string(), "3600000");
    let id = run_id();
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (client, lease) = (client.clone(), lease.clone());
            let (acquire, release) = (acquire.get_hash().to_owned(), release.get_hash().to_owned());
            std::thread::spawn(move || {
                let mut con = client.get_connection().unwrap();
                let name = format!("floor:{id}:{c}");
                let key = format!("idem-bench:lock:{{{name}}}");
                let owner = "ab".repeat(32);
                let mut take = redis::cmd("EVALSHA");
                take.arg(&acquire)
                    .arg(1)
                    .arg(&key)
                    .arg(&owner)
                    .arg(&lease)
                    .arg(retention)
                    .arg(&name);
                let mut pairs = 0u64;
                while start.elapsed() < run {
                    let got: Vec<redis::Value> = take.query(&mut con).unwrap();
                    let Some(redis::Value::Int(fence)) = got.get(1) else {
                        panic!("lock not acquired: {got:?}")
                    };
                    let released: i64 = redis::cmd("EVALSHA")
                        .arg(&release)
                        .arg(1)
                        .arg(&key)
                        .arg(&owner)
                        .arg(*fence)
                        .arg(retention)
                        .arg("idem-bench:lock-released")
                        .arg(&name)
                        .query(&mut con)
                        .unwrap();
                    assert_eq!(released, 1);
                    pairs += 1;
                }
                pairs
            })
        })
        .collect();
    let pairs: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    pairs as f64 / start.elapsed().as_secs_f64()
}

/// Uncontended Redis rows, `rounds` times: in each round, per client count, the floor and
/// redis-benchmark's limits measured right before idem, and idem's ratio to each.
async fn redis_rounds(url: &str, locks: &Locks, run: Duration, rounds: usize) {
    println!(
        "| round | clients | idem pairs/s | floor pairs/s | × floor | redis-benchmark scripts | × | SET NX PX + DEL | × |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for round in 1..=rounds {
        for clients in [1, 8] {
            let bench = redis_limits(url, clients);
            redis_flush_bench_keys(url);
            let floor = {
                let url = url.to_owned();
                tokio::task::spawn_blocking(move || script_floor(&url, clients, run))
                    .await
                    .unwrap()
            };
            let ours = uncontended(locks, clients, run).await;
            let (script, naive) = bench.unwrap_or((f64::NAN, f64::NAN));
            println!(
                "| {round} | {clients} | {ours:.0} | {floor:.0} | {:.2} | {script:.0} | {:.2} | {naive:.0} | {:.2} |",
                ours / floor,
                ours / script,
                ours / naive
            );
        }
    }
    redis_flush_bench_keys(url);
}

async fn lock_rows(name: &str, locks: &Locks, run: Duration) {
    for clients in [1, 8] {
        let per_sec = uncontended(locks, clients, run).await;
        println!("| {name} | uncontended | {clients} | {per_sec:>9.0} | – |");
    }
    contended_row(name, locks, run).await;
}

async fn contended_row(name: &str, locks: &Locks, run: Duration) {
    let c = contended(locks, 8, run).await;
    println!(
        "| {name} | contended | 8 | {:>9.0} | {:.2?} / {:.2?} ({} hand-offs) |",
        c.per_sec, c.p50, c.p99, c.handoffs
    );
}

/// The same pairs done bare through the same client library: `SET NX PX` and `DEL` on a
/// multiplexed connection, `clients` tasks each on its own key.
async fn redis_rs_pairs(url: &str, clients: usize, run: Duration) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let id = run_id();
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let mut conn = conn.clone();
            tokio::spawn(async move {
                let key = format!("idem-bench:raw:{id}:{c}");
                let mut pairs = 0u64;
                while start.elapsed() < run {
                    let _: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg("owner")
                        .arg("NX")
                        .arg("PX")
                        .arg(10_000)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    let _: i64 = redis::cmd("DEL")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    pairs += 1;
                }
                pairs
            })
        })
        .collect();
    let mut pairs = 0;
    for t in tasks {
        pairs += t.await.unwrap();
    }
    pairs as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    // One thread by default, as the peers run (Node's event loop, and Python's threads under
    // its lock); IDEM_BENCH_THREADS=N for a multi-threaded runtime.
    let threads: usize = std::env::var("IDEM_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let rt = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap()
    };
    let run = seconds();
    let rounds: usize = std::env::var("IDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    // IDEM_BENCH_BACKENDS=redis,sqlite (say) measures only those.
    let backends = std::env::var("IDEM_BENCH_BACKENDS").unwrap_or_default();
    let wanted = |b: &str| backends.is_empty() || backends.split(',').any(|w| w.trim() == b);
    rt.block_on(async {
        if let Some(url) = REDIS.url().filter(|_| wanted("redis")) {
            let options = RedisOptions {
                prefix: "idem-bench:".into(),
                ..RedisOptions::default()
            };
            let store = RedisStore::connect(&url, options).await.unwrap();
            let locks = Locks::new(store.clone());
            redis_rounds(&url, &locks, run, rounds).await;
            println!();
            println!("| backend | scenario | clients | pairs/s | hand-off p50 / p99 |");
            println!("| --- | --- | ---: | ---: | --- |");
            for clients in [1, 8] {
                let per_sec = redis_rs_pairs(&url, clients, run).await;
                println!("| redis-rs SET NX PX + DEL (baseline) | uncontended | {clients} | {per_sec:>9.0} | – |");
            }
            contended_row("redis", &locks, run).await;
            let t = Tokens::new(Arc::new(store) as SharedStore, Arc::new(SystemClock));
            for clients in [1, 8] {
                let per_sec = tokens(&t, clients, run).await;
                println!("| redis | tokens issue+consume | {clients} | {per_sec:>9.0} | – |");
            }
            redis_flush_bench_keys(&url);
        } else {
            println!("| backend | scenario | clients | pairs/s | hand-off p50 / p99 |");
            println!("| --- | --- | ---: | ---: | --- |");
        }
        if let Some(url) = POSTGRES.url().filter(|_| wanted("postgres")) {
            let options = PostgresOptions {
                table: "idem_bench_locks".into(),
                ..PostgresOptions::default()
            };
            let store = PostgresStore::connect_with(&url, options).await.unwrap();
            lock_rows("postgres", &Locks::new(store), run).await;
        }
        if wanted("sqlite") {
            let dir = tempfile::tempdir().unwrap();
            let sqlite = SqliteStore::open(dir.path().join("bench.db")).unwrap();
            lock_rows("sqlite", &Locks::new(sqlite.clone()), run).await;
            let t = Tokens::new(Arc::new(sqlite) as SharedStore, Arc::new(SystemClock));
            for clients in [1, 8] {
                let per_sec = tokens(&t, clients, run).await;
                println!("| sqlite | tokens issue+consume | {clients} | {per_sec:>9.0} | – |");
            }
        }
        if wanted("memory") {
            let memory: SharedLockStore = Arc::new(idem::MemoryStore::new());
            lock_rows("memory", &Locks::shared(memory), run).await;
        }
        if wanted("zookeeper") {
            let own = std::env::var("IDEM_BENCH_ZK_HOSTS")
                .is_err()
                .then(ZooKeeper::start)
                .flatten();
            let hosts = std::env::var("IDEM_BENCH_ZK_HOSTS")
                .ok()
                .or_else(|| own.as_ref().map(ZooKeeper::hosts));
            if let Some(hosts) = hosts {
                let options = ZooKeeperOptions::default().root("/idem-bench");
                let zk = ZooKeeperLocks::connect(&hosts, options).await.unwrap();
                lock_rows("zookeeper", &Locks::new(zk), run).await;
            }
        }
        #[cfg(feature = "etcd")]
        if backends.split(',').any(|w| w.trim() == "etcd") {
            let own = std::env::var("IDEM_BENCH_ETCD_ENDPOINTS")
                .is_err()
                .then(idem_testkit::coordination::Etcd::start)
                .flatten();
            let endpoints = std::env::var("IDEM_BENCH_ETCD_ENDPOINTS")
                .ok()
                .or_else(|| own.as_ref().map(idem_testkit::coordination::Etcd::endpoints));
            if let Some(endpoints) = endpoints {
                let options = idem::EtcdOptions::default().prefix("/idem-bench");
                let etcd = idem::EtcdLocks::connect(&endpoints, options).await.unwrap();
                lock_rows("etcd", &Locks::new(etcd), run).await;
            }
        }
    });
}
