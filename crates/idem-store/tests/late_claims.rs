//! A `begin` that fails while the server is stalled must leave nothing claimed, even though
//! the server runs it when it resumes: the next attempt at the key is served at once, not
//! told "in progress" until the failed call's lease runs out. Each test runs a server of its
//! own and stalls it (SIGSTOP, then SIGCONT), so the shared servers are never disturbed.

#![allow(clippy::unwrap_used)]

/// What every test here does: stall its own server, `begin`, resume it, and look again.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
mod support {
    use std::time::Duration;

    use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, StoreError, Timestamp};

    /// Sends `signal` (`-STOP`, `-CONT`) to a process of the test's own server.
    pub(crate) fn kill(signal: &str, pid: &str) {
        let done = std::process::Command::new("kill")
            .args([signal, pid])
            .status()
            .unwrap();
        assert!(done.success(), "kill {signal} {pid}");
    }

    pub(crate) fn request(k: &str) -> BeginRequest {
        BeginRequest::new(
            Key::parse("late", "claims", k).unwrap(),
            Fingerprint::of_bytes(b"body"),
        )
    }

    /// Runs `begin` between `stop` and `resume` (called however the call ends): it must
    /// fail as unavailable, by itself.
    pub(crate) async fn begin_while_stalled<S: Store>(
        store: &S,
        req: &BeginRequest,
        stop: impl FnOnce(),
        resume: impl FnOnce(),
    ) {
        stop();
        let outcome =
            tokio::time::timeout(Duration::from_secs(30), store.begin(req, Timestamp::now())).await;
        resume();
        let outcome = outcome.expect("a begin against a stalled server gives up by itself");
        assert!(
            matches!(outcome, Err(StoreError::Unavailable { .. })),
            "a begin against a stalled server fails as unavailable: {outcome:?}"
        );
    }

    pub(crate) async fn begin<S: Store>(store: &S, req: &BeginRequest) -> BeginOutcome {
        tokio::time::timeout(Duration::from_secs(30), store.begin(req, Timestamp::now()))
            .await
            .unwrap()
            .unwrap()
    }
}

#[cfg(feature = "redis")]
mod redis_store {
    use std::time::Duration;

    use idem_core::{BeginOutcome, Store, Timestamp};
    use idem_store::{RedisOptions, RedisStore};
    use idem_testkit::services::RedisServer;

    use crate::support::{begin, begin_while_stalled, kill, request};

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

    /// A fresh key: the failed `begin` is the plain `SET … NX`, run when the server resumes.
    #[test]
    fn a_fresh_key_a_timed_out_begin_took_is_given_back() {
        idem_testkit::block_on(async {
            let Some((_server, store, pid)) = stalled_setup().await else {
                return;
            };
            let req = request("fresh");
            begin_while_stalled(&store, &req, || kill("-STOP", &pid), || kill("-CONT", &pid)).await;
            // Another attempt at the same request.
            let next = begin(&store, &req).await;
            assert!(
                matches!(next, BeginOutcome::Acquired(lease) if lease.may_resume()),
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
            begin_while_stalled(&store, &req, || kill("-STOP", &pid), || kill("-CONT", &pid)).await;
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

/// The SQL stores never give up on a statement they sent; a stalled server fails the ping
/// the pool sends before handing out a connection, so a `begin` that fails was never sent,
/// and the key is free the moment the server is back.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql {
    use std::time::Duration;

    use idem_core::{BeginOutcome, Store};
    use idem_testkit::services::{SqlKind, SqlServer};

    use crate::support::{begin, begin_while_stalled, kill, request};

    /// A `begin` while `stop`ped fails; once resumed, the next attempt gets a fresh key.
    async fn a_failed_begin_took_nothing<S: Store>(
        store: &S,
        key: &str,
        stop: impl FnOnce(),
        resume: impl FnOnce(),
    ) {
        let req = request(key);
        begin_while_stalled(store, &req, stop, resume).await;
        let next = begin(store, &req).await;
        assert!(
            matches!(next, BeginOutcome::Acquired(lease) if !lease.may_resume()),
            "the failed begin took nothing: {next:?}"
        );
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn a_begin_against_a_stalled_postgres_is_never_sent() {
        use idem_store::{PostgresOptions, PostgresStore};
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
            // The postmaster and every child (backends lead process groups of their own):
            // the parent stopped first and resumed last.
            let children = |signal: &str| {
                let done = std::process::Command::new("pkill")
                    .args([signal, "-P", &postmaster])
                    .status()
                    .unwrap();
                assert!(done.success(), "pkill {signal} -P {postmaster}");
            };
            let stop = || {
                kill("-STOP", &postmaster);
                children("-STOP");
            };
            let resume = || {
                children("-CONT");
                kill("-CONT", &postmaster);
            };
            a_failed_begin_took_nothing(&store, "pg", stop, resume).await;
        });
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn a_begin_against_a_stalled_mariadb_is_never_sent() {
        use idem_store::{MySqlOptions, MySqlStore};
        idem_testkit::block_on(async {
            let Some(server) = SqlServer::start(SqlKind::MariaDb) else {
                return;
            };
            let options = MySqlOptions {
                acquire_timeout: Duration::from_millis(500),
                ..MySqlOptions::default()
            };
            let store = MySqlStore::connect_with(&server.url(), options)
                .await
                .unwrap();
            // One process, many threads: stopping it stops the server.
            let pid_file: String = sqlx::query_scalar("SELECT @@pid_file")
                .fetch_one(store.pool())
                .await
                .unwrap();
            let pid = std::fs::read_to_string(pid_file).unwrap().trim().to_owned();
            let stop = || kill("-STOP", &pid);
            let resume = || kill("-CONT", &pid);
            a_failed_begin_took_nothing(&store, "mariadb", stop, resume).await;
        });
    }
}
