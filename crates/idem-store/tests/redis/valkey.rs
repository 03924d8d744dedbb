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

/// How many times the server ran each command since it started (`INFO commandstats`).
fn calls(server: &RedisServer, command: &str) -> u64 {
    server
        .info("commandstats")
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn scripts(server: &RedisServer) -> u64 {
    calls(server, "evalsha") + calls(server, "eval")
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
    assert_eq!(record.steps, vec![step]);

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
