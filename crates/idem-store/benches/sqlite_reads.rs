//! Replays on SQLite through the writer against on read connections, in one run.
//!
//! Two stores on files of their own, the same but for `read_connections` (0: every `begin`
//! goes through the writer thread; 2: a replay is read on a read connection and never reaches
//! the writer). Each holds 1,000 completed records. Per round, for each store:
//!
//! - `replays alone`: 32 tasks replaying those keys;
//! - `replays beside new keys`: the same 32 tasks while 32 others `begin`+`complete` fresh keys
//!   (what the writer's commits, `synchronous = FULL`, cost a replay that queues behind them).
//!
//! `cargo bench -p idem-store --bench sqlite_reads -- [--seconds N] [--rounds N]`

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idem_core::{BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Store, Timestamp};
use idem_store::{SqliteOptions, SqliteStore};

const KEYS: usize = 1000;
const TASKS: usize = 32;

fn req(k: &str) -> BeginRequest {
    BeginRequest::new(
        Key::parse("bench", "pay", k).unwrap(),
        Fingerprint::of_bytes(b"request"),
    )
}

async fn pair(store: &SqliteStore, k: &str) {
    let r = req(k);
    let BeginOutcome::Acquired(lease) = store.begin(&r, Timestamp::now()).await.unwrap() else {
        panic!("a fresh key was not acquired")
    };
    let answer = Bytes::from_static(b"{\"id\":\"ch_1\",\"status\":\"succeeded\"}");
    store
        .complete(&r.key, &lease, answer, Timestamp::now())
        .await
        .unwrap();
}

struct Row {
    replays_per_s: f64,
    p50_us: u64,
    p99_us: u64,
    pairs_per_s: f64,
}

async fn measure(store: &SqliteStore, seconds: u64, beside: bool, tag: &str) -> Row {
    let stop = Arc::new(AtomicBool::new(false));
    let replays: Vec<_> = (0..TASKS)
        .map(|t| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = t * 31;
                while !stop.load(Ordering::Relaxed) {
                    let r = req(&format!("warm-{}", i % KEYS));
                    let started = Instant::now();
                    let out = store.begin(&r, Timestamp::now()).await.unwrap();
                    latencies.push(u64::try_from(started.elapsed().as_micros()).unwrap());
                    assert!(matches!(out, BeginOutcome::Replay(_)));
                    i += 1;
                }
                latencies
            })
        })
        .collect();
    let writers: Vec<_> = (0..if beside { TASKS } else { 0 })
        .map(|t| {
            let (store, stop, tag) = (store.clone(), stop.clone(), tag.to_owned());
            tokio::spawn(async move {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    pair(&store, &format!("{tag}-{t}-{n}")).await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in replays {
        all.extend(t.await.unwrap());
    }
    let mut pairs = 0;
    for t in writers {
        pairs += t.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: usize| all[(all.len() * q / 1000).min(all.len() - 1)];
    Row {
        replays_per_s: all.len() as f64 / elapsed,
        p50_us: at(500),
        p99_us: at(990),
        pairs_per_s: pairs as f64 / elapsed,
    }
}

fn main() {
    let (mut seconds, mut rounds) = (3, 3);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--seconds" => seconds = it.next().unwrap().parse().unwrap(),
            "--rounds" => rounds = it.next().unwrap().parse().unwrap(),
            "--quick" => (seconds, rounds) = (1, 1),
            _ => {} // cargo bench passes --bench
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stores: Vec<(&str, SqliteStore)> = [("through the writer", 0), ("read connections", 2)]
        .into_iter()
        .map(|(name, reads)| {
            let mut options = SqliteOptions::default();
            options.read_connections = reads;
            let path = dir.path().join(format!("reads-{reads}.db"));
            (name, SqliteStore::open_with(path, options).unwrap())
        })
        .collect();
    runtime.block_on(async {
        for (_, store) in &stores {
            for k in 0..KEYS {
                pair(store, &format!("warm-{k}")).await;
            }
        }
    });
    println!("SQLite replays: {TASKS} replaying tasks, {seconds} s per row, {rounds} rounds\n");
    println!("| round | replays | load | replays/s | p50 (µs) | p99 (µs) | new pairs/s |");
    println!("|---|---|---|---:|---:|---:|---:|");
    for round in 1..=rounds {
        for beside in [false, true] {
            for (name, store) in &stores {
                let tag = format!("r{round}-{}", name.len());
                let row = runtime.block_on(measure(store, seconds, beside, &tag));
                let load = if beside { "beside new keys" } else { "alone" };
                let pairs = if beside {
                    format!("{:.0}", row.pairs_per_s)
                } else {
                    "–".into()
                };
                println!(
                    "| {round} | {name} | {load} | {:.0} | {} | {} | {pairs} |",
                    row.replays_per_s, row.p50_us, row.p99_us
                );
            }
        }
    }
}
