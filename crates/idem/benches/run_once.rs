//! Function-level run-once on Redis with one caller, shaped as `bench/peers/powertools_bench.py`
//! measures AWS Lambda Powertools' `idempotent_function`, so that the two can run side by side
//! (`bench/run-once-vs-powertools.sh` interleaves them).
//!
//! One task calls `idem.once(&key).input(&order).run(work)` in a loop, `work` returning
//! `{"ok": true, "n": n}`. Scenarios, each for `--seconds` (default 5), each with and without a
//! [`ReplayCache`] in front of the store:
//!
//! - `new`: every call with a fresh key (each a first execution);
//! - `replay`: 1,000 keys run once first (untimed), then called in turn (each a replay).
//!
//! Executions are counted and checked (every `new` call runs the work, no `replay` call does).
//! Prints one JSON line per scenario.
//!
//! `cargo bench -p idem --bench run_once -- [--seconds N]` (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`).

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{Idempotency, Key};
use idem_core::{SharedStore, Store};
use idem_store::{RedisOptions, RedisStore, ReplayCache, ReplayCacheLimits};
use serde_json::json;

const POOL: usize = 1000;

struct Bench<S> {
    idem: Idempotency<S>,
    executions: Arc<AtomicU64>,
    namespace: String,
}

impl<S: Store + Clone> Bench<S> {
    async fn call(&self, n: u64) -> (serde_json::Value, bool) {
        let key = Key::parse("bench", &self.namespace, &format!("order-{n}")).unwrap();
        let order = json!({"n": n, "amount": 1000, "currency": "eur"});
        let executions = self.executions.clone();
        let done = self
            .idem
            .once(&key)
            .input(&order)
            .unwrap()
            .ttl(Duration::from_secs(3600))
            .run(|_lease| async move {
                executions.fetch_add(1, Ordering::Relaxed);
                Ok::<_, String>(json!({"ok": true, "n": n}))
            })
            .await
            .unwrap();
        (done.value, done.replayed)
    }

    /// Calls `next(i)` for `seconds`; the latencies of the calls, in µs.
    async fn timed(&self, seconds: f64, next: impl Fn(u64) -> u64, replayed: bool) -> Vec<u64> {
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let mut latencies = Vec::new();
        let mut i = 0;
        while Instant::now() < deadline {
            let n = next(i);
            let started = Instant::now();
            let (value, was_replayed) = self.call(n).await;
            latencies.push(u64::try_from(started.elapsed().as_micros()).unwrap());
            assert_eq!(was_replayed, replayed);
            assert_eq!(value["n"], n);
            i += 1;
        }
        latencies
    }
}

fn report(scenario: &str, cache: bool, latencies: &mut [u64], seconds: f64) {
    latencies.sort_unstable();
    let at = |q: usize| latencies[(latencies.len() * q / 1000).min(latencies.len() - 1)];
    println!(
        "{}",
        json!({
            "peer": "idem",
            "scenario": scenario,
            "local_cache": cache,
            "calls": latencies.len(),
            "seconds": seconds,
            "per_sec": (latencies.len() as f64 / seconds).round(),
            "p50_us": at(500),
            "p99_us": at(990),
        })
    );
}

async fn scenarios(store: SharedStore, cache: bool, seconds: f64, run: &str) {
    let namespace = format!("{run}-{}", if cache { "lc" } else { "nolc" });
    let store: SharedStore = if cache {
        Arc::new(ReplayCache::new(store, ReplayCacheLimits::default()))
    } else {
        store
    };
    let bench = Bench {
        idem: Idempotency::new(store),
        executions: Arc::new(AtomicU64::new(0)),
        namespace,
    };
    // new: fresh keys past the replay pool.
    let started = Instant::now();
    let mut latencies = bench.timed(seconds, |i| POOL as u64 + i, false).await;
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(
        bench.executions.load(Ordering::Relaxed),
        latencies.len() as u64
    );
    report("new", cache, &mut latencies, elapsed);
    // replay: the pool, run once, then in turn.
    for n in 0..POOL as u64 {
        bench.call(n).await;
    }
    let before = bench.executions.load(Ordering::Relaxed);
    let started = Instant::now();
    let mut latencies = bench.timed(seconds, |i| i % POOL as u64, true).await;
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(bench.executions.load(Ordering::Relaxed), before);
    report("replay", cache, &mut latencies, elapsed);
}

fn main() {
    let mut seconds = 5.0;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--seconds" => seconds = it.next().unwrap().parse().unwrap(),
            "--quick" => seconds = 1.0,
            _ => {} // cargo bench passes --bench
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let options = RedisOptions {
            prefix: "idem-bench-run-once:".into(),
            ..RedisOptions::default()
        };
        let store: SharedStore = Arc::new(RedisStore::connect(&url, options).await.unwrap());
        let run = format!(
            "{}-{}",
            std::process::id(),
            idem_core::Timestamp::now().as_millis()
        );
        for cache in [false, true] {
            scenarios(store.clone(), cache, seconds, &run).await;
        }
        // Deletes what the bench wrote.
        idem_testkit::services::forget_redis_keys(&url, "idem-bench-run-once:").await;
    });
}
