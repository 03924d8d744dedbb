//! Inbox mode on real PostgreSQL and MariaDB: the business write and the record commit
//! together, so duplicates, failures after the write and a consumer dying before its commit
//! all leave exactly one effect per message key.

use std::time::Duration;

use futures_util::future::BoxFuture;
use idem_mq::inbox::{Inbox, InboxFn, inbox_fn};
use idem_mq::memory::Queue;
use idem_mq::{Consumer, Failure, Message, Source};
use sqlx::{Postgres, Transaction};

/// Table names are the tests' own random suffixes, never outside input.
fn sql(text: String) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(text)
}

const PATIENCE: Duration = Duration::from_secs(30);

fn suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

type PgInbox = InboxFn<
    Box<
        dyn for<'t> Fn(
                &'t mut Transaction<'static, Postgres>,
                Message,
            ) -> BoxFuture<'t, Result<u32, Failure<String>>>
            + Send
            + Sync,
    >,
>;

/// A handler that inserts one effect row per run, then fails retryably on the first
/// delivery of ids ending in `-f`, after its write (which must roll back).
fn effects_handler(table: String) -> PgInbox {
    inbox_fn(Box::new(
        move |tx: &mut Transaction<'static, Postgres>, m: Message| {
            let table = table.clone();
            Box::pin(async move {
                let id = m.message_id.clone().unwrap_or_default();
                sqlx::query(sql(format!("INSERT INTO {table} (id) VALUES ($1)")))
                    .bind(&id)
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Failure::Retry(e.to_string()))?;
                if id.ends_with("-f") && m.attempt == 1 {
                    return Err(Failure::Retry("failed after the write".to_owned()));
                }
                Ok(m.attempt)
            })
        },
    ))
}

async fn pg_store(url: &str, name: &str) -> idem::PostgresStore {
    let options = idem::PostgresOptions {
        table: format!("idem_mq_{name}"),
        ..idem::PostgresOptions::default()
    };
    idem::PostgresStore::connect_with(url, options)
        .await
        .expect("connect")
}

/// A PostgreSQL store with tables of its own, and an effects table beside it: the store, the
/// tables' suffix, the effects table's name.
async fn pg_with_effects(url: &str) -> (idem::PostgresStore, String, String) {
    let name = suffix();
    let store = pg_store(url, &name).await;
    let table = format!("effects_{name}");
    sqlx::query(sql(format!("CREATE TABLE {table} (id TEXT NOT NULL)")))
        .execute(store.pool())
        .await
        .expect("create");
    (store, name, table)
}

/// Drops what [`pg_with_effects`] created.
async fn drop_pg_tables(store: &idem::PostgresStore, name: &str, table: &str) {
    sqlx::query(sql(format!("DROP TABLE {table}, idem_mq_{name}")))
        .execute(store.pool())
        .await
        .expect("drop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_failures_after_the_write_leave_one_effect_per_key_on_postgres() {
    let Some(url) = idem_testkit::services::POSTGRES.url() else {
        return;
    };
    let (store, name, table) = pg_with_effects(&url).await;

    let q = Queue::new("stock");
    for i in 0..120 {
        let id = if i % 7 == 0 {
            format!("m-{i}-f")
        } else {
            format!("m-{i}")
        };
        q.publish(Some(&id), b"{}".as_slice());
        if i % 10 < 3 {
            q.publish(Some(&id), b"{}".as_slice());
        }
    }
    let consumer = Consumer::new(store.clone())
        .concurrency(8)
        .backoff(Duration::from_millis(10), Duration::from_millis(50));
    tokio::time::timeout(
        PATIENCE,
        consumer.run(
            q.source(),
            Inbox::new(store.clone(), effects_handler(table.clone())),
            q.clone().drained(),
        ),
    )
    .await
    .expect("drains")
    .expect("runs");

    let rows: Vec<(String, i64)> =
        sqlx::query_as(sql(format!("SELECT id, COUNT(*) FROM {table} GROUP BY id")))
            .fetch_all(store.pool())
            .await
            .expect("select");
    assert_eq!(rows.len(), 120, "every id has its effect");
    assert!(rows.iter().all(|(_, n)| *n == 1), "and only one: {rows:?}");
    assert!(q.dead_letters().is_empty());
    drop_pg_tables(&store, &name, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dying_before_its_commit_leaves_nothing_and_the_redelivery_runs_once() {
    let Some(url) = idem_testkit::services::POSTGRES.url() else {
        return;
    };
    let (store, name, table) = pg_with_effects(&url).await;
    let q = Queue::new("stock");
    q.publish(Some("dies"), b"{}".as_slice());

    // The first delivery writes, then hangs until its consumer is gone.
    let t = table.clone();
    let hangs = inbox_fn(move |tx: &mut Transaction<'static, Postgres>, m: Message| {
        let t = t.clone();
        Box::pin(async move {
            sqlx::query(sql(format!("INSERT INTO {t} (id) VALUES ($1)")))
                .bind(m.message_id.unwrap_or_default())
                .execute(&mut **tx)
                .await
                .map_err(|e| Failure::Retry(e.to_string()))?;
            std::future::pending::<()>().await;
            Ok::<u32, Failure<String>>(0)
        })
    });
    let consumer = Consumer::new(store.clone()).lease(Duration::from_millis(500));
    let mut source = q.source();
    let d = source.next().await.expect("open").expect("delivery");
    let died = tokio::time::timeout(
        Duration::from_millis(300),
        consumer.process(&source, d, &Inbox::new(store.clone(), hangs)),
    )
    .await;
    assert!(died.is_err(), "the consumer died mid-handler");

    let d = source.next().await.expect("open").expect("redelivered");
    let outcome = tokio::time::timeout(
        PATIENCE,
        consumer.process(
            &source,
            d,
            &Inbox::new(store.clone(), effects_handler(table.clone())),
        ),
    )
    .await
    .expect("in time")
    .expect("process");
    assert_eq!(outcome, idem_mq::Outcome::Handled);
    let n: i64 = sqlx::query_scalar(sql(format!("SELECT COUNT(*) FROM {table}")))
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(n, 1, "the dead attempt's write rolled back");
    drop_pg_tables(&store, &name, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_leave_one_effect_per_key_on_mariadb() {
    let Some(url) = idem_testkit::services::MYSQL.url() else {
        return;
    };
    let name = suffix();
    let options = idem::MySqlOptions {
        table: format!("idem_mq_{name}"),
        ..idem::MySqlOptions::default()
    };
    let store = idem::MySqlStore::connect_with(&url, options)
        .await
        .expect("connect");
    let table = format!("effects_{name}");
    sqlx::query(sql(format!(
        "CREATE TABLE {table} (id VARCHAR(64) NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .expect("create");
    let q = Queue::new("stock");
    for i in 0..60 {
        let id = format!("m-{i}");
        q.publish(Some(&id), b"{}".as_slice());
        q.publish(Some(&id), b"{}".as_slice());
    }
    let t = table.clone();
    let handler = inbox_fn(
        move |tx: &mut Transaction<'static, sqlx::MySql>, m: Message| {
            let t = t.clone();
            Box::pin(async move {
                sqlx::query(sql(format!("INSERT INTO {t} (id) VALUES (?)")))
                    .bind(m.message_id.unwrap_or_default())
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Failure::Retry(e.to_string()))?;
                Ok::<_, Failure<String>>(())
            })
        },
    );
    let consumer = Consumer::new(store.clone())
        .concurrency(8)
        .backoff(Duration::from_millis(10), Duration::from_millis(50));
    tokio::time::timeout(
        PATIENCE,
        consumer.run(
            q.source(),
            Inbox::new(store.clone(), handler),
            q.clone().drained(),
        ),
    )
    .await
    .expect("drains")
    .expect("runs");
    let dupes: i64 = sqlx::query_scalar(sql(format!(
        "SELECT COUNT(*) FROM (SELECT id FROM {table} GROUP BY id HAVING COUNT(*) > 1) d"
    )))
    .fetch_one(store.pool())
    .await
    .expect("count");
    let all: i64 = sqlx::query_scalar(sql(format!("SELECT COUNT(*) FROM {table}")))
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!((all, dupes), (60, 0));
    sqlx::query(sql(format!("DROP TABLE {table}, idem_mq_{name}")))
        .execute(store.pool())
        .await
        .expect("drop");
}
