//! Id generation cost: `cargo bench -p idem-id --bench ids`.
//!
//! Snowflake on the default layout, below its limit (one id per call, paced so the sequence
//! never runs out), at its limit (as fast as it will issue, 10 s), from two threads, and per
//! id of a 1,000-id batch; UUIDv7 beside the `uuid` crate's `now_v7`; and the peers `ulid` and
//! `rs-snowflake` in the same run.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_id::{Layout, Snowflake, SnowflakeOptions};

fn generator() -> Arc<Snowflake> {
    Arc::new(Snowflake::new(Layout::default(), 1, SnowflakeOptions::default()).unwrap())
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let secs = if quick { 1 } else { 10 };

    // Below the limit: 1,000 ids, then wait for the next millisecond, so no call borrows.
    let g = generator();
    let mut spent = Duration::ZERO;
    let mut n = 0u64;
    let until = Instant::now() + Duration::from_secs(secs.min(3));
    while Instant::now() < until {
        let t = Instant::now();
        for _ in 0..1000 {
            black_box(g.try_next().unwrap());
        }
        spent += t.elapsed();
        n += 1000;
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "snowflake, one thread, below the limit: {:.1} ns/id",
        spent.as_nanos() as f64 / n as f64
    );

    // At the limit: as many as it issues for `secs` seconds.
    let g = generator();
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        for _ in 0..1000 {
            black_box(g.next().unwrap());
        }
        n += 1000;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let limit = Layout::default().ids_per_second() as f64;
    println!(
        "snowflake, one thread, at the limit for {secs} s: {rate:.0} ids/s = {:.1}% of the layout's {limit:.0}",
        rate / limit * 100.0
    );

    // Two threads, below the limit together.
    let g = generator();
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let g = g.clone();
            std::thread::spawn(move || {
                let mut spent = Duration::ZERO;
                for _ in 0..1000 {
                    let t = Instant::now();
                    for _ in 0..1000 {
                        black_box(g.try_next().unwrap());
                    }
                    spent += t.elapsed();
                    std::thread::sleep(Duration::from_millis(1));
                }
                spent
            })
        })
        .collect();
    let spent: Duration = threads.into_iter().map(|t| t.join().unwrap()).sum();
    println!(
        "snowflake, two threads: {:.1} ns/id per thread",
        spent.as_nanos() as f64 / 2_000_000.0
    );

    // Batches of 1,000.
    let g = generator();
    let mut spent = Duration::ZERO;
    for _ in 0..1000 {
        let t = Instant::now();
        for id in g.try_next_batch(1000).unwrap() {
            black_box(id);
        }
        spent += t.elapsed();
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "snowflake, batches of 1,000: {:.2} ns/id",
        spent.as_nanos() as f64 / 1_000_000.0
    );

    // UUIDv7: idem's generator against the uuid crate's `now_v7`, same run.
    let n = 2_000_000u32;
    let t = Instant::now();
    for _ in 0..n {
        black_box(idem_id::uuid7());
    }
    let ours = t.elapsed().as_nanos() as f64 / f64::from(n);
    let t = Instant::now();
    for _ in 0..n {
        black_box(uuid::Uuid::now_v7());
    }
    let theirs = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!(
        "uuid7: idem {ours:.1} ns/id, uuid::Uuid::now_v7 {theirs:.1} ns/id: {:.1}x",
        theirs / ours
    );

    // Peers in the same run: ulid's monotonic generator, and rs-snowflake's default
    // generator (which waits for the next millisecond when a sequence is used up).
    let mut ulids = ulid::Generator::new();
    let t = Instant::now();
    for _ in 0..n {
        black_box(ulids.generate().unwrap());
    }
    let ulid_ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!("ulid::Generator::generate: {ulid_ns:.1} ns/id (idem's uuid7: {ours:.1})");
    let mut rs = snowflake::SnowflakeIdGenerator::new(1, 1);
    let t = Instant::now();
    for _ in 0..n {
        black_box(rs.generate());
    }
    let rs_ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!(
        "rs-snowflake generate: {rs_ns:.1} ns/id = {:.0} ids/s",
        1e9 / rs_ns
    );

    // Segment ids served from memory, one thread (ranges of 1,000,000 from a memory store).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store: idem_core::SharedStore = Arc::new(idem_store::MemoryStore::new());
    let options = idem_id::SegmentOptions {
        initial_step: 1_000_000,
        min_step: 1_000_000,
        max_step: 1_000_000,
        ..idem_id::SegmentOptions::default()
    };
    let segments = idem_id::Segments::new(store, "bench", options).unwrap();
    let (n, elapsed) = runtime.block_on(async {
        segments.next().await.unwrap();
        let n = 20_000_000u64;
        let t = Instant::now();
        for _ in 0..n {
            match segments.try_next() {
                Some(id) => {
                    black_box(id);
                }
                None => {
                    black_box(segments.next().await.unwrap());
                }
            }
        }
        (n, t.elapsed())
    });
    println!(
        "segment ids, one thread: {:.1} ns/id = {:.0} ids/s",
        elapsed.as_nanos() as f64 / n as f64,
        n as f64 / elapsed.as_secs_f64()
    );
}
