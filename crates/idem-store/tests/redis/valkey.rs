//! The store on a Valkey 9 server, which compares and sets values (`SET … IFEQ`): the
//! conformance suite with settles as plain commands, and those settles seen on the server.

use std::time::Duration;

use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Lease, Status, Step, Store};
use idem_testkit::services::RedisServer;

use super::*;

async fn fixture() -> Option<Fixture<RedisStore>> {
    let server = RedisServer::valkey()?;
    Some(Fixture::new(
        RedisStore::connect(&server.url(), options()).await.unwrap(),
    ))
}

idem_testkit::conformance_tests!(fixture());

mod locks {
    use std::sync::Arc;

    use idem_core::SharedLockStore;

    idem_testkit::lock_conformance_tests!(async {
        Some(Arc::new(super::fixture().await?.store) as SharedLockStore)
    });
}

/// Locks on a Cluster of three Valkey 9 primaries: released by plain commands too, the
/// `PUBLISH` that wakes waiters sent after the `SET` (its channel lives on another slot).
mod cluster_locks {
    use std::sync::Arc;

    use idem_core::SharedLockStore;
    use idem_testkit::services::RedisCluster;

    use super::*;

    async fn fixture() -> Option<SharedLockStore> {
        let cluster = RedisCluster::shared_valkey()?;
        let store = RedisStore::connect_cluster(&cluster.urls(), options())
            .await
            .unwrap();
        Some(Arc::new(store) as SharedLockStore)
    }

    idem_testkit::lock_conformance_tests!(fixture());
}

fn request(key: &str) -> BeginRequest {
    BeginRequest::new(
        Key::parse("valkey", "plain", key).unwrap(),
        Fingerprint::of_bytes(b"the request"),
    )
    .with_lease(Duration::from_secs(30))
}

async fn acquire(store: &RedisStore, req: &BeginRequest, now: idem_core::Timestamp) -> Lease {
    match store.begin(req, now).await.unwrap() {
        BeginOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// A record this instance claimed is completed, released and renewed with plain commands and
/// no script; a record another instance stepped on meanwhile is settled by the script.
#[tokio::test]
async fn settles_go_as_plain_commands_until_the_record_moves_on() {
    let Some(server) = RedisServer::start_valkey() else {
        return;
    };
    let store = RedisStore::connect(&server.url(), options()).await.unwrap();
    let other = RedisStore::connect(&server.url(), options()).await.unwrap();
    let now = idem_core::Timestamp::now();
    let before = scripts(&server);

    // Claimed here, renewed and completed here: no script.
    let req = request("completed");
    let lease = acquire(&store, &req, now).await;
    let lease = store
        .renew(&req.key, &lease, Duration::from_secs(60), now)
        .await
        .unwrap();
    store
        .complete(&req.key, &lease, "done".into(), now)
        .await
        .unwrap();
    let record = store.get(&req.key, now).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    assert_eq!(record.response.as_deref(), Some(&b"done"[..]));
    assert_eq!(record.lease_expires_at, lease.expires_at);
    // Released the same way.
    let req = request("released");
    let lease = acquire(&store, &req, now).await;
    store.release(&req.key, &lease, now).await.unwrap();
    let record = store.get(&req.key, now).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Released);
    assert_eq!(scripts(&server), before, "claims settled without a script");

    // Another instance records a step in the claim's very millisecond: the record has moved
    // on, the plain `SET … IFEQ` finds it so, and the script completes it with its step.
    let req = request("stepped");
    let lease = acquire(&store, &req, now).await;
    let step = Step::done(idem_core::StepName::new("debit").unwrap(), b"1".to_vec()).unwrap();
    other
        .record_step(&req.key, &lease, &step, now)
        .await
        .unwrap();
    let before = scripts(&server);
    store
        .complete(&req.key, &lease, "done".into(), now)
        .await
        .unwrap();
    assert!(
        scripts(&server) > before,
        "the moved-on record went to the script"
    );
    let record = store.get(&req.key, now).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    assert_eq!(record.steps, vec![step.clone()]);

    // A step by the claimer itself: it knows the record moved on, and sends its completion
    // straight to the script, with no `SET … IFEQ` bound to miss.
    let req = request("stepped-here");
    let lease = acquire(&store, &req, now).await;
    store
        .record_step(&req.key, &lease, &step, now)
        .await
        .unwrap();
    let mut c = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    log_every_command(&mut c).await;
    commands_sent(&mut c).await;
    store
        .complete(&req.key, &lease, "done".into(), now)
        .await
        .unwrap();
    // (Valkey logs the commands a script runs as its caller's too.)
    let sent = commands_sent(&mut c).await;
    assert!(
        !sent.iter().any(|args| args.iter().any(|a| a == "IFEQ")),
        "no plain SET … IFEQ tried first: {sent:?}"
    );
    assert!(sent.iter().any(|args| args[0] == "EVALSHA"), "{sent:?}");

    // A lease taken over is refused, by the script, and the new holder's answer stays.
    let req = request("taken-over").with_lease(Duration::from_millis(1));
    let first = acquire(&store, &req, now).await;
    let later = now.saturating_add(Duration::from_millis(10));
    let second = acquire(&other, &req, later).await;
    assert!(
        store
            .complete(&req.key, &first, "late".into(), later)
            .await
            .is_err()
    );
    other
        .complete(&req.key, &second, "mine".into(), later)
        .await
        .unwrap();
    let record = store.get(&req.key, later).await.unwrap().unwrap();
    assert_eq!(record.response.as_deref(), Some(&b"mine"[..]));
}

/// On Redis 7, which has no `SET … IFEQ`, every settle goes by the script, as before.
#[tokio::test]
async fn a_server_without_ifeq_settles_by_script() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url(), options()).await.unwrap();
    let now = idem_core::Timestamp::now();
    let req = request("scripted");
    let lease = acquire(&store, &req, now).await;
    let before = scripts(&server);
    store
        .complete(&req.key, &lease, "done".into(), now)
        .await
        .unwrap();
    assert!(scripts(&server) > before);
    let record = store.get(&req.key, now).await.unwrap().unwrap();
    assert_eq!(record.response.as_deref(), Some(&b"done"[..]));
}

/// Claims sent together go as one pipeline of plain `SET … NX PX`, not a script; each still
/// gets its own answer (a replay, an attempt in flight, fresh keys acquired), and the batch
/// of completions that follows goes without a script too.
#[tokio::test]
async fn claims_sent_together_go_as_a_pipeline_of_plain_commands() {
    let Some(server) = RedisServer::start_valkey() else {
        return;
    };
    let url = server.url();
    let store = std::sync::Arc::new(RedisStore::connect(&url, options()).await.unwrap());
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    log_every_command(&mut c).await;
    let now = idem_core::Timestamp::now();
    let req = |i: usize| request(&format!("batch-{i}"));
    let done = acquire(&store, &req(0), now).await;
    store
        .complete(&req(0).key, &done, "0".into(), now)
        .await
        .unwrap();
    acquire(&store, &req(1), now).await;

    // Every write waits a moment: the begins sent meanwhile queue, and go together.
    pause_writes(&mut c).await;
    batched_claims(&mut c).await;
    let before = scripts(&server);
    let begins: Vec<_> = (0..40)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&req(i), now).await })
        })
        .collect();
    let mut leases = Vec::new();
    for (i, begin) in begins.into_iter().enumerate() {
        match (i, begin.await.unwrap().unwrap()) {
            (0, BeginOutcome::Replay(r)) => assert_eq!(&r.response[..], b"0"),
            (1, BeginOutcome::InProgress { .. }) => {}
            (i, BeginOutcome::Acquired(lease)) if i >= 2 => leases.push((i, lease)),
            (i, other) => panic!("k{i}: {other:?}"),
        }
    }
    let batched = batched_claims(&mut c).await;
    assert!(
        batched >= 38,
        "{batched} claims went as a batch's SET … NX PX"
    );
    assert_eq!(scripts(&server), before, "no script claimed");

    let completes: Vec<_> = leases
        .into_iter()
        .map(|(i, lease)| {
            let store = store.clone();
            tokio::spawn(async move {
                let body = idem_core::Bytes::from(i.to_string());
                store.complete(&req(i).key, &lease, body, now).await
            })
        })
        .collect();
    for complete in completes {
        complete.await.unwrap().unwrap();
    }
    assert_eq!(scripts(&server), before, "no script completed");
    for i in 2..40 {
        let record = store.get(&req(i).key, now).await.unwrap().unwrap();
        assert_eq!(record.status, Status::Completed);
        assert_eq!(record.response.as_deref(), Some(i.to_string().as_bytes()));
    }
}

/// A Cluster settles plainly only when every primary takes `SET … IFEQ`: on three Valkey 9
/// primaries, records on every node complete without a script; with one Redis 7 among them,
/// by script on every node.
#[tokio::test]
async fn a_cluster_settles_plainly_only_when_every_primary_can() {
    use idem_testkit::services::RedisCluster;

    for valkeys in [3, 2] {
        let Some(cluster) = RedisCluster::start_with_valkeys(valkeys) else {
            return;
        };
        let store = RedisStore::connect_cluster(&cluster.urls(), options())
            .await
            .unwrap();
        let scripts = || cluster.nodes().iter().map(scripts).sum::<u64>();
        let now = idem_core::Timestamp::now();
        let before = scripts();
        // Thirty keys: each primary holds some.
        for i in 0..30 {
            let req = request(&format!("cluster-{i}"));
            let lease = acquire(&store, &req, now).await;
            store
                .complete(&req.key, &lease, "done".into(), now)
                .await
                .unwrap();
            let record = store.get(&req.key, now).await.unwrap().unwrap();
            assert_eq!(record.status, Status::Completed);
        }
        let ran = scripts() - before;
        if valkeys == 3 {
            assert_eq!(ran, 0, "every primary takes SET … IFEQ");
        } else {
            assert!(ran >= 30, "a Redis 7 primary: {ran} scripts for 30 settles");
        }
        // Known before the first settle: no node was ever sent a SET it refused (a refused
        // option counts as a failed call).
        let refused: u64 = cluster
            .nodes()
            .iter()
            .map(|n| {
                n.info("commandstats")
                    .lines()
                    .find(|l| l.starts_with("cmdstat_set:"))
                    .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("failed_calls=")))
                    .and_then(|c| c.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum();
        assert_eq!(refused, 0, "a SET … IFEQ was refused");
    }
}
