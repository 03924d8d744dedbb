//! A `begin` that fails while the server is stalled must leave nothing claimed, even though
//! the server runs it when it resumes: the next attempt at the key is served at once, not
//! told "in progress" until the failed call's lease runs out. Each test runs a server of its
//! own and stalls it (SIGSTOP, then SIGCONT), so the shared servers are never disturbed.

#![allow(clippy::unwrap_used)]

#[cfg(feature = "redis")]
mod redis_store {
    use std::time::Duration;

    use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, StoreError, Timestamp};
    use idem_store::{RedisOptions, RedisStore};
    use idem_testkit::services::RedisServer;

    /// A private server, a store on it whose commands give up after 300 ms, and the
    /// server's process id.
    async fn stalled_setup() -> Option<(RedisServer, RedisStore, String)> {
        let server = RedisServer::start()?;
        let options = RedisOptions {
            response_timeout: Duration::from_millis(300),
            ..RedisOptions::default()
        };
        let store = RedisStore::connect(&server.url(), options).await.unwrap();
        let client = redis::Client::open(server.url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut c)
            .await
            .unwrap();
        let pid = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .unwrap()
            .trim()
            .to_owned();
        Some((server, store, pid))
    }

    /// Sends `signal` to the test's own server.
    fn signal(pid: &str, signal: &str) {
        let done = std::process::Command::new("kill")
            .args([signal, pid])
            .status()
            .unwrap();
        assert!(done.success(), "kill {signal} {pid}");
    }

    /// Runs `begin` while the server is stopped: it must fail as unavailable. The server
    /// is resumed however the call ends.
    async fn begin_while_stalled(store: &RedisStore, pid: &str, req: &BeginRequest) {
        signal(pid, "-STOP");
        let outcome =
            tokio::time::timeout(Duration::from_secs(30), store.begin(req, Timestamp::now())).await;
        signal(pid, "-CONT");
        let outcome = outcome.expect("a begin against a stalled server gives up by itself");
        assert!(
            matches!(outcome, Err(StoreError::Unavailable { .. })),
            "a begin against a stalled server fails as unavailable: {outcome:?}"
        );
    }

    fn request(k: &str) -> BeginRequest {
        BeginRequest::new(
            Key::parse("late", "claims", k).unwrap(),
            Fingerprint::of_bytes(b"body"),
        )
    }

    async fn begin(store: &RedisStore, req: &BeginRequest) -> BeginOutcome {
        tokio::time::timeout(Duration::from_secs(30), store.begin(req, Timestamp::now()))
            .await
            .unwrap()
            .unwrap()
    }

    /// A fresh key: the failed `begin` is the plain `SET … NX`, run when the server resumes.
    #[test]
    fn a_fresh_key_a_timed_out_begin_took_is_given_back() {
        idem_testkit::block_on(async {
            let Some((_server, store, pid)) = stalled_setup().await else {
                return;
            };
            let req = request("fresh");
            begin_while_stalled(&store, &pid, &req).await;
            // Another attempt at the same request.
            let next = begin(&store, &req).await;
            assert!(
                matches!(next, BeginOutcome::Acquired(lease) if lease.fence == 2),
                "the next attempt takes the key over at once: {next:?}"
            );
        });
    }

    /// The give-back touches only what the failed `begin` took: a key another attempt
    /// holds stays held, and its holder completes it.
    #[test]
    fn a_key_held_by_another_attempt_stays_held() {
        idem_testkit::block_on(async {
            let Some((_server, store, pid)) = stalled_setup().await else {
                return;
            };
            let req = request("held");
            let BeginOutcome::Acquired(holder) = begin(&store, &req).await else {
                panic!("a fresh key is acquired");
            };
            begin_while_stalled(&store, &pid, &req).await;
            assert!(matches!(
                begin(&store, &req).await,
                BeginOutcome::InProgress { .. }
            ));
            store
                .complete(&req.key, &holder, b"done".to_vec().into(), Timestamp::now())
                .await
                .unwrap();
            assert!(matches!(begin(&store, &req).await, BeginOutcome::Replay(_)));
        });
    }
}

/// PostgreSQL never gives up on a statement it sent; a stalled server fails the ping the pool
/// sends before handing out a connection, so a `begin` that fails was never sent, and the key
/// is free the moment the server is back.
#[cfg(feature = "postgres")]
mod postgres {
    use std::time::Duration;

    use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, StoreError, Timestamp};
    use idem_store::{PostgresOptions, PostgresStore};
    use idem_testkit::services::{SqlKind, SqlServer};

    /// Sends `signal` to the server's processes: the postmaster and every child (backends
    /// lead process groups of their own). Stopped parent first, resumed parent last.
    fn signal(postmaster: &str, signal: &str) {
        let parent = || {
            std::process::Command::new("kill")
                .args([signal, postmaster])
                .status()
                .unwrap()
        };
        let children = || {
            std::process::Command::new("pkill")
                .args([signal, "-P", postmaster])
                .status()
                .unwrap()
        };
        if signal == "-STOP" {
            assert!(parent().success());
            assert!(children().success());
        } else {
            assert!(children().success());
            assert!(parent().success());
        }
    }

    #[test]
    fn a_begin_against_a_stalled_server_is_never_sent() {
        idem_testkit::block_on(async {
            let Some(server) = SqlServer::start(SqlKind::Postgres) else {
                return;
            };
            let options = PostgresOptions {
                acquire_timeout: Duration::from_millis(500),
                ..PostgresOptions::default()
            };
            let store = PostgresStore::connect_with(&server.url(), options)
                .await
                .unwrap();
            let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(store.pool())
                .await
                .unwrap();
            let ps = std::process::Command::new("ps")
                .args(["-o", "ppid=", "-p", &backend.to_string()])
                .output()
                .unwrap();
            let postmaster = String::from_utf8(ps.stdout).unwrap().trim().to_owned();
            let req = BeginRequest::new(
                Key::parse("late", "claims", "pg").unwrap(),
                Fingerprint::of_bytes(b"body"),
            );
            signal(&postmaster, "-STOP");
            let failed =
                tokio::time::timeout(Duration::from_secs(30), store.begin(&req, Timestamp::now()))
                    .await;
            signal(&postmaster, "-CONT");
            let failed = failed.expect("a begin against a stalled server gives up by itself");
            assert!(
                matches!(failed, Err(StoreError::Unavailable { .. })),
                "{failed:?}"
            );
            let next =
                tokio::time::timeout(Duration::from_secs(30), store.begin(&req, Timestamp::now()))
                    .await
                    .unwrap()
                    .unwrap();
            assert!(
                matches!(next, BeginOutcome::Acquired(lease) if lease.fence == 1),
                "the failed begin took nothing: {next:?}"
            );
        });
    }
}
