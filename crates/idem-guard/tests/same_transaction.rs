//! A guard's outcome stored as the idempotency record's response in the same transaction as
//! the guarded write: a retry replays it (a permanent "insufficient stock" included), and a
//! transaction that does not commit leaves neither the write nor the record.

#![allow(clippy::unwrap_used)]

use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, Timestamp};
use idem_guard::{Bounded, Counter};
use idem_store::{PostgresOptions, PostgresStore};

fn fresh(prefix: &str) -> String {
    use std::hash::{BuildHasher, RandomState};
    let n = RandomState::new().hash_one(std::process::id()) & 0xffff_ffff;
    format!("idem_guard_{prefix}_{n:08x}")
}

/// Deducts `n` of `sku` for `order` once: the first attempt runs the guard and completes the
/// record in one transaction; every retry gets the stored outcome.
async fn deduct(
    store: &PostgresStore,
    stock: &Counter,
    order: &str,
    n: i64,
    commit: bool,
) -> Bounded {
    let key = Key::parse("shop", "stock.deduct", order).unwrap();
    let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(&n.to_be_bytes()));
    match store.begin(&req, Timestamp::now()).await.unwrap() {
        BeginOutcome::Acquired(lease) => {
            let mut tx = store.pool().begin().await.unwrap();
            let outcome = stock.add_pg(&mut tx, "sku-7", -n).await.unwrap();
            let answer = serde_json::to_vec(&outcome).unwrap();
            store
                .complete_in(&mut tx, &key, &lease, answer.into(), Timestamp::now())
                .await
                .unwrap();
            if commit {
                tx.commit().await.unwrap();
            } else {
                // A crash before the commit: neither the deduction nor the record lands.
                tx.rollback().await.unwrap();
                store.release(&key, &lease, Timestamp::now()).await.unwrap();
            }
            outcome
        }
        BeginOutcome::Replay(replay) => serde_json::from_slice(&replay.response).unwrap(),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_guard_outcome_commits_with_its_record_and_replays() {
    let Some(url) = idem_testkit::services::POSTGRES.url() else {
        return;
    };
    let table = fresh("records");
    let options = PostgresOptions {
        table: table.clone(),
        ..PostgresOptions::default()
    };
    let store = PostgresStore::connect_with(&url, options).await.unwrap();
    let stock_table = fresh("stock");
    let exec = |sql: String| {
        let pool = store.pool().clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    exec(format!(
        "CREATE TABLE {stock_table} (sku TEXT PRIMARY KEY, avail BIGINT NOT NULL)"
    ))
    .await;
    exec(format!("INSERT INTO {stock_table} VALUES ('sku-7', 3)")).await;
    let stock = Counter::new(&stock_table, "sku", "avail").unwrap();
    let avail = || {
        let pool = store.pool().clone();
        let sql = format!("SELECT avail FROM {stock_table} WHERE sku = 'sku-7'");
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // Rolled back: nothing deducted, and the next attempt runs again.
    assert_eq!(
        deduct(&store, &stock, "o-1", 2, false).await,
        Bounded::Applied(1)
    );
    assert_eq!(avail().await, 3);
    // Committed once, replayed after: deducted once.
    assert_eq!(
        deduct(&store, &stock, "o-1", 2, true).await,
        Bounded::Applied(1)
    );
    assert_eq!(
        deduct(&store, &stock, "o-1", 2, true).await,
        Bounded::Applied(1)
    );
    assert_eq!(avail().await, 1);
    // "Insufficient" is an answer too: stored, and replayed even after stock comes back.
    assert_eq!(
        deduct(&store, &stock, "o-2", 2, true).await,
        Bounded::Insufficient(1)
    );
    exec(format!("UPDATE {stock_table} SET avail = 10")).await;
    assert_eq!(
        deduct(&store, &stock, "o-2", 2, true).await,
        Bounded::Insufficient(1)
    );
    assert_eq!(avail().await, 10);

    for t in [
        stock_table.clone(),
        table.clone(),
        format!("{table}_counters"),
        format!("{table}_locks"),
        format!("{table}_migrations"),
    ] {
        exec(format!("DROP TABLE IF EXISTS {t}")).await;
    }
}
