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
