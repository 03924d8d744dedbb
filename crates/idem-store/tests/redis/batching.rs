//! Group commit: calls sent together, each with its own answer.

use super::*;

/// Calls that arrive while others are in flight go to the server together (group commit: one
/// pipeline begins many records, one script call completes many), and each still gets its own
/// answer: fresh keys are acquired, a completed key replays, a held key is in progress, a key
/// holding a value the store did not write fails alone; each completion stores its own
/// response, a repeated one is accepted, a stale one refused, and one whose record turned
/// foreign fails alone without keeping the others from completing.
#[test]
fn calls_sent_together_each_get_their_own_answer() {
    use std::sync::Arc;

    use idem_core::{
        BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, LeaseError, Status, Store, StoreError,
        Timestamp,
    };

    /// The record commands clients sent since the last call (see [`commands_sent`]): how
    /// many, and the most keys one script call named.
    async fn sent(c: &mut redis::aio::MultiplexedConnection) -> (usize, usize) {
        let (mut commands, mut widest) = (0, 0);
        for args in commands_sent(c).await {
            let name = args.first().cloned().unwrap_or_default();
            if !["SET", "EVALSHA", "EVAL"].contains(&&*name) {
                continue;
            }
            commands += 1;
            if name != "SET" {
                let keys = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(0);
                widest = widest.max(keys);
            }
        }
        (commands, widest)
    }

    idem_testkit::block_on(async {
        // A server of its own, so that its command counts are this test's.
        let Some(server) = idem_testkit::services::RedisServer::start() else {
            return;
        };
        let url = server.url();
        let store = Arc::new(RedisStore::connect(&url, options()).await.unwrap());
        let mut c = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        log_every_command(&mut c).await;
        let now = Timestamp::now();
        // 'static, so that the closures below are `Copy` and go into every task.
        let scope: &'static str =
            format!("batch-{}-{}", std::process::id(), now.as_millis()).leak();
        let key = move |i: usize| Key::parse(scope, "pay", &format!("k{i}")).unwrap();
        let req = move |i| BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"));
        let body = |i: usize| Bytes::from(format!("body {i}").into_bytes());
        let l0 = match store.begin(&req(0), now).await.unwrap() {
            BeginOutcome::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        store.complete(&key(0), &l0, body(0), now).await.unwrap();
        let BeginOutcome::Acquired(l1) = store.begin(&req(1), now).await.unwrap() else {
            panic!("k1 not acquired");
        };
        let _: () = redis::cmd("SET")
            .arg(store.redis_key(&key(2)))
            .arg("not a record")
            .query_async(&mut c)
            .await
            .unwrap();

        pause_writes(&mut c).await;
        sent(&mut c).await;
        let begins: Vec<_> = (0..40)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move { store.begin(&req(i), now).await })
            })
            .collect();
        let mut leases = Vec::new();
        for (i, begin) in begins.into_iter().enumerate() {
            match (i, begin.await.unwrap()) {
                (0, Ok(BeginOutcome::Replay(r))) => assert_eq!(r.response, body(0)),
                (1, Ok(BeginOutcome::InProgress { .. })) | (2, Err(StoreError::Corrupt(_))) => {}
                (i, Ok(BeginOutcome::Acquired(lease))) if i >= 3 => {
                    assert_eq!(lease.fence, idem_core::Lease::first_fence(now));
                    leases.push((i, lease));
                }
                (i, other) => panic!("k{i}: {other:?}"),
            }
        }
        // One by one, each begin is a `SET … NX GET PX`; together, the batch's claims are a
        // pipeline of `SET … NX PX`, one per key (the keys it does not take then go alone).
        let batched = batched_claims(&mut c).await;
        assert!(batched >= 37, "{batched} of 40 begins claimed as a batch");

        // k0 completed again by its own lease (accepted), k1 by the lease of k39, which stays
        // in progress (refused), k3's record replaced by a foreign value (refused, and the
        // script that meets it stops part way), and every other fresh key with its own body.
        // (A batch tells its records apart by key, but the batcher also keeps two calls under
        // one lease id apart, so k39 itself is not completed here.)
        let (_, stale) = leases.pop().unwrap();
        let _: () = redis::cmd("SET")
            .arg(store.redis_key(&key(3)))
            .arg("not a record either")
            .query_async(&mut c)
            .await
            .unwrap();
        pause_writes(&mut c).await;
        sent(&mut c).await;
        let completes: Vec<_> = leases
            .iter()
            .copied()
            .chain([(0, l0), (1, stale)])
            .map(|(i, lease)| {
                let store = store.clone();
                let response = body(i);
                tokio::spawn(
                    async move { (i, store.complete(&key(i), &lease, response, now).await) },
                )
            })
            .collect();
        for complete in completes {
            match complete.await.unwrap() {
                (1, done) => assert!(matches!(done, Err(LeaseError::Stale(_))), "{done:?}"),
                (3, done) => assert!(
                    matches!(done, Err(LeaseError::Store(StoreError::Corrupt(_)))),
                    "{done:?}"
                ),
                (i, done) => assert!(done.is_ok(), "k{i}: {done:?}"),
            }
        }
        // The script meeting k3 stops part way, and the rest of its batch settles one by one.
        let (completed, widest) = sent(&mut c).await;
        assert!(
            widest > 1,
            "{completed} commands for 38 completes, {widest} keys at most"
        );
        for i in (0..39).filter(|i| ![1, 2, 3].contains(i)) {
            let r = store.get(&key(i), now).await.unwrap().unwrap();
            assert_eq!(
                (r.status, r.response),
                (Status::Completed, Some(body(i))),
                "k{i}"
            );
        }
        let r = store.get(&key(1), now).await.unwrap().unwrap();
        assert_eq!((r.status, r.fence), (Status::InProgress, l1.fence));
        let r = store.get(&key(39), now).await.unwrap().unwrap();
        assert_eq!(r.status, Status::InProgress);
    });
}

/// A batch of claims that the server refuses in part (here an ACL that lets the store write
/// only about half of the record keys) still acquires every key it wrote, and each refused
/// one fails on its own: no record is left claimed under a lease nobody was given.
#[test]
fn a_batch_refused_in_part_acquires_what_it_wrote() {
    use std::sync::Arc;

    use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, Store, Timestamp};

    idem_testkit::block_on(async {
        let Some(server) = idem_testkit::services::RedisServer::start() else {
            return;
        };
        let url = server.url();
        let mut c = redis::Client::open(url.clone())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        // Record keys are `idem-test:{<hex digest>}`: those whose digest begins with 0 to 7.
        let mut acl = redis::cmd("ACL");
        acl.arg("SETUSER").arg("half").arg("on").arg(">secret");
        for d in '0'..='7' {
            acl.arg(format!("~idem-test:{{{d}*"));
        }
        acl.arg("+@all");
        let _: () = acl.query_async(&mut c).await.unwrap();
        let limited = url.replacen("redis://", "redis://half:secret@", 1);
        let store = Arc::new(RedisStore::connect(&limited, options()).await.unwrap());
        let now = Timestamp::now();
        let scope: &'static str = format!("half-{}", now.as_millis()).leak();
        let key = move |i: usize| Key::parse(scope, "pay", &format!("k{i}")).unwrap();
        let allowed = |i: usize| {
            let name = store.redis_key(&key(i));
            name.as_bytes()[name.find('{').unwrap() + 1] < b'8'
        };

        log_every_command(&mut c).await;
        pause_writes(&mut c).await;
        commands_sent(&mut c).await;
        let begins: Vec<_> = (0..80)
            .map(|i| {
                let store = store.clone();
                let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"r"));
                tokio::spawn(async move { store.begin(&req, now).await })
            })
            .collect();
        let mut refused = 0;
        for (i, begin) in begins.into_iter().enumerate() {
            match begin.await.unwrap() {
                Ok(BeginOutcome::Acquired(_)) => assert!(allowed(i), "k{i} was refused"),
                Err(e) => {
                    assert!(!allowed(i), "k{i} could be written: {e}");
                    refused += 1;
                }
                other => panic!("k{i}: {other:?}"),
            }
        }
        assert!(refused > 0 && refused < 80, "{refused} of 80 refused");
        // The keys it could write went as a batch's claims (about forty).
        let batched = batched_claims(&mut c).await;
        assert!(batched >= 20, "{batched} claims went as a batch");
    });
}
