//! Store throughput and latency: begin+complete per second for each store, one task and 64
//! concurrent tasks, with the p50/p99 latency of `begin`, next to a baseline in the same run.
//!
//! `cargo bench -p idem-store --all-features --bench store` (add `-- --quick` for a short run).
//! The server stores are measured when their servers answer (the URLs of
//! `idem_testkit::services`), and skipped with a note otherwise.
//!
//! Baselines: for memory, a bare `Mutex<HashMap>` doing the same insert-then-update per key
//! (no state machine, no leases); for SQLite, the classic dedupe table done by hand: one
//! `INSERT … ON CONFLICT DO NOTHING` and one `UPDATE`, each committed on its own, with the same
//! `synchronous` setting; for PostgreSQL and MySQL/MariaDB, the engine's own limit: one
//! single-statement upsert per key through the same driver and pool at the same concurrency;
//! for Redis, `redis-benchmark` running `EVAL` of a one-line script and `SET NX` with as many
//! connections as the store has tasks.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, ClientKey, Fingerprint, Key, Namespace, Scope, Store,
    Timestamp,
};
use idem_store::{
    MemoryLimits, MemoryStore, MySqlOptions, MySqlStore, PostgresOptions, PostgresStore,
    RedisOptions, RedisStore, SqliteOptions, SqliteStore, Synchronous,
};
use idem_testkit::services::{MYSQL, POSTGRES, REDIS};

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

/// The SQL baseline: `tasks` tasks each run one upsert per fresh key, autocommitted.
async fn bare_upsert<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
    sql: &'static str,
    tasks: usize,
    per_task: usize,
) -> Figures
where
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let run = rand_u64();
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let pool = pool.clone();
            tokio::spawn(async move {
                for i in 0..per_task {
                    sqlx::query(sql)
                        .bind(format!("r{run}-t{t}-k{i}"))
                        .execute(&pool)
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    Figures {
        pairs: tasks * per_task,
        elapsed: started.elapsed(),
        begin_ns: Vec::new(),
    }
}

/// `redis-benchmark`'s requests per second for `command` with `clients` connections.
fn redis_benchmark(url: &str, clients: usize, requests: usize, command: &[&str]) -> Option<f64> {
    let port = url.rsplit(':').next()?.trim_end_matches('/');
    let out = std::process::Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", port, "-q", "-r", "100000000"])
        .args(["-c", &clients.to_string(), "-n", &requests.to_string()])
        .args(command)
        .output()
        .ok()?;
    // "EVAL …: 41050.90 requests per second, p50=…"
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("requests per second"))?;
    let figure = line.split("requests per second").next()?;
    figure.rsplit(' ').find(|w| !w.is_empty())?.parse().ok()
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
    // `--only NAME`: just the rows of that store (memory, sqlite, postgres, mysql, redis).
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let scale = if quick { 10 } else { 1 };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!("store bench: begin+complete pairs per second, p50/p99 latency of begin");
    println!("machine: {cores} cores; quick={quick}\n");
    println!("| store | tasks | pairs/s | begin p50 / p99 | vs baseline (same run) |");
    println!("|---|---|---|---|---|");

    // Memory, single task: a current-thread runtime, as a job loop would run it.
    let single = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let multi = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();

    if wanted("memory") {
        let n = 1_000_000 / scale;
        let mut base = bare_map(n);
        row("bare Mutex<HashMap> (baseline)", 1, &mut base, None);
        // Unbounded: the run writes more fresh keys than the default bound holds.
        let unbounded = MemoryLimits::new(usize::MAX, usize::MAX);
        let mem = MemoryStore::with_limits(unbounded);
        let mut f = single.block_on(run_store(&mem, 1, n));
        row("memory", 1, &mut f, Some(("bare map", base.per_sec())));
        let mem = MemoryStore::with_limits(unbounded);
        let mut f = multi.block_on(run_store(&mem, 64, n / 64));
        row("memory", 64, &mut f, Some(("bare map", base.per_sec())));
    }

    for (sync, label) in [(Synchronous::Full, "FULL"), (Synchronous::Normal, "NORMAL")] {
        if !wanted("sqlite") {
            break;
        }
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
        // As shipped; without the key filter (every `begin` reads first, a fresh key too);
        // with no read connections (every `begin` straight to the writer, without the read
        // that answers replays off it).
        type Variant = (&'static str, fn(&mut SqliteOptions));
        let variants: [Variant; 3] = [
            ("", |_| {}),
            (", key_filter=false", |o| o.key_filter = false),
            (", read_connections=0", |o| o.read_connections = 0),
        ];
        for (i, (suffix, set)) in variants.into_iter().enumerate() {
            let mut options = SqliteOptions::default();
            options.synchronous = sync;
            set(&mut options);
            let file = format!("idem{i}.db");
            let store = SqliteStore::open_with(dir.path().join(file), options).unwrap();
            let name = format!("sqlite synchronous={label}{suffix}");
            let mut f = multi.block_on(run_store(&store, 1, single_n));
            row(&name, 1, &mut f, Some(("dedupe table", base.per_sec())));
            let mut f = multi.block_on(run_store(&store, 64, 200_000 / scale / 64));
            row(&name, 64, &mut f, Some(("dedupe table", base.per_sec())));
        }
    }

    // One task runs on a current-thread runtime, as a job loop would; 64 on all cores.
    for (runtime, tasks) in [(&single, 1), (&multi, 64)] {
        runtime.block_on(servers(scale, tasks, &wanted));
    }
}

/// The stores on servers, each beside its engine's own limit.
async fn servers(scale: usize, tasks: usize, wanted: &dyn Fn(&str) -> bool) {
    const TABLE: &str = "idem_bench_records";
    if let Some(url) = POSTGRES.url().filter(|_| wanted("postgres")) {
        let options = PostgresOptions {
            table: TABLE.into(),
            ..PostgresOptions::default()
        };
        let store = PostgresStore::connect_with(&url, options.clone())
            .await
            .unwrap();
        let alone = PostgresStore::connect_with(
            &url,
            PostgresOptions {
                max_batch: 1,
                ..options
            },
        )
        .await
        .unwrap();
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_bench_upsert (k TEXT PRIMARY KEY, v TEXT)")
            .execute(store.pool())
            .await
            .unwrap();
        let upsert =
            "INSERT INTO idem_bench_upsert (k, v) VALUES ($1, 'x') ON CONFLICT (k) DO NOTHING";
        sql_rows(
            "postgres",
            &store,
            &alone,
            store.pool(),
            upsert,
            scale,
            tasks,
        )
        .await;
        for t in ["idem_bench_upsert", TABLE, "idem_bench_records_migrations"] {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
                .execute(store.pool())
                .await
                .unwrap();
        }
    }
    if let Some(url) = MYSQL.url().filter(|_| wanted("mysql")) {
        let options = MySqlOptions {
            table: TABLE.into(),
            ..MySqlOptions::default()
        };
        let store = MySqlStore::connect_with(&url, options.clone())
            .await
            .unwrap();
        let alone = MySqlStore::connect_with(
            &url,
            MySqlOptions {
                max_batch: 1,
                ..options
            },
        )
        .await
        .unwrap();
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS idem_bench_upsert (k VARBINARY(255) PRIMARY KEY, v TEXT)",
        )
        .execute(store.pool())
        .await
        .unwrap();
        let upsert =
            "INSERT INTO idem_bench_upsert (k, v) VALUES (?, 'x') ON DUPLICATE KEY UPDATE k = k";
        sql_rows("mysql", &store, &alone, store.pool(), upsert, scale, tasks).await;
        for t in ["idem_bench_upsert", TABLE, "idem_bench_records_migrations"] {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
                .execute(store.pool())
                .await
                .unwrap();
        }
    }
    if let Some(url) = REDIS.url().filter(|_| wanted("redis")) {
        let options = RedisOptions {
            prefix: "idem-bench:".into(),
            ..RedisOptions::default()
        };
        let store = RedisStore::connect(&url, options).await.unwrap();
        {
            let n = if tasks == 1 { 20_000 } else { 200_000 } / scale;
            let eval = redis_benchmark(
                &url,
                tasks,
                n,
                &[
                    "EVAL",
                    "return redis.call('SET', KEYS[1], ARGV[1], 'NX')",
                    "1",
                    "idem-bench:k:__rand_int__",
                    "v",
                ],
            );
            let setnx = redis_benchmark(
                &url,
                tasks,
                n,
                &["SET", "idem-bench:s:__rand_int__", "v", "NX"],
            );
            for (what, rate) in [("EVAL", eval), ("SET NX", setnx)] {
                match rate {
                    Some(r) => println!(
                        "| redis-benchmark {what} (baseline) | {tasks} | {r:>12.0} | – |  |"
                    ),
                    None => println!(
                        "| redis-benchmark {what}: not run (is it installed?) | {tasks} | | | |"
                    ),
                }
            }
            let mut f = run_store(&store, tasks, n / tasks).await;
            row("redis", tasks, &mut f, eval.map(|r| ("EVAL", r)));
            if tasks > 1 {
                // Group commit off: every call a command of its own.
                let options = RedisOptions {
                    prefix: "idem-bench:1:".into(),
                    max_batch: 1,
                    ..RedisOptions::default()
                };
                let alone = RedisStore::connect(&url, options).await.unwrap();
                let mut f = run_store(&alone, tasks, n / tasks).await;
                row(
                    "redis, max_batch 1",
                    tasks,
                    &mut f,
                    eval.map(|r| ("EVAL", r)),
                );
            }
        }
        // Leave nothing behind (the records would otherwise live for their 24 h TTL).
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg("redis-cli -u \"$0\" --scan --pattern 'idem-bench:*' | xargs -r -n 1000 redis-cli -u \"$0\" unlink >/dev/null")
            .arg(&url)
            .status();
    }
}

/// One SQL store at `tasks` tasks, beside the single-statement upsert, and the same store
/// sending each call on its own (`max_batch` 1: no group commit).
async fn sql_rows<DB: sqlx::Database, S: Store + Clone>(
    name: &str,
    store: &S,
    alone: &S,
    pool: &sqlx::Pool<DB>,
    upsert: &'static str,
    scale: usize,
    tasks: usize,
) where
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    {
        let n = if tasks == 1 { 2_000 } else { 20_000 } / scale;
        let mut base = bare_upsert(pool, upsert, tasks, n / tasks).await;
        row(
            &format!("{name} single-statement upsert (baseline)"),
            tasks,
            &mut base,
            None,
        );
        let mut f = run_store(alone, tasks, n / tasks).await;
        row(
            &format!("{name}, max_batch=1"),
            tasks,
            &mut f,
            Some(("upsert", base.per_sec())),
        );
        let mut f = run_store(store, tasks, n / tasks).await;
        row(name, tasks, &mut f, Some(("upsert", base.per_sec())));
    }
}
