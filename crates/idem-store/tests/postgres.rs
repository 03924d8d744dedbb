//! The PostgreSQL store against a real server: the conformance suite, migrations, and
//! classification of failures. Skipped (with a note) when no server answers, except under
//! `CI=true`.

#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used)]

use idem_store::{PostgresOptions, PostgresStore};
use idem_testkit::conformance::Fixture;
use idem_testkit::services::POSTGRES;

async fn store(table: &str) -> Option<PostgresStore> {
    let url = POSTGRES.url()?;
    let options = PostgresOptions {
        table: table.to_owned(),
        ..PostgresOptions::default()
    };
    Some(PostgresStore::connect_with(&url, options).await.unwrap())
}

mod conformance {
    use super::*;

    async fn fixture() -> Option<Fixture<PostgresStore>> {
        // A table per case (the same in every run): purges must not reach other cases.
        let table = idem_testkit::conformance::case_table("idem_test_case");
        let store = store(&table).await?;
        idem_core::Store::purge_expired(&store, idem_core::Timestamp::now(), 100_000)
            .await
            .unwrap();
        Some(Fixture::new(store))
    }

    idem_testkit::conformance_tests!(fixture());
}

/// A table name no other run uses.
fn fresh_table() -> String {
    format!("idem_test_{:08x}", rand_u32())
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    u32::try_from(RandomState::new().hash_one(std::process::id()) & 0xffff_ffff).unwrap()
}

async fn drop_tables(store: &PostgresStore, table: &str) {
    for t in [table.to_owned(), format!("{table}_migrations")] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(store.pool())
            .await
            .unwrap();
    }
}

#[test]
fn migrations_apply_once_even_when_processes_start_together() {
    idem_testkit::block_on(async {
        let table = fresh_table();
        let Some(first) = store(&table).await else {
            return;
        };
        drop_tables(&first, &table).await;
        // Eight stores start at once on a table that does not exist yet.
        let starts: Vec<_> = (0..8)
            .map(|_| {
                let table = table.clone();
                tokio::spawn(async move { store(&table).await.unwrap() })
            })
            .collect();
        for s in starts {
            s.await.unwrap();
        }
        let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT version FROM {table}_migrations"
        )))
        .fetch_all(first.pool())
        .await
        .unwrap();
        assert_eq!(versions, [1]);

        // A schema from a newer idem is refused, not guessed at.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table}_migrations VALUES (99, 'from the future', 0)"
        )))
        .execute(first.pool())
        .await
        .unwrap();
        let url = POSTGRES.url().unwrap();
        let options = PostgresOptions {
            table: table.clone(),
            ..PostgresOptions::default()
        };
        let e = PostgresStore::connect_with(&url, options)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("newer"), "{e}");
        drop_tables(&first, &table).await;
    });
}

#[test]
fn bad_table_names_and_unreachable_servers_are_clear_errors() {
    idem_testkit::block_on(async {
        let Some(url) = POSTGRES.url() else {
            return;
        };
        let options = PostgresOptions {
            table: "x; drop table y".into(),
            ..PostgresOptions::default()
        };
        let e = PostgresStore::connect_with(&url, options)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("table name"), "{e}");
        // Nothing listens on port 1: unavailable, so callers fail closed and may retry.
        let options = PostgresOptions {
            acquire_timeout: std::time::Duration::from_secs(2),
            ..PostgresOptions::default()
        };
        let e = PostgresStore::connect_with("postgres://postgres@127.0.0.1:1/test", options)
            .await
            .unwrap_err();
        assert!(e.is_transient(), "{e}");
    });
}
