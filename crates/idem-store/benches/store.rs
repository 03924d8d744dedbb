//! Store throughput and latency: begin+complete per second for each store, one task and 64
//! concurrent tasks, with the p50/p99 latency of `begin`, next to a baseline in the same run.
//!
//! `cargo bench -p idem-store --bench store` (add `-- --quick` for a short run).
//!
//! Baselines: for memory, a bare `Mutex<HashMap>` doing the same insert-then-update per key
//! (no state machine, no leases); for SQLite, the classic dedupe table done by hand: one
//! `INSERT … ON CONFLICT DO NOTHING` and one `UPDATE`, each committed on its own, with the same
//! `synchronous` setting.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, ClientKey, Fingerprint, Key, Namespace, Scope, Store,
    Timestamp,
};
use idem_store::{MemoryStore, SqliteOptions, SqliteStore, Synchronous};

struct Figures {
    pairs: usize,
    elapsed: Duration,
    begin_ns: Vec<u64>,
}

impl Figures {
    fn per_sec(&self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile(&mut self, pct: usize) -> Duration {
        if self.begin_ns.is_empty() {
            return Duration::ZERO;
        }
        self.begin_ns.sort_unstable();
        let i = (self.begin_ns.len() - 1) * pct / 100;
        Duration::from_nanos(self.begin_ns[i])
    }
}

/// One `begin` in this many is timed for the latency figures.
const LATENCY_SAMPLE: usize = 16;

/// A fresh key, built the way a consumer builds one: its scope and namespace are made once and
/// shared, the client key is the request's own id.
fn key(scope: &Scope, namespace: &Namespace, run: u64, task: usize, i: usize) -> Key {
    let client_key = ClientKey::new(format!("r{run}-t{task}-k{i}")).unwrap();
    Key::new(scope.clone(), namespace.clone(), client_key)
}

/// `tasks` tasks each run begin+complete on `per_task` fresh keys.
async fn run_store<S: Store + Clone>(store: &S, tasks: usize, per_task: usize) -> Figures {
    let run: u64 = rand_u64();
    let fp = Fingerprint::of_bytes(b"request");
    let response = Bytes::from_static(b"{\"status\":\"sent\"}");
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let store = store.clone();
            let response = response.clone();
            tokio::spawn(async move {
                let scope = Scope::new("bench").unwrap();
                let namespace = Namespace::new("pay").unwrap();
                let mut lat = Vec::with_capacity(per_task);
                for i in 0..per_task {
                    let req = BeginRequest::new(key(&scope, &namespace, run, t, i), fp);
                    let now = Timestamp::now();
                    // Reading the clock costs ~25 ns on these VMs: time one begin in 16.
                    let t0 = (i % LATENCY_SAMPLE == 0).then(Instant::now);
                    let outcome = store.begin(&req, now).await.unwrap();
                    if let Some(t0) = t0 {
                        lat.push(u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX));
                    }
                    let BeginOutcome::Acquired(lease) = outcome else {
                        panic!("fresh key not acquired")
                    };
                    store
                        .complete(&req.key, &lease, response.clone(), now)
                        .await
                        .unwrap();
                }
                lat
            })
        })
        .collect();
    let mut begin_ns = Vec::with_capacity(tasks * per_task);
    for h in handles {
        begin_ns.extend(h.await.unwrap());
    }
    Figures {
        pairs: tasks * per_task,
        elapsed: started.elapsed(),
        begin_ns,
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

/// The memory baseline: the same insert-then-update on a bare map, one thread.
fn bare_map(pairs: usize) -> Figures {
    let map: Mutex<HashMap<String, Vec<u8>>> = Mutex::default();
    let started = Instant::now();
    for i in 0..pairs {
        let k = format!("bench/pay/k{i}");
        {
            let mut m = map.lock().unwrap();
            if m.contains_key(&k) {
                panic!("duplicate");
            }
            m.insert(k.clone(), Vec::new());
        }
        map.lock()
            .unwrap()
            .insert(k, b"{\"status\":\"sent\"}".to_vec());
    }
    Figures {
        pairs,
        elapsed: started.elapsed(),
        begin_ns: Vec::new(),
    }
}

/// The SQLite baseline: a hand-written dedupe table, one statement per transaction.
fn bare_sqlite(path: &std::path::Path, sync: &str, pairs: usize) -> Figures {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.pragma_update_and_check(None, "journal_mode", "WAL", |_| Ok(()))
        .unwrap();
    conn.pragma_update(None, "synchronous", sync).unwrap();
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS dedupe (k TEXT PRIMARY KEY, status INTEGER, response BLOB)",
    )
    .unwrap();
    let started = Instant::now();
    for i in 0..pairs {
        let k = format!("bench/pay/k{i}");
        let n = conn
            .execute(
                "INSERT INTO dedupe (k, status) VALUES (?1, 0) ON CONFLICT DO NOTHING",
                [&k],
            )
            .unwrap();
        assert_eq!(n, 1);
        conn.execute(
            "UPDATE dedupe SET status = 1, response = ?2 WHERE k = ?1",
            rusqlite::params![k, b"{\"status\":\"sent\"}".as_slice()],
        )
        .unwrap();
    }
    Figures {
        pairs,
        elapsed: started.elapsed(),
        begin_ns: Vec::new(),
    }
}

fn row(name: &str, tasks: usize, f: &mut Figures, baseline: Option<(&str, f64)>) {
    let (p50, p99) = (f.percentile(50), f.percentile(99));
    let lat = if f.begin_ns.is_empty() {
        "–".to_owned()
    } else {
        format!("{p50:.1?} / {p99:.1?}")
    };
    let ratio = baseline.map_or(String::new(), |(b, per_sec)| {
        format!("{:.2}× {b}", f.per_sec() / per_sec)
    });
    println!(
        "| {name} | {tasks} | {:>12.0} | {lat} | {ratio} |",
        f.per_sec()
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!("store bench: begin+complete pairs per second, p50/p99 latency of begin");
    println!("machine: {cores} cores; quick={quick}\n");
    println!("| store | tasks | pairs/s | begin p50 / p99 | vs baseline (same run) |");
    println!("|---|---|---|---|---|");

    // Memory, single task: a current-thread runtime, as a job loop would run it.
    let single = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let multi = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();

    let n = 1_000_000 / scale;
    let mut base = bare_map(n);
    row("bare Mutex<HashMap> (baseline)", 1, &mut base, None);
    let mem = MemoryStore::new();
    let mut f = single.block_on(run_store(&mem, 1, n));
    row("memory", 1, &mut f, Some(("bare map", base.per_sec())));
    let mem = MemoryStore::new();
    let mut f = multi.block_on(run_store(&mem, 64, n / 64));
    row("memory", 64, &mut f, Some(("bare map", base.per_sec())));

    for (sync, label) in [(Synchronous::Full, "FULL"), (Synchronous::Normal, "NORMAL")] {
        let dir = tempfile::tempdir().unwrap();
        let single_n = if sync == Synchronous::Full {
            2_000
        } else {
            20_000
        } / scale;
        let mut base = bare_sqlite(&dir.path().join("bare.db"), label, single_n);
        row(
            &format!("hand-written dedupe table, synchronous={label} (baseline)"),
            1,
            &mut base,
            None,
        );
        let mut options = SqliteOptions::default();
        options.synchronous = sync;
        let store = SqliteStore::open_with(dir.path().join("idem.db"), options).unwrap();
        let mut f = multi.block_on(run_store(&store, 1, single_n));
        row(
            &format!("sqlite synchronous={label}"),
            1,
            &mut f,
            Some(("dedupe table", base.per_sec())),
        );
        let mut f = multi.block_on(run_store(&store, 64, 200_000 / scale / 64));
        row(
            &format!("sqlite synchronous={label}"),
            64,
            &mut f,
            Some(("dedupe table", base.per_sec())),
        );
    }
}
