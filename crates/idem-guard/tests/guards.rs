//! Every guard on PostgreSQL, MySQL/MariaDB and SQLite, alone and under concurrent callers.
//! The server databases are skipped (with a note) when they do not answer, except under
//! `CI=true`.

#![allow(clippy::unwrap_used)]

use idem_guard::{
    Bounded, Cas, Counter, GuardError, Inserted, Scalar, StateMachine, Transition, UniqueInsert,
    Versioned,
};

/// A table name no other run uses.
fn fresh(prefix: &str) -> String {
    let n: u32 = rand_u32();
    format!("idem_guard_{prefix}_{n:08x}")
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    u32::try_from(RandomState::new().hash_one(std::process::id()) & 0xffff_ffff).unwrap()
}

/// Coupons: available (1), held (2), expired (3), used (4).
fn coupons(table: &str) -> StateMachine {
    StateMachine::new(table, "id", "status")
        .unwrap()
        .states([1, 2, 3, 4])
        .edge(1, 2)
        .unwrap()
        .edge(2, 4)
        .unwrap()
        .edge(2, 1)
        .unwrap()
        .edge(1, 3)
        .unwrap()
}

macro_rules! guard_tests {
    ($db:ident, $pool:ty, $connect:expr, $transition:ident, $update:ident, $add:ident, $insert:ident) => {
        mod $db {
            use super::*;

            pub(crate) async fn pool() -> Option<$pool> {
                $connect
            }

            async fn exec(pool: &$pool, sql: &str) {
                sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(pool)
                    .await
                    .unwrap();
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn state_machine_outcomes_are_typed() {
                let Some(pool) = pool().await else { return };
                let t = fresh("coupons");
                exec(&pool, &format!("CREATE TABLE {t} (id BIGINT PRIMARY KEY, status INT NOT NULL)")).await;
                exec(&pool, &format!("INSERT INTO {t} (id, status) VALUES (1, 1), (2, 3)")).await;
                let sm = coupons(&t);
                let mut c = pool.acquire().await.unwrap();
                assert_eq!(sm.$transition(&mut c, 1, 1, 2).await.unwrap(), Transition::Applied);
                // The same request again: already there, not "0 rows, fine".
                assert_eq!(sm.$transition(&mut c, 1, 1, 2).await.unwrap(), Transition::AlreadyThere);
                // The seeds' trap: the coupon expired meanwhile; holding it is a conflict.
                assert_eq!(
                    sm.$transition(&mut c, 2, 1, 2).await.unwrap(),
                    Transition::Conflict(Scalar::Int(3))
                );
                assert_eq!(sm.$transition(&mut c, 9, 1, 2).await.unwrap(), Transition::NotFound);
                // Not in the graph: refused before any SQL, the row untouched.
                assert!(matches!(
                    sm.$transition(&mut c, 2, 3, 2).await,
                    Err(GuardError::UndeclaredTransition { .. })
                ));
                assert_eq!(
                    sm.$transition(&mut c, 2, 1, 2).await.unwrap(),
                    Transition::Conflict(Scalar::Int(3))
                );
                drop(c);
                exec(&pool, &format!("DROP TABLE {t}")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn of_concurrent_holds_exactly_one_applies() {
                let Some(pool) = pool().await else { return };
                let t = fresh("race");
                exec(&pool, &format!("CREATE TABLE {t} (id VARCHAR(64) PRIMARY KEY, status VARCHAR(16) NOT NULL)")).await;
                exec(&pool, &format!("INSERT INTO {t} (id, status) VALUES ('c-1', 'available')")).await;
                let sm = StateMachine::new(&t, "id", "status")
                    .unwrap()
                    .states(["available", "held"])
                    .edge("available", "held")
                    .unwrap();
                let tasks: Vec<_> = (0..12)
                    .map(|_| {
                        let (pool, sm) = (pool.clone(), sm.clone());
                        tokio::spawn(async move {
                            let mut c = pool.acquire().await.unwrap();
                            sm.$transition(&mut c, "c-1", "available", "held").await.unwrap()
                        })
                    })
                    .collect();
                let mut applied = 0;
                for task in tasks {
                    match task.await.unwrap() {
                        Transition::Applied => applied += 1,
                        Transition::AlreadyThere => {}
                        other => panic!("{other:?}"),
                    }
                }
                assert_eq!(applied, 1);
                exec(&pool, &format!("DROP TABLE {t}")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_bounded_counter_never_goes_below_its_floor() {
                let Some(pool) = pool().await else { return };
                let t = fresh("stock");
                exec(&pool, &format!("CREATE TABLE {t} (sku VARCHAR(64) PRIMARY KEY, avail BIGINT NOT NULL)")).await;
                exec(&pool, &format!("INSERT INTO {t} (sku, avail) VALUES ('sku-7', 10)")).await;
                let stock = Counter::new(&t, "sku", "avail").unwrap();
                let tasks: Vec<_> = (0..16)
                    .map(|_| {
                        let (pool, stock) = (pool.clone(), stock.clone());
                        tokio::spawn(async move {
                            let mut c = pool.acquire().await.unwrap();
                            stock.$add(&mut c, "sku-7", -1).await.unwrap()
                        })
                    })
                    .collect();
                let mut remaining = Vec::new();
                let mut insufficient = 0;
                for task in tasks {
                    match task.await.unwrap() {
                        Bounded::Applied(left) => remaining.push(left),
                        Bounded::Insufficient(0) => insufficient += 1,
                        other => panic!("{other:?}"),
                    }
                }
                remaining.sort_unstable();
                assert_eq!(remaining, (0..10).collect::<Vec<i64>>());
                assert_eq!(insufficient, 6);
                let mut c = pool.acquire().await.unwrap();
                assert_eq!(stock.$add(&mut c, "sku-7", -1).await.unwrap(), Bounded::Insufficient(0));
                assert_eq!(stock.$add(&mut c, "nope", -1).await.unwrap(), Bounded::NotFound);
                let capped = stock.clone().ceiling(5);
                assert_eq!(capped.$add(&mut c, "sku-7", 5).await.unwrap(), Bounded::Applied(5));
                assert_eq!(capped.$add(&mut c, "sku-7", 1).await.unwrap(), Bounded::Exceeded(5));
                assert_eq!(stock.$add(&mut c, "sku-7", -5).await.unwrap(), Bounded::Applied(0));
                drop(c);
                exec(&pool, &format!("DROP TABLE {t}")).await;
            }

            /// A key that matches more than one row is an error, not an outcome for one of
            /// them; counters near the integer limit answer `Exceeded` instead of overflowing.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_must_be_unique_and_bounds_do_not_overflow() {
                let Some(pool) = pool().await else { return };
                let t = fresh("dupes");
                exec(&pool, &format!("CREATE TABLE {t} (k VARCHAR(8) NOT NULL, n BIGINT NOT NULL)")).await;
                exec(&pool, &format!("INSERT INTO {t} (k, n) VALUES ('a', 5), ('a', 5), ('b', 9223372036854775806)")).await;
                let mut c = pool.acquire().await.unwrap();
                let sm = StateMachine::new(&t, "k", "n").unwrap().states([5, 6, 9]).edge(5, 6).unwrap().edge(9, 6).unwrap();
                // Both rows change: the error says so (roll back).
                assert!(matches!(sm.$transition(&mut c, "a", 5, 6).await, Err(GuardError::NotUnique(2))));
                // Refused, and the read that explains it finds two rows.
                assert!(matches!(sm.$transition(&mut c, "a", 9, 6).await, Err(GuardError::NotUnique(2))));
                let counter = Counter::new(&t, "k", "n").unwrap();
                assert!(matches!(counter.$add(&mut c, "a", -1).await, Err(GuardError::NotUnique(2))));
                assert!(matches!(counter.$add(&mut c, "a", -100).await, Err(GuardError::NotUnique(2))));
                assert_eq!(counter.$add(&mut c, "b", 5).await.unwrap(), Bounded::Exceeded(i64::MAX - 1));
                assert_eq!(counter.$add(&mut c, "b", 1).await.unwrap(), Bounded::Applied(i64::MAX));
                assert_eq!(counter.$add(&mut c, "b", i64::MIN).await.unwrap(), Bounded::Insufficient(i64::MAX));
                drop(c);
                exec(&pool, &format!("DROP TABLE {t}")).await;
            }

            /// One fund account per user: of concurrent opens exactly one inserts, and every
            /// caller gets that account back.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn of_concurrent_inserts_one_is_new_and_all_get_it() {
                let Some(pool) = pool().await else { return };
                let t = fresh("accounts");
                exec(&pool, &format!("CREATE TABLE {t} (account_no VARCHAR(64) PRIMARY KEY, user_id BIGINT NOT NULL UNIQUE, currency VARCHAR(8) NOT NULL)")).await;
                let accounts = UniqueInsert::new(&t, &["user_id"], &["account_no", "user_id", "currency"]).unwrap();
                let tasks: Vec<_> = (0..12)
                    .map(|i| {
                        let (pool, accounts) = (pool.clone(), accounts.clone());
                        tokio::spawn(async move {
                            let mut c = pool.acquire().await.unwrap();
                            let values = [format!("acct-{i}").into(), 7.into(), "CNY".into()];
                            accounts.$insert::<(String, i64, String)>(&mut c, &values).await.unwrap()
                        })
                    })
                    .collect();
                let (mut new, mut rows) = (0, Vec::new());
                for task in tasks {
                    match task.await.unwrap() {
                        Inserted::New(row) => {
                            new += 1;
                            rows.push(row);
                        }
                        Inserted::Existing(row) => rows.push(row),
                    }
                }
                assert_eq!(new, 1);
                rows.dedup();
                assert_eq!(rows.len(), 1, "{rows:?}");
                assert_eq!((rows[0].1, rows[0].2.as_str()), (7, "CNY"));
                let mut c = pool.acquire().await.unwrap();
                assert!(matches!(
                    accounts.$insert::<(String, i64, String)>(&mut c, &[7.into()]).await,
                    Err(GuardError::Definition(_))
                ));
                drop(c);
                exec(&pool, &format!("DROP TABLE {t}")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_version_cas_applies_once_per_version() {
                let Some(pool) = pool().await else { return };
                let t = fresh("orders");
                exec(&pool, &format!("CREATE TABLE {t} (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, version BIGINT NOT NULL)")).await;
                exec(&pool, &format!("INSERT INTO {t} (id, status, version) VALUES (7, 'new', 1)")).await;
                let orders = Versioned::new(&t, "id", "version").unwrap();
                let tasks: Vec<_> = (0..8)
                    .map(|i| {
                        let (pool, orders) = (pool.clone(), orders.clone());
                        tokio::spawn(async move {
                            let mut c = pool.acquire().await.unwrap();
                            let status = Scalar::Text(format!("paid-{i}"));
                            orders.$update(&mut c, 7, 1, &[("status", status)]).await.unwrap()
                        })
                    })
                    .collect();
                let mut applied = 0;
                for task in tasks {
                    match task.await.unwrap() {
                        Cas::Applied(2) => applied += 1,
                        Cas::Conflict(2) => {}
                        other => panic!("{other:?}"),
                    }
                }
                assert_eq!(applied, 1);
                let mut c = pool.acquire().await.unwrap();
                assert_eq!(
                    orders.$update(&mut c, 7, 2, &[("status", "shipped".into())]).await.unwrap(),
                    Cas::Applied(3)
                );
                assert_eq!(orders.$update(&mut c, 8, 1, &[]).await.unwrap(), Cas::NotFound);
                assert!(matches!(
                    orders.$update(&mut c, 7, 3, &[("status; DROP TABLE x", "x".into())]).await,
                    Err(GuardError::Definition(_))
                ));
                drop(c);
                exec(&pool, &format!("DROP TABLE {t}")).await;
            }
        }
    };
}

guard_tests!(
    postgres,
    sqlx::PgPool,
    {
        let url = idem_testkit::services::POSTGRES.url()?;
        Some(sqlx::PgPool::connect(&url).await.unwrap())
    },
    transition_pg,
    update_pg,
    add_pg,
    insert_pg
);

guard_tests!(
    mysql,
    sqlx::MySqlPool,
    {
        let url = idem_testkit::services::MYSQL.url()?;
        Some(sqlx::MySqlPool::connect(&url).await.unwrap())
    },
    transition_mysql,
    update_mysql,
    add_mysql,
    insert_mysql
);

guard_tests!(
    sqlite,
    sqlx::SqlitePool,
    {
        // One file per pool, shared by its connections; kept for the process (a test's pool).
        let dir = std::env::temp_dir().join(format!("idem-guard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{}.db", fresh("db")));
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(10));
        Some(sqlx::SqlitePool::connect_with(options).await.unwrap())
    },
    transition_sqlite,
    update_sqlite,
    add_sqlite,
    insert_sqlite
);

macro_rules! row_lock_tests {
    ($db:ident, $pool:ty, $lock:ident) => {
        mod $db {
            use idem_guard::{LockWait, Locked, RowLock};

            /// A row another transaction locked is `Busy` without waiting (NOWAIT, SKIP
            /// LOCKED), locked once that transaction ends; a missing row is `NotFound`.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn row_locks_say_busy_without_waiting() {
                let Some(pool) = crate::$db::pool().await else {
                    return;
                };
                let t = crate::fresh("accounts");
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "CREATE TABLE {t} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)"
                )))
                .execute(&pool)
                .await
                .unwrap();
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {t} VALUES (1, 100)"
                )))
                .execute(&pool)
                .await
                .unwrap();
                let rows = RowLock::new(&t, "id").unwrap();
                let mut first = pool.begin().await.unwrap();
                assert_eq!(
                    rows.$lock(&mut first, 1, LockWait::Wait).await.unwrap(),
                    Locked::Locked
                );
                let mut second = pool.begin().await.unwrap();
                for wait in [LockWait::NoWait, LockWait::SkipLocked] {
                    assert_eq!(
                        rows.$lock(&mut second, 1, wait).await.unwrap(),
                        Locked::Busy
                    );
                }
                second.rollback().await.unwrap();
                let mut second = pool.begin().await.unwrap();
                assert_eq!(
                    rows.$lock(&mut second, 2, LockWait::NoWait).await.unwrap(),
                    Locked::NotFound
                );
                first.commit().await.unwrap();
                assert_eq!(
                    rows.$lock(&mut second, 1, LockWait::NoWait).await.unwrap(),
                    Locked::Locked
                );
                second.commit().await.unwrap();
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}")))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    };
}

mod locks {
    row_lock_tests!(postgres, sqlx::PgPool, lock_pg);
    row_lock_tests!(mysql, sqlx::MySqlPool, lock_mysql);
}
