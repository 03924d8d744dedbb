//! The operator's view of the Redis store over a large keyspace: a page of 100 records, and a
//! count of every record, over 1,000,000 records.
//!
//! `cargo bench -p idem-store --features redis --bench listing_redis` (`-- --records N` for another
//! size, `-- --rounds N` for more rounds). Runs its own `redis-server` on a free loopback port
//! (so the project's Redis keeps its keyspace), and is skipped with a note without one.
//!
//! The records: a `begin` on each of N keys (64 tasks), every other one then completed with a
//! 20-byte response, and 1 in 100 in a scope of its own ("rare"), so that a filter on that scope
//! shows how a narrow filter pages. Each round, interleaved: pages of 100 with no filter, followed
//! from the start; pages of 100 of the rare scope, followed to the end; a count of every record;
//! a count with a response-prefix filter.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Cursor, Fingerprint, Key, RecordAdmin, RecordFilter, Scope,
    Store, Timestamp,
};
use idem_store::{RedisOptions, RedisStore};

/// A `redis-server` of this bench's own, stopped when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server() -> Option<(Server, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .ok()?;
    let server = Server(child);
    let url = format!("redis://127.0.0.1:{port}");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some((server, url));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn fill(store: &RedisStore, records: usize) {
    let tasks = 64;
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let fp = Fingerprint::of_bytes(b"request");
                for i in (t..records).step_by(tasks) {
                    let scope = if i % 100 == 0 { "rare" } else { "tenant" };
                    let key = Key::parse(scope, "pay", &format!("k{i}")).unwrap();
                    let req = BeginRequest::new(key.clone(), fp)
                        .with_ttl(Duration::from_secs(24 * 3600))
                        .with_lease(Duration::from_secs(3600));
                    let now = Timestamp::now();
                    let BeginOutcome::Acquired(lease) = store.begin(&req, now).await.unwrap()
                    else {
                        panic!("a fresh key not acquired");
                    };
                    if i % 2 == 0 {
                        let response = Bytes::from_static(b"IDH1\x00{\"status\":\"ok\"}");
                        store.complete(&key, &lease, response, now).await.unwrap();
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
}

/// Pages of 100 matching `filter`, from the start, up to `pages` of them (every page if
/// `None`): the time of each, and the records seen.
async fn pages(
    admin: &dyn RecordAdmin,
    filter: &RecordFilter,
    pages: Option<usize>,
) -> (Vec<Duration>, usize) {
    let mut times = Vec::new();
    let mut seen = 0;
    let mut after: Option<Cursor> = None;
    while pages.is_none_or(|p| times.len() < p) {
        let started = Instant::now();
        let page = admin
            .list(filter, after.as_ref(), 100, Timestamp::now())
            .await
            .unwrap();
        times.push(started.elapsed());
        seen += page.records.len();
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    (times, seen)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let records = arg("--records", 1_000_000);
    let rounds = arg("--rounds", 3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let Some((_server, url)) = start_server() else {
        println!("skipped: cannot run redis-server");
        return;
    };
    runtime.block_on(async {
        let store = RedisStore::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let started = Instant::now();
        fill(&store, records).await;
        println!(
            "filled {records} records in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let admin = store.admin().unwrap();
        let all = RecordFilter::default();
        let rare = RecordFilter {
            scope: Some(Scope::new("rare").unwrap()),
            ..RecordFilter::default()
        };
        let unknown = RecordFilter {
            response_prefix: Some(Bytes::from_static(b"IDH1\x00")),
            ..RecordFilter::default()
        };
        for round in 1..=rounds {
            let (times, seen) = pages(admin, &all, Some(200)).await;
            let mean = times.iter().sum::<Duration>() / u32::try_from(times.len()).unwrap();
            println!(
                "round {round}: page of 100, no filter: mean {} (min {}, max {}) over {} pages, {seen} records",
                ms(mean),
                ms(*times.iter().min().unwrap()),
                ms(*times.iter().max().unwrap()),
                times.len()
            );
            let started = Instant::now();
            let (times, seen) = pages(admin, &rare, None).await;
            println!(
                "round {round}: scope of 1%, every page: {} pages, {seen} records, {} in all, mean {} a page",
                times.len(),
                ms(started.elapsed()),
                ms(started.elapsed() / u32::try_from(times.len()).unwrap())
            );
            let started = Instant::now();
            let counts = admin.count(&all, Timestamp::now()).await.unwrap();
            println!(
                "round {round}: count of every record: {} ({} records)",
                ms(started.elapsed()),
                counts.total()
            );
            let started = Instant::now();
            let counts = admin.count(&unknown, Timestamp::now()).await.unwrap();
            println!(
                "round {round}: count with a response prefix: {} ({} records)",
                ms(started.elapsed()),
                counts.total()
            );
        }
    });
}
