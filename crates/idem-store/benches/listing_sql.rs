//! The operator's view on a large table: how long a page of 100 records and a count take on a
//! table of a million records, PostgreSQL and MySQL/MariaDB.
//!
//! `cargo bench -p idem-store --features postgres,mysql --bench listing_sql` (`-- --only postgres`
//! or `mysql` for one server, `-- --rows N` for another table size). A server is measured when
//! it answers at the test URL (`idem_testkit::services`), and skipped with a note otherwise.
//!
//! The table is filled by one bulk `INSERT … SELECT` (a series of numbers) straight into the
//! store's own table: one scope and namespace, client keys `k0000001` on, every 10,000th record
//! stuck (in progress, its lease run out), the rest completed. Then, in rounds, each case runs
//! once per round, interleaved: the first page; a page from a cursor nine tenths in; a page of
//! stuck records (few: the key index is read past every other record); a count by state.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use idem_core::{
    Cursor, Key, RecordAdmin, RecordFilter, RecordState, Store, StoreError, Timestamp,
};
use idem_store::{MySqlOptions, MySqlStore, PostgresOptions, PostgresStore};
use idem_testkit::services::{MYSQL, POSTGRES};
use sqlx::AssertSqlSafe;

const TABLE: &str = "idem_bench_listing";
const ROUNDS: usize = 7;
const PAGE: usize = 100;
/// One record in this many is stuck.
const STUCK_EVERY: u64 = 10_000;
const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let only = arg("--only");
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let rows: u64 = arg("--rows").map_or(1_000_000, |r| r.parse().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("listing bench: {rows} records, pages of {PAGE}, {ROUNDS} rounds (min–max)\n");
    println!(
        "| server | first page | page from key {} | stuck page ({} stuck) | count |",
        rows * 9 / 10,
        rows / STUCK_EVERY
    );
    println!("|---|---|---|---|---|");
    match POSTGRES.url().filter(|_| wanted("postgres")) {
        Some(url) => rt.block_on(postgres(&url, rows)),
        None => println!("postgres: skipped (no server, or not asked for)"),
    }
    match MYSQL.url().filter(|_| wanted("mysql")) {
        Some(url) => rt.block_on(mysql(&url, rows)),
        None => println!("mysql: skipped (no server, or not asked for)"),
    }
}

async fn postgres(url: &str, rows: u64) {
    let options = PostgresOptions {
        table: TABLE.into(),
        ..PostgresOptions::default()
    };
    let store = PostgresStore::connect_with(url, options).await.unwrap();
    let pool = store.pool();
    let now = Timestamp::now();
    let ms = i64::try_from(now.as_millis()).unwrap();
    let started = Instant::now();
    exec(pool, &format!("TRUNCATE {TABLE}")).await;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {TABLE} (scope, namespace, client_key, fingerprint, status, fence,
             lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at, expires_at,
             purge_after)
         SELECT 'bench', 'pay', 'k' || lpad(i::text, 7, '0'), decode(repeat('00', 32), 'hex'),
             CASE WHEN i % {STUCK_EVERY} = 0 THEN 'in_progress' ELSE 'completed' END, 1,
             decode(repeat('00', 16), 'hex'), $1 - {HOUR_MS} + 30000,
             CASE WHEN i % {STUCK_EVERY} = 0 THEN NULL ELSE '{{\"status\":\"sent\"}}'::bytea END,
             {DAY_MS}, $1 - {HOUR_MS}, $1 - {HOUR_MS} + 10,
             CASE WHEN i % {STUCK_EVERY} = 0 THEN $1 - {HOUR_MS} + 30000 + {DAY_MS}
                  ELSE $1 - {HOUR_MS} + 10 + {DAY_MS} END,
             $1 - {HOUR_MS} + 30000 + {DAY_MS}
         FROM generate_series(1, $2) AS i"
    )))
    .bind(ms)
    .bind(i64::try_from(rows).unwrap())
    .execute(pool)
    .await
    .unwrap();
    exec(pool, &format!("VACUUM ANALYZE {TABLE}")).await;
    println!(
        "(postgres: filled in {:.1} s)",
        started.elapsed().as_secs_f64()
    );
    measure("postgres", &store, rows, now).await;
    for t in ["", "_migrations", "_counters", "_locks"] {
        exec(pool, &format!("DROP TABLE IF EXISTS {TABLE}{t}")).await;
    }
}

async fn mysql(url: &str, rows: u64) {
    let options = MySqlOptions {
        table: TABLE.into(),
        ..MySqlOptions::default()
    };
    let store = MySqlStore::connect_with(url, options).await.unwrap();
    let pool = store.pool();
    let now = Timestamp::now();
    let ms = i64::try_from(now.as_millis()).unwrap();
    let started = Instant::now();
    exec(pool, &format!("TRUNCATE {TABLE}")).await;
    // 0 to 99,999 from five tables of digits; filled 100,000 rows a statement, in key order.
    let digit = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
        UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
        UNION ALL SELECT 8 UNION ALL SELECT 9)";
    let numbers = format!(
        "SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n
         FROM {digit} a, {digit} b, {digit} c, {digit} e, {digit} f"
    );
    for base in (0..rows).step_by(100_000) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {TABLE} (scope, namespace, client_key, fingerprint, status, fence,
                 lease_id, lease_expires_at, response, ttl_ms, created_at, updated_at,
                 expires_at, purge_after)
             SELECT 'bench', 'pay', CONCAT('k', LPAD(i, 7, '0')), UNHEX(REPEAT('00', 32)),
                 IF(i % {STUCK_EVERY} = 0, 'in_progress', 'completed'), 1,
                 UNHEX(REPEAT('00', 16)), ? - {HOUR_MS} + 30000,
                 IF(i % {STUCK_EVERY} = 0, NULL, '{{\"status\":\"sent\"}}'), {DAY_MS},
                 ? - {HOUR_MS}, ? - {HOUR_MS} + 10,
                 IF(i % {STUCK_EVERY} = 0, ? - {HOUR_MS} + 30000 + {DAY_MS},
                    ? - {HOUR_MS} + 10 + {DAY_MS}),
                 ? - {HOUR_MS} + 30000 + {DAY_MS}
             FROM (SELECT n + ? + 1 AS i FROM ({numbers}) ns) s
             WHERE i <= ? ORDER BY i"
        )))
        .bind(ms)
        .bind(ms)
        .bind(ms)
        .bind(ms)
        .bind(ms)
        .bind(ms)
        .bind(i64::try_from(base).unwrap())
        .bind(i64::try_from(rows).unwrap())
        .execute(pool)
        .await
        .unwrap();
    }
    exec(pool, &format!("ANALYZE TABLE {TABLE}")).await;
    println!(
        "(mysql: filled in {:.1} s)",
        started.elapsed().as_secs_f64()
    );
    measure("mysql", &store, rows, now).await;
    for t in ["", "_migrations", "_counters"] {
        exec(pool, &format!("DROP TABLE IF EXISTS {TABLE}{t}")).await;
    }
}

async fn exec<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, sql: &str)
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap();
}

/// Times each case once per round, the cases interleaved, and prints one row of min–max.
async fn measure<S: Store>(name: &str, store: &S, rows: u64, now: Timestamp) {
    let admin = store.admin().unwrap();
    let near_end =
        Cursor::After(Key::parse("bench", "pay", &format!("k{:07}", rows * 9 / 10)).unwrap());
    let stuck = RecordFilter {
        state: Some(RecordState::Stuck),
        ..RecordFilter::default()
    };
    let all = RecordFilter::default();
    let mut times: [Vec<Duration>; 4] = Default::default();
    for _ in 0..ROUNDS {
        times[0].push(page(admin, &all, None, now).await);
        times[1].push(page(admin, &all, Some(&near_end), now).await);
        times[2].push(page(admin, &stuck, None, now).await);
        let t0 = Instant::now();
        let counts = admin.count(&all, now).await.unwrap();
        times[3].push(t0.elapsed());
        assert_eq!(counts.total(), rows);
        assert_eq!(counts.stuck, rows / STUCK_EVERY);
    }
    let cells: Vec<String> = times.iter().map(|t| span(t)).collect();
    println!("| {name} | {} |", cells.join(" | "));
}

async fn page(
    admin: &dyn RecordAdmin,
    filter: &RecordFilter,
    after: Option<&Cursor>,
    now: Timestamp,
) -> Duration {
    let t0 = Instant::now();
    let page: Result<_, StoreError> = admin.list(filter, after, PAGE, now).await;
    let took = t0.elapsed();
    let page = page.unwrap();
    assert!(!page.records.is_empty());
    took
}

fn span(times: &[Duration]) -> String {
    let min = times.iter().min().copied().unwrap_or_default();
    let max = times.iter().max().copied().unwrap_or_default();
    format!("{:.2}–{:.2} ms", ms(min), ms(max))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
