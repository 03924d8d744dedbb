//! The operator's view of a large SQLite store: a page of 100 records at the start and near the
//! end of a 1,000,000-record table, a narrow filter, a count of every record by state, and
//! `begin`+`complete` while a count runs (listings and counts read on their own connection, so
//! the writer goes on).
//!
//! `cargo bench -p idem-store --bench listing_sqlite` (add `-- --quick` for 100,000 records).
//!
//! The table is filled directly (one transaction) with records in every state: of every ten,
//! six completed (one completed record in a thousand carries the HTTP layer's unknown-outcome
//! mark), one released, one running, one stuck and one expired. Rounds interleave the cases;
//! each figure is the min–max over the rounds.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Cursor, Fingerprint, Key, RecordAdmin, RecordFilter, Scope,
    Store, Timestamp,
};
use idem_store::{SqliteOptions, SqliteStore, Synchronous};

const ROUNDS: usize = 7;
const PAGE: usize = 100;
const UNKNOWN: &[u8] = b"IDH1\x01";

fn client_key(i: usize) -> String {
    format!("k{i:07}")
}

/// Fills the table with `n` records, as seen at `now`.
fn fill(store: &SqliteStore, n: usize, now: u64) {
    let mut conn = rusqlite::Connection::open(store.path()).unwrap();
    let tx = conn.transaction().unwrap();
    {
        let mut insert = tx
            .prepare(
                "INSERT INTO idem_records (scope, namespace, client_key, fingerprint, status,
                     fence, lease_id, lease_expires_at, response, ttl_ms, created_at,
                     updated_at, expires_at)
                 VALUES ('bench', 'pay', ?1, ?2, ?3, 1, ?4, ?5, ?6, 86400000, ?7, ?8, ?9)",
            )
            .unwrap();
        let fp = Fingerprint::of_bytes(b"request");
        let hour: i64 = 3_600_000;
        let at = i64::try_from(now).unwrap() - hour;
        let future = at + 2 * hour;
        for i in 0..n {
            let mut response = vec![b'x'; 64];
            if i % 1000 == 1 {
                response[..UNKNOWN.len()].copy_from_slice(UNKNOWN);
            }
            let (status, lease_expires_at, response, expires_at) = match i % 10 {
                0..=5 => ("completed", at + 60_000, Some(response), future),
                6 => ("released", at + 60_000, None, future),
                7 => ("in_progress", future, None, future + hour),
                8 => ("in_progress", at + 60_000, None, future),
                _ => ("completed", at + 60_000, Some(response), at + 1),
            };
            insert
                .execute(rusqlite::params![
                    client_key(i),
                    &fp.as_bytes()[..],
                    status,
                    &[7u8; 16][..],
                    lease_expires_at,
                    response,
                    at,
                    at,
                    expires_at,
                ])
                .unwrap();
        }
    }
    tx.commit().unwrap();
    conn.pragma_update(None, "wal_checkpoint", "TRUNCATE")
        .unwrap();
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn range(v: &[Duration]) -> String {
    let min = v.iter().min().copied().unwrap_or_default();
    let max = v.iter().max().copied().unwrap_or_default();
    format!("{} – {}", ms(min), ms(max))
}

async fn timed<T>(f: impl Future<Output = T>) -> (Duration, T) {
    let t0 = Instant::now();
    let out = f.await;
    (t0.elapsed(), out)
}

/// `begin`+`complete` on fresh keys, one after another, until `until` is done: the median
/// and the slowest pair.
async fn pairs_while(
    store: &SqliteStore,
    round: usize,
    until: impl Future,
) -> (Duration, Duration) {
    let mut until = std::pin::pin!(until);
    let mut times = Vec::new();
    loop {
        let key = Key::parse("other", "pairs", &format!("r{round}-{}", times.len())).unwrap();
        let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"r"));
        let t0 = Instant::now();
        let pair = async {
            let now = Timestamp::now();
            let BeginOutcome::Acquired(lease) = store.begin(&req, now).await.unwrap() else {
                panic!("fresh key not acquired")
            };
            store
                .complete(&key, &lease, Bytes::from_static(b"ok"), now)
                .await
                .unwrap();
        };
        tokio::select! {
            () = pair => times.push(t0.elapsed()),
            _ = &mut until => break,
        }
    }
    times.sort_unstable();
    let median = times.get(times.len() / 2).copied().unwrap_or_default();
    (median, times.last().copied().unwrap_or_default())
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let n = if quick { 100_000 } else { 1_000_000 };
    let dir = tempfile::tempdir().unwrap();
    let mut options = SqliteOptions::default();
    options.synchronous = Synchronous::Normal;
    let store = SqliteStore::open_with(dir.path().join("idem.db"), options).unwrap();
    let now = Timestamp::now();
    let t0 = Instant::now();
    fill(&store, n, now.as_millis());
    println!(
        "listing bench: {n} records filled in {:.1} s; {ROUNDS} rounds, min – max\n",
        t0.elapsed().as_secs_f64()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let admin: &dyn RecordAdmin = store.admin().unwrap();
    let everything = RecordFilter::default();
    let scoped = RecordFilter {
        scope: Some(Scope::new("bench").unwrap()),
        ..RecordFilter::default()
    };
    let unknown = RecordFilter {
        response_prefix: Some(Bytes::from_static(UNKNOWN)),
        ..RecordFilter::default()
    };
    let near_end = Cursor::After(Key::parse("bench", "pay", &client_key(n - 2 * PAGE)).unwrap());
    let cases: [(&str, &RecordFilter, Option<&Cursor>); 4] = [
        ("page of 100, first", &everything, None),
        ("page of 100, near the end", &everything, Some(&near_end)),
        (
            "page of 100, near the end, one scope",
            &scoped,
            Some(&near_end),
        ),
        (
            "page of 100 unknown outcomes (1 record in 1,000)",
            &unknown,
            None,
        ),
    ];
    let mut pages = vec![Vec::new(); cases.len()];
    let mut counts = Vec::new();
    // The median and the slowest pair of each round, alone and beside a count.
    let mut alone = (Vec::new(), Vec::new());
    let mut beside = (Vec::new(), Vec::new());
    rt.block_on(async {
        for round in 0..ROUNDS {
            for (i, (_, filter, after)) in cases.iter().enumerate() {
                let (d, page) = timed(admin.list(filter, *after, PAGE, now)).await;
                assert_eq!(page.unwrap().records.len(), PAGE);
                pages[i].push(d);
            }
            let (d, c) = timed(admin.count(&everything, now)).await;
            assert!(c.unwrap().total() >= n as u64);
            counts.push(d);
            let idle = tokio::time::sleep(Duration::from_millis(300));
            let (median, slowest) = pairs_while(&store, 2 * round, idle).await;
            alone.0.push(median);
            alone.1.push(slowest);
            let counting = admin.count(&everything, now);
            let (median, slowest) = pairs_while(&store, 2 * round + 1, counting).await;
            beside.0.push(median);
            beside.1.push(slowest);
        }
    });
    println!("| operation | time (min – max) |");
    println!("|---|---|");
    for ((name, ..), times) in cases.iter().zip(&pages) {
        println!("| {name} | {} |", range(times));
    }
    println!("| count by state, every record | {} |", range(&counts));
    for (name, (median, slowest)) in [
        ("alone, for 300 ms", &alone),
        ("while a count runs", &beside),
    ] {
        println!(
            "| begin+complete {name}: median; slowest | {}; {} |",
            range(median),
            range(slowest)
        );
    }
}
