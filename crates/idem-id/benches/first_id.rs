//! Start to first Snowflake id: `cargo bench -p idem-id --bench first_id -- --rounds 5`.
//!
//! A process starts a `ManagedSnowflake` in an id space its store has known for longer than
//! the issue window, and asks for ids until it gets one. Measured as it is now (a worker id
//! never held issues at once) and as it was before (`WorkerPool::always_wait`: every claim
//! waits the whole window after its grant), in interleaved rounds, on SQLite and on the Redis
//! on loopback (skipped with a note if there is none).

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{SharedStore, SystemClock};
use idem_id::{IdError, Layout, ManagedSnowflake, SnowflakeOptions, WorkerPool};

/// How long a process takes from starting its generator to its first id.
async fn start_to_first_id(store: &SharedStore, space: &str, always_wait: bool) -> Duration {
    let pool =
        WorkerPool::new(store.clone(), Arc::new(SystemClock), space).always_wait(always_wait);
    let started = Instant::now();
    let g = ManagedSnowflake::start(pool, Layout::default(), SnowflakeOptions::default())
        .await
        .unwrap();
    loop {
        match g.try_next() {
            Ok(_) => break,
            Err(IdError::Starting { .. } | IdError::NoWorker { .. } | IdError::LeaseExpired) => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let took = started.elapsed();
    g.release().await.unwrap();
    took
}

fn summary(mut runs: Vec<Duration>) -> String {
    runs.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    format!(
        "median {:.1} ms (min {:.1}, max {:.1})",
        ms(runs[runs.len() / 2]),
        ms(runs[0]),
        ms(runs[runs.len() - 1])
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .map_or(5, |n| n.parse().unwrap());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = idem_store::SqliteStore::open(dir.path().join("ids.db")).unwrap();
        let mut stores: Vec<(&str, SharedStore)> = vec![("SQLite", Arc::new(sqlite))];
        if let Some(url) = idem_testkit::services::REDIS.url() {
            let options = idem_store::RedisOptions {
                prefix: "idem-bench:".into(),
                ..idem_store::RedisOptions::default()
            };
            let redis = idem_store::RedisStore::connect(&url, options)
                .await
                .unwrap();
            stores.push(("Redis", Arc::new(redis)));
        }
        for (name, store) in stores {
            // A space the store has known for longer than the window: its first start waits.
            let space = format!("bench-{:016x}", rand::random::<u64>());
            start_to_first_id(&store, &space, false).await;
            let (mut now, mut before) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                now.push(start_to_first_id(&store, &space, false).await);
                before.push(start_to_first_id(&store, &space, true).await);
            }
            println!(
                "{name}, start to first Snowflake id, {rounds} rounds: now {}; waiting the whole \
                 window (as before) {}",
                summary(now),
                summary(before)
            );
        }
    });
}
