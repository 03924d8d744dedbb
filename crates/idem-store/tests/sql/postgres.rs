//! PostgreSQL: its locks and fenced writes, and the shared SQL store tests in its dialect.

mod locks {
    use std::sync::Arc;

    use idem_core::SharedLockStore;

    idem_testkit::lock_conformance_tests!(async {
        // One table for every case: each case's lock names are its own.
        Some(Arc::new(super::store("idem_test_locks").await?) as SharedLockStore)
    });
}

/// A renewal that waits behind a release (another transaction holds the row) decides by
/// the time after the release: it is refused, and the lock stays free.
#[test]
fn a_renewal_queued_behind_a_release_does_not_revive_the_lock() {
    use idem_core::{Acquire, LockName, LockOwner, LockStore};
    idem_testkit::block_on(async {
        let Some(store) = store("idem_test_locks").await else {
            return;
        };
        let name = LockName::new(&fresh_name("queued-renew")).unwrap();
        let owner = LockOwner::random().digest();
        let Acquire::Acquired(held) = store
            .acquire(&name, owner, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("acquire");
        };
        // The release, in a transaction that holds the row while the renewal queues.
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idem_test_locks_locks WHERE name = $1 FOR UPDATE")
            .bind(name.as_str())
            .execute(&mut *tx)
            .await
            .unwrap();
        let renewal = {
            let (store, name) = (store.clone(), name.clone());
            tokio::spawn(async move {
                LockStore::renew(&store, &name, owner, held.fence, Duration::from_secs(60)).await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        sqlx::query(
            "UPDATE idem_test_locks_locks
             SET expires_at = (extract(epoch FROM clock_timestamp()) * 1000)::bigint
             WHERE name = $1",
        )
        .bind(name.as_str())
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let renewed = renewal.await.unwrap();
        assert!(
            matches!(renewed, Err(idem_core::LockError::NotOwner)),
            "{renewed:?}"
        );
        let other = LockOwner::random().digest();
        assert!(matches!(
            store
                .acquire(&name, other, Duration::from_secs(1))
                .await
                .unwrap(),
            Acquire::Acquired(_)
        ));
    });
}

/// Two transactions taking the same advisory lock never overlap; the lock goes with the
/// transaction.
#[test]
fn advisory_locks_last_as_long_as_their_transaction() {
    idem_testkit::block_on(async {
        let Some(store) = store("idem_test_locks").await else {
            return;
        };
        let name = idem_core::LockName::new(&fresh_name("advisory")).unwrap();
        let mut first = store.pool().begin().await.unwrap();
        PostgresStore::xact_lock(&mut first, &name).await.unwrap();
        let mut second = store.pool().begin().await.unwrap();
        assert!(
            !PostgresStore::try_xact_lock(&mut second, &name)
                .await
                .unwrap()
        );
        let other = idem_core::LockName::new(&fresh_name("advisory-other")).unwrap();
        assert!(
            PostgresStore::try_xact_lock(&mut second, &other)
                .await
                .unwrap()
        );
        first.commit().await.unwrap();
        assert!(
            PostgresStore::try_xact_lock(&mut second, &name)
                .await
                .unwrap()
        );
        second.rollback().await.unwrap();
    });
}
/// Once the schema is current, a store connects without touching it, so services can run
/// as a user that may only read and write rows (the schema applied by `idem migrate`).
#[test]
fn a_current_schema_needs_no_schema_rights() {
    idem_testkit::block_on(async {
        let table = fresh_name("idem_test_rights");
        let Some(admin) = store(&table).await else {
            return;
        };
        let role = fresh_name("idem_test_role");
        let grant = format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {table}_migrations, {table}_counters \
             TO {role}"
        );
        for statement in [format!("CREATE ROLE {role} LOGIN"), grant] {
            sqlx::query(AssertSqlSafe(statement))
                .execute(admin.pool())
                .await
                .unwrap();
        }
        // The same server and database, as the limited role.
        let url = POSTGRES.url().unwrap();
        let (scheme, rest) = url.split_once("://").unwrap();
        let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
        let options = PostgresOptions {
            table: table.clone(),
            ..PostgresOptions::default()
        };
        let limited =
            PostgresStore::connect_with(&format!("{scheme}://{role}@{host}"), options).await;
        let began = match &limited {
            Ok(store) => {
                let req = BeginRequest::new(
                    Key::parse("r", "r", "r").unwrap(),
                    Fingerprint::of_bytes(b"r"),
                );
                Some(store.begin(&req, Timestamp::now()).await)
            }
            Err(_) => None,
        };
        drop(limited);
        drop_tables(&admin, &[table.clone(), format!("{table}_migrations")]).await;
        sqlx::query(AssertSqlSafe(format!("DROP ROLE {role}")))
            .execute(admin.pool())
            .await
            .unwrap();
        assert!(
            matches!(began, Some(Ok(BeginOutcome::Acquired(_)))),
            "{began:?}"
        );
    });
}

sql_store_tests! {
    store: PostgresStore,
    options: PostgresOptions,
    service: POSTGRES,
    unreachable: "postgres://postgres@127.0.0.1:1/test",
    schema: "public",
    own_server: Postgres,
    ledger: "CREATE TABLE {} (transfer TEXT NOT NULL)",
    insert: "INSERT INTO {} (transfer) VALUES ($1)",
    count: "SELECT COUNT(*) FROM {} WHERE transfer = $1",
    versions: [1, 2, 3, 4],
}
