/// The tests of one SQL store; the statements are in the backend's dialect.
macro_rules! sql_store_tests {
    (
        store: $store:ident,
        options: $options:ident,
        service: $service:ident,
        unreachable: $unreachable:literal,
        schema: $schema:literal,
        own_server: $kind:ident,
        ledger: $ledger:literal,
        insert: $insert:literal,
        count: $count:literal,
        versions: $versions:expr $(,)?
    ) => {
        use std::sync::Arc;
        use std::time::Duration;

        use idem_core::{
            BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, LeaseError, Status, Store,
            Timestamp,
        };
        use idem_store::{$options, $store};
        use idem_testkit::conformance::Fixture;
        use idem_testkit::services::$service;
        use sqlx::AssertSqlSafe;

        async fn store(table: &str) -> Option<$store> {
            let url = $service.url()?;
            let options = $options {
                table: table.to_owned(),
                ..$options::default()
            };
            Some($store::connect_with(&url, options).await.unwrap())
        }

        /// A name no other run uses.
        fn fresh_name(prefix: &str) -> String {
            use std::hash::{BuildHasher, RandomState};
            let n = RandomState::new().hash_one(std::process::id()) & 0xffff_ffff;
            format!("{prefix}_{n:08x}")
        }

        /// Drops each table, and the counters table of each records table with it.
        async fn drop_tables(store: &$store, tables: &[String]) {
            for t in tables {
                for name in [t.clone(), format!("{t}_counters"), format!("{t}_locks")] {
                    sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {name}")))
                        .execute(store.pool())
                        .await
                        .unwrap();
                }
            }
        }

        mod conformance {
            use super::*;

            async fn fixture() -> Option<Fixture<$store>> {
                // A table per case (the same in every run): purges must not reach other cases.
                let table = idem_testkit::conformance::case_table("idem_test_case");
                let store = store(&table).await?;
                store.purge_expired(Timestamp::now(), 100_000).await.unwrap();
                Some(Fixture::new(store))
            }

            idem_testkit::conformance_tests!(fixture());
        }

        #[test]
        fn migrations_apply_once_even_when_processes_start_together() {
            idem_testkit::block_on(async {
                let table = fresh_name("idem_test");
                let Some(first) = store(&table).await else {
                    return;
                };
                let tables = [table.clone(), format!("{table}_migrations")];
                drop_tables(&first, &tables).await;
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
                let versions: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT version FROM {table}_migrations"
                )))
                .fetch_all(first.pool())
                .await
                .unwrap();
                assert_eq!(versions, $versions);

                // A schema from a newer idem is refused, not guessed at.
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {table}_migrations VALUES (99, 'from the future', 0)"
                )))
                .execute(first.pool())
                .await
                .unwrap();
                let options = $options {
                    table: table.clone(),
                    ..$options::default()
                };
                let e = $store::connect_with(&$service.url().unwrap(), options)
                    .await
                    .unwrap_err();
                assert!(e.to_string().contains("newer"), "{e}");
                drop_tables(&first, &tables).await;
            });
        }

        /// A schema-qualified table works (its index is named after the table's last part).
        #[test]
        fn a_qualified_table_name_works() {
            idem_testkit::block_on(async {
                let table = format!("{}.{}", $schema, fresh_name("idem_test_q"));
                let Some(store) = store(&table).await else {
                    return;
                };
                let req = BeginRequest::new(
                    Key::parse("q", "q", "q").unwrap(),
                    Fingerprint::of_bytes(b"q"),
                );
                let now = Timestamp::now();
                assert!(matches!(
                    store.begin(&req, now).await.unwrap(),
                    BeginOutcome::Acquired(_)
                ));
                drop_tables(&store, &[table.clone(), format!("{table}_migrations")]).await;
            });
        }

        #[test]
        fn bad_table_names_and_unreachable_servers_are_clear_errors() {
            idem_testkit::block_on(async {
                let Some(url) = $service.url() else {
                    return;
                };
                let options = $options {
                    table: "x; drop table y".into(),
                    ..$options::default()
                };
                let e = $store::connect_with(&url, options).await.unwrap_err();
                assert!(e.to_string().contains("table name"), "{e}");
                // Nothing listens on port 1: unavailable, so callers fail closed and may retry.
                let e = $store::connect_with($unreachable, $options::default())
                    .await
                    .unwrap_err();
                assert!(e.is_transient(), "{e}");
                assert!(e.to_string().contains("refused"), "{e}");
            });
        }

        /// A server that goes away (killed) makes every operation fail closed with an error
        /// that says to try again; when it is back, the same store works again by itself, and
        /// the records from before are there.
        #[test]
        fn an_outage_fails_closed_and_the_store_recovers_by_itself() {
            use idem_testkit::services::{SqlKind, SqlServer};
            // The project's server is shared with other tests: this one kills its own.
            if $service.url().is_none() {
                return;
            }
            let Some(mut server) = SqlServer::start(SqlKind::$kind) else {
                return;
            };
            idem_testkit::block_on(async {
                let options = $options {
                    acquire_timeout: Duration::from_secs(1),
                    ..$options::default()
                };
                let store = $store::connect_with(&server.url(), options).await.unwrap();
                let req = |k: &str| {
                    BeginRequest::new(
                        Key::parse("s", "outage", k).unwrap(),
                        Fingerprint::of_bytes(b"x"),
                    )
                };
                let now = Timestamp::now();
                let BeginOutcome::Acquired(lease) = store.begin(&req("before"), now).await.unwrap()
                else {
                    panic!("not acquired");
                };

                server.stop();
                for k in ["during-1", "during-2"] {
                    let e = store.begin(&req(k), now).await.unwrap_err();
                    assert!(e.is_transient(), "{e}");
                }
                let e = store
                    .complete(&req("before").key, &lease, Bytes::new(), now)
                    .await
                    .unwrap_err();
                assert!(matches!(e, LeaseError::Store(ref s) if s.is_transient()), "{e}");

                server.restart();
                let mut outcome = None;
                for _ in 0..50 {
                    if let Ok(o) = store.begin(&req("after"), now).await {
                        outcome = Some(o);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                assert!(matches!(outcome, Some(BeginOutcome::Acquired(_))), "{outcome:?}");
                // The record from before the outage is still held, and its lease completes.
                assert!(matches!(
                    store.begin(&req("before"), now).await.unwrap(),
                    BeginOutcome::InProgress { .. }
                ));
                store
                    .complete(&req("before").key, &lease, Bytes::from_static(b"ok"), now)
                    .await
                    .unwrap();
            });
        }

        /// Calls that queue while the pool is busy go to the server together (group commit),
        /// and each still gets its own answer: fresh keys are acquired, a completed key
        /// replays, a held key is in progress; each completion stores its own response, a
        /// repeated one is accepted and a stale one refused.
        #[test]
        fn calls_sent_together_each_get_their_own_answer() {
            idem_testkit::block_on(async {
                let table = fresh_name("idem_test_batch");
                let Some(url) = $service.url() else {
                    return;
                };
                let options = $options {
                    table: table.clone(),
                    max_connections: 2,
                    ..$options::default()
                };
                let store = Arc::new($store::connect_with(&url, options).await.unwrap());
                let now = Timestamp::now();
                let key = |i: usize| Key::parse("batch", "pay", &format!("k{i}")).unwrap();
                let req = move |i| BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"));
                let body = |i: usize| Bytes::from(format!("body {i}").into_bytes());
                let acquire = |i| {
                    let store = store.clone();
                    async move {
                        match store.begin(&req(i), now).await.unwrap() {
                            BeginOutcome::Acquired(lease) => lease,
                            other => panic!("{other:?}"),
                        }
                    }
                };
                // k0 completed, k1 held by a live lease.
                let l0 = acquire(0).await;
                store.complete(&key(0), &l0, body(0), now).await.unwrap();
                let l1 = acquire(1).await;

                // With both connections taken every call waits, and all but one queue.
                let held = (
                    store.pool().acquire().await.unwrap(),
                    store.pool().acquire().await.unwrap(),
                );
                let begins: Vec<_> = (0..40)
                    .map(|i| {
                        let store = store.clone();
                        tokio::spawn(async move { store.begin(&req(i), now).await })
                    })
                    .collect();
                tokio::time::sleep(Duration::from_millis(200)).await;
                drop(held);
                let mut leases = Vec::new();
                for (i, begin) in begins.into_iter().enumerate() {
                    match (i, begin.await.unwrap().unwrap()) {
                        (0, BeginOutcome::Replay(r)) => assert_eq!(r.response, body(0)),
                        (1, BeginOutcome::InProgress { .. }) => {}
                        (i, BeginOutcome::Acquired(lease)) if i >= 2 => {
                            assert_eq!(lease.fence, idem_core::Lease::first_fence(now));
                            leases.push((i, lease));
                        }
                        (i, other) => panic!("k{i}: {other:?}"),
                    }
                }

                let held = (
                    store.pool().acquire().await.unwrap(),
                    store.pool().acquire().await.unwrap(),
                );
                // k0 completed again by its own lease (accepted), k1 by the lease of a key
                // completed in the same batch (refused), and every fresh key with its own
                // body.
                let stale = leases[leases.len() / 2].1;
                // (The odd ones last: the first calls may go alone, the rest go together.)
                let completes: Vec<_> = leases
                    .iter()
                    .copied()
                    .chain([(0, l0), (1, stale)])
                    .map(|(i, lease)| {
                        let store = store.clone();
                        let response = body(i);
                        tokio::spawn(async move {
                            (i, store.complete(&key(i), &lease, response, now).await)
                        })
                    })
                    .collect();
                tokio::time::sleep(Duration::from_millis(200)).await;
                drop(held);
                for complete in completes {
                    match complete.await.unwrap() {
                        (1, done) => assert!(matches!(done, Err(LeaseError::Stale(_))), "{done:?}"),
                        (i, done) => assert!(done.is_ok(), "k{i}: {done:?}"),
                    }
                }
                for i in (0..40).filter(|i| *i != 1) {
                    let r = store.get(&key(i), now).await.unwrap().unwrap();
                    assert_eq!((r.status, r.response), (Status::Completed, Some(body(i))), "k{i}");
                }
                let r = store.get(&key(1), now).await.unwrap().unwrap();
                assert_eq!((r.status, r.fence), (Status::InProgress, l1.fence));
                drop_tables(&store, &[table.clone(), format!("{table}_migrations")]).await;
            });
        }

        /// Every key a batched `begin` takes is taken for its caller, even while `begin`s of
        /// another store, one at a time and with clocks past every lease, take the same keys
        /// over as the batches run: the fences handed out for a key follow one another with
        /// no gap. (A batch that took a row and lost it to a takeover before it read back what
        /// it took would answer its caller with a second `begin`; the fence of its first would
        /// be nobody's.)
        #[test]
        fn every_fence_a_batched_begin_takes_goes_to_its_caller() {
            idem_testkit::block_on(async {
                const KEYS: usize = 16;
                const ROUNDS: u64 = 100;
                let table = fresh_name("idem_test_fences");
                let Some(url) = $service.url() else {
                    return;
                };
                let options = |max_batch| $options {
                    table: table.clone(),
                    max_batch,
                    ..$options::default()
                };
                let batched = $store::connect_with(&url, options($options::default().max_batch));
                let batched = Arc::new(batched.await.unwrap());
                let alone = Arc::new($store::connect_with(&url, options(1)).await.unwrap());
                let key = |i: usize| Key::parse("fences", "pay", &format!("k{i}")).unwrap();
                let req = move |i| {
                    BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"))
                        .with_lease(Duration::from_millis(1))
                        .with_ttl(Duration::from_secs(3600))
                };
                let start = Timestamp::now();
                let later = |at: Timestamp| at.saturating_add(Duration::from_secs(5));
                let mut fences = vec![Vec::new(); KEYS];
                for round in 0..ROUNDS {
                    // Each round's keys may be acquired by either side: the batched side's
                    // clock is past the last round's leases, the other's past this round's.
                    let at = start.saturating_add(Duration::from_secs(10 * round));
                    let calls: Vec<_> = (0..KEYS)
                        .flat_map(|i| {
                            [(batched.clone(), at), (alone.clone(), later(at))].map(
                                |(store, now)| {
                                    tokio::spawn(async move {
                                        (i, store.begin(&req(i), now).await.unwrap())
                                    })
                                },
                            )
                        })
                        .collect();
                    for call in calls {
                        if let (i, BeginOutcome::Acquired(lease)) = call.await.unwrap() {
                            fences[i].push(lease.fence);
                        }
                    }
                }
                let end = start.saturating_add(Duration::from_secs(10 * ROUNDS));
                let first = [start, later(start)].map(idem_core::Lease::first_fence);
                for (i, mut got) in fences.into_iter().enumerate() {
                    got.sort_unstable();
                    assert!(first.contains(&got[0]), "k{i}: {got:?}");
                    for pair in got.windows(2) {
                        let next = idem_core::Lease::next_fence(pair[0]);
                        let gap = (pair[0], pair[1]);
                        assert_eq!(pair[1], next, "k{i}: a fence between {gap:?} was nobody's");
                    }
                    let r = batched.get(&key(i), end).await.unwrap().unwrap();
                    assert_eq!(Some(&r.fence), got.last(), "k{i}");
                }
                drop_tables(&batched, &[table.clone(), format!("{table}_migrations")]).await;
            });
        }

        /// Every completion a batched `complete` applies is answered `Ok`, even while
        /// `reopen`s of another store give the records back as the batches run. Each batch
        /// holds stale leases too, so it does not complete every row; a record reopened at a
        /// lease's fence was completed by that lease, and its caller must not be told the
        /// lease is stale (as a batch that decided such jobs afterwards, each on its own,
        /// would find the record given back).
        #[test]
        fn every_completion_a_batch_applies_is_answered_ok() {
            use std::sync::atomic::{AtomicBool, Ordering};
            idem_testkit::block_on(async {
                const KEYS: usize = 16;
                const ROUNDS: usize = 40;
                let table = fresh_name("idem_test_reopened");
                let Some(url) = $service.url() else {
                    return;
                };
                let options = |max_batch| $options {
                    table: table.clone(),
                    max_batch,
                    ..$options::default()
                };
                let batched = $store::connect_with(&url, options($options::default().max_batch));
                let batched = Arc::new(batched.await.unwrap());
                let alone = Arc::new($store::connect_with(&url, options(1)).await.unwrap());
                let now = Timestamp::now();
                let mut reopened_and_ok = 0;
                for round in 0..ROUNDS {
                    let key = move |i: usize| {
                        Key::parse("reopened", "pay", &format!("r{round}-k{i}")).unwrap()
                    };
                    let mut leases = Vec::new();
                    for i in 0..KEYS {
                        let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"));
                        match alone.begin(&req, now).await.unwrap() {
                            BeginOutcome::Acquired(lease) => leases.push(lease),
                            other => panic!("{other:?}"),
                        }
                    }
                    let settled = Arc::new(AtomicBool::new(false));
                    // Odd keys are completed with a lease that is not theirs.
                    let completes: Vec<_> = (0..KEYS)
                        .map(|i| {
                            let (store, mut lease) = (batched.clone(), leases[i]);
                            if i % 2 == 1 {
                                lease.id = idem_core::LeaseId::generate();
                            }
                            let body = Bytes::from_static(b"done");
                            tokio::spawn(async move { store.complete(&key(i), &lease, body, now).await })
                        })
                        .collect();
                    let reopens: Vec<_> = (0..KEYS)
                        .step_by(2)
                        .map(|i| {
                            let (store, fence) = (alone.clone(), leases[i].fence);
                            let settled = settled.clone();
                            tokio::spawn(async move {
                                while !settled.load(Ordering::SeqCst) {
                                    if store.reopen(&key(i), fence, now).await.unwrap() {
                                        return true;
                                    }
                                }
                                false
                            })
                        })
                        .collect();
                    let mut answers = Vec::new();
                    for complete in completes {
                        answers.push(complete.await.unwrap());
                    }
                    settled.store(true, Ordering::SeqCst);
                    for (n, reopen) in reopens.into_iter().enumerate() {
                        let i = 2 * n;
                        if reopen.await.unwrap() {
                            assert!(answers[i].is_ok(), "r{round}-k{i}: {:?}", answers[i]);
                            reopened_and_ok += 1;
                        }
                    }
                    for i in (1..KEYS).step_by(2) {
                        let stale = matches!(answers[i], Err(LeaseError::Stale(_)));
                        assert!(stale, "r{round}-k{i}: {:?}", answers[i]);
                    }
                }
                assert!(reopened_and_ok > 0, "no reopen met a completion");
                drop_tables(&batched, &[table.clone(), format!("{table}_migrations")]).await;
            });
        }

        /// A record held by a caller's open transaction makes a `begin` of its key wait at
        /// most the lock timeout, then fail closed (not hold a connection without bound); once
        /// the transaction commits, the begin replays.
        #[test]
        fn a_begin_waits_for_an_open_transaction_at_most_the_lock_timeout() {
            idem_testkit::block_on(async {
                let table = fresh_name("idem_test_lock");
                let Some(url) = $service.url() else {
                    return;
                };
                let options = $options {
                    table: table.clone(),
                    lock_timeout: Duration::from_secs(1),
                    ..$options::default()
                };
                let store = $store::connect_with(&url, options).await.unwrap();
                let req = BeginRequest::new(
                    Key::parse("lock", "lock", "k").unwrap(),
                    Fingerprint::of_bytes(b"k"),
                );
                let now = Timestamp::now();
                let BeginOutcome::Acquired(lease) = store.begin(&req, now).await.unwrap() else {
                    panic!("not acquired");
                };
                let mut tx = store.pool().begin().await.unwrap();
                store
                    .complete_in(&mut tx, &req.key, &lease, Bytes::from_static(b"ok"), now)
                    .await
                    .unwrap();
                // Far past the lease, so the begin would take over if it could decide.
                let later = now.saturating_add(Duration::from_secs(3600));
                let waited = tokio::time::timeout(Duration::from_secs(20), store.begin(&req, later))
                    .await
                    .expect("the begin waited without bound");
                let e = waited.unwrap_err();
                assert!(e.is_transient(), "{e}");
                tx.commit().await.unwrap();
                assert!(matches!(
                    store.begin(&req, now).await.unwrap(),
                    BeginOutcome::Replay(_)
                ));
                drop_tables(&store, &[table.clone(), format!("{table}_migrations")]).await;
            });
        }

        /// A step recorded in the caller's transaction is recorded only if it commits: rolled
        /// back, the record has no such step and the same lease records it again; committed,
        /// a takeover finds it.
        #[test]
        fn a_step_in_the_callers_transaction_commits_or_rolls_back_with_it() {
            idem_testkit::block_on(async {
                let table = fresh_name("idem_test_step_tx");
                let Some(store) = store(&table).await else {
                    return;
                };
                let req = BeginRequest::new(
                    Key::parse("tx", "steps", "k").unwrap(),
                    Fingerprint::of_bytes(b"k"),
                )
                .with_lease(Duration::from_secs(10));
                let now = Timestamp::now();
                let BeginOutcome::Acquired(lease) = store.begin(&req, now).await.unwrap() else {
                    panic!("not acquired");
                };
                let step = idem_core::Step::done(
                    idem_core::StepName::new("debit").unwrap(),
                    b"7".to_vec(),
                )
                .unwrap();
                let steps = |at| {
                    let (store, key) = (&store, &req.key);
                    async move { store.get(key, at).await.unwrap().unwrap().steps }
                };
                let mut tx = store.pool().begin().await.unwrap();
                store
                    .record_step_in(&mut tx, &req.key, &lease, &step, now)
                    .await
                    .unwrap();
                tx.rollback().await.unwrap();
                assert!(steps(now).await.is_empty());
                let mut tx = store.pool().begin().await.unwrap();
                store
                    .record_step_in(&mut tx, &req.key, &lease, &step, now)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                let later = now.saturating_add(Duration::from_secs(11));
                let BeginOutcome::Acquired(taken) = store.begin(&req, later).await.unwrap() else {
                    panic!("not taken over");
                };
                assert!(taken.fence > lease.fence);
                assert_eq!(steps(later).await, [step]);
                drop_tables(&store, &[table.clone(), format!("{table}_migrations")]).await;
            });
        }

        /// The work's write and the record's completion commit together: an attempt killed
        /// after both ran but before its commit leaves neither, and the retry (after the
        /// lease) runs the work exactly once more. Had the completion been committed on its
        /// own, the kill would leave a completed record over a transfer that never happened,
        /// and every retry would replay a success.
        #[test]
        fn same_transaction_mode_commits_the_work_and_the_record_together() {
            idem_testkit::block_on(async {
                let table = fresh_name("idem_test_tx");
                let ledger = format!("{table}_ledger");
                let Some(store) = store(&table).await else {
                    return;
                };
                let store = Arc::new(store);
                sqlx::query(AssertSqlSafe(format!($ledger, ledger)))
                    .execute(store.pool())
                    .await
                    .unwrap();
                let key = Key::parse("tx", "transfer", "t-1").unwrap();
                let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"10"))
                    .with_lease(Duration::from_secs(30));
                let t0 = Timestamp::now();

                // The first attempt writes and completes in one transaction, and is killed
                // before it commits.
                let BeginOutcome::Acquired(lease) = store.begin(&req, t0).await.unwrap() else {
                    panic!("not acquired");
                };
                let (wrote, written) = tokio::sync::oneshot::channel();
                let work = tokio::spawn({
                    let (store, ledger) = (store.clone(), ledger.clone());
                    async move {
                        let mut tx = store.pool().begin().await.unwrap();
                        sqlx::query(AssertSqlSafe(format!($insert, ledger)))
                            .bind("t-1")
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        store
                            .complete_in(&mut tx, &key, &lease, Bytes::from_static(b"done"), t0)
                            .await
                            .unwrap();
                        wrote.send(()).unwrap();
                        // Killed here: both statements ran, nothing is committed.
                        std::future::pending::<()>().await;
                        tx.commit().await.unwrap();
                    }
                });
                written.await.unwrap();
                work.abort();
                let _ = work.await;

                let count = || async {
                    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!($count, ledger)))
                        .bind("t-1")
                        .fetch_one(store.pool())
                        .await
                        .unwrap();
                    n
                };
                assert_eq!(count().await, 0, "the killed attempt's write was kept");
                let r = store.get(&req.key, t0).await.unwrap().unwrap();
                assert_eq!(r.status, Status::InProgress);

                // The retry after the lease takes over, and its write and completion commit.
                let later = t0.saturating_add(Duration::from_secs(31));
                let BeginOutcome::Acquired(retry) = store.begin(&req, later).await.unwrap()
                else {
                    panic!("the retry did not take over");
                };
                assert!(retry.fence > lease.fence);
                let mut tx = store.pool().begin().await.unwrap();
                sqlx::query(AssertSqlSafe(format!($insert, ledger)))
                    .bind("t-1")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                // The overtaken lease cannot complete in a transaction either.
                let stale = store
                    .complete_in(&mut tx, &req.key, &lease, Bytes::new(), later)
                    .await;
                assert!(matches!(stale, Err(LeaseError::Stale(_))), "{stale:?}");
                store
                    .complete_in(&mut tx, &req.key, &retry, Bytes::from_static(b"done"), later)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();

                assert_eq!(count().await, 1);
                assert!(matches!(
                    store.begin(&req, later).await.unwrap(),
                    BeginOutcome::Replay(r) if &r.response[..] == b"done"
                ));
                drop_tables(&store, &[table.clone(), format!("{table}_migrations"), ledger])
                    .await;
            });
        }
    };
}
