//! Locks in etcd against a server this test starts itself: the lock conformance suite,
//! waiters woken one at a time, fences past an ended session, and a cluster losing its leader.
//! Skipped (with a note) where etcd cannot run, except under `CI=true`.

#![cfg(feature = "etcd")]
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::{Acquire, LockOwner, LockStore, SharedLockStore};
use idem_store::{EtcdLocks, EtcdOptions};
use idem_testkit::coordination::Etcd;
use idem_testkit::locks::fresh_name;

/// One server for the whole binary.
fn server() -> Option<&'static Etcd> {
    static SERVER: OnceLock<Option<Etcd>> = OnceLock::new();
    SERVER.get_or_init(Etcd::start).as_ref()
}

async fn locks_on(etcd: &Etcd) -> EtcdLocks {
    EtcdLocks::connect(&etcd.endpoints(), EtcdOptions::default())
        .await
        .unwrap()
}

async fn fixture() -> Option<SharedLockStore> {
    let etcd = server()?;
    Some(Arc::new(locks_on(etcd).await))
}

idem_testkit::lock_conformance_tests!(fixture());

/// Waiters are served in order, each woken by its predecessor only
/// ([`idem_testkit::locks::a_release_wakes_only_the_next_waiter`]).
#[test]
fn a_release_wakes_only_the_next_waiter() {
    idem_testkit::block_on(async {
        let Some(etcd) = server() else { return };
        let locks = locks_on(etcd).await;
        let counter = locks.clone();
        idem_testkit::locks::a_release_wakes_only_the_next_waiter(Arc::new(locks), move || {
            counter.wakeups()
        })
        .await;
    });
}

/// A holder whose store is closed (its process ending) loses its holding at once, and one
/// whose session's lease ran out (its process stopped answering) within the session's length;
/// each next holder's fence is higher.
#[test]
fn fences_rise_past_an_ended_session() {
    idem_testkit::block_on(async {
        let Some(etcd) = server() else { return };
        let name = fresh_name("session");
        let mut last = 0;
        for round in 0..3 {
            let options = EtcdOptions::default().session_ttl(Duration::from_secs(1));
            let locks = EtcdLocks::connect(&etcd.endpoints(), options)
                .await
                .unwrap();
            let who = LockOwner::random().digest();
            let Acquire::Acquired(held) = locks
                .acquire(&name, who, Duration::from_secs(60))
                .await
                .unwrap()
            else {
                panic!("round {round}: the lock is still held after its holder's session ended");
            };
            assert!(
                held.fence > last,
                "round {round}: fence {} after {last}",
                held.fence
            );
            last = held.fence;
            // Closing the store ends its session.
            drop(locks);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
}

/// A holder whose session's lease ended (its process stopped answering for the session's
/// length: here the lease is revoked) has lost the lock: another owner takes it with a higher
/// fence, the old holder's renewal and release are refused, and its store goes on with a new
/// session at its next write. On a server of its own: revoking every lease would end the
/// sessions of the tests running beside it.
#[test]
fn a_holder_whose_session_ended_has_lost_the_lock() {
    idem_testkit::block_on(async {
        let Some(etcd) = Etcd::start() else { return };
        let etcd = &etcd;
        let old = locks_on(etcd).await;
        let name = fresh_name("revoked");
        let (a, b) = (LockOwner::random().digest(), LockOwner::random().digest());
        let long = Duration::from_secs(60);
        let Acquire::Acquired(held) = old.acquire(&name, a, long).await.unwrap() else {
            panic!("a free lock was busy");
        };
        assert!(etcd.revoke_leases() >= 1, "the store has a session");
        let other = locks_on(etcd).await;
        let Acquire::Acquired(next) = other.acquire(&name, b, long).await.unwrap() else {
            panic!("the lock of an ended session is still held");
        };
        assert!(next.fence > held.fence);
        assert!(matches!(
            old.renew(&name, a, held.fence, long).await,
            Err(idem_core::LockError::NotOwner)
        ));
        assert!(matches!(
            old.release(&name, a, held.fence).await,
            Err(idem_core::LockError::NotOwner)
        ));
        // The store opens a new session, and its first write after the loss goes through
        // on it.
        let Acquire::Acquired(later) = old.acquire(&fresh_name("revoked"), a, long).await.unwrap()
        else {
            panic!("a free lock was busy");
        };
        assert!(later.fence > next.fence);
    });
}

/// A waiting acquire dropped while its request to take a free lock is on its way takes the
/// holding back: another owner gets the lock within seconds, not after the dropped one's lease (a
/// minute). The drop comes after 0 to 3 ms, across the round trip.
#[test]
fn a_waiting_acquire_dropped_mid_take_leaves_the_lock_free() {
    idem_testkit::block_on(async {
        let Some(etcd) = server() else { return };
        let locks = locks_on(etcd).await;
        let long = Duration::from_secs(60);
        for round in 0..30u64 {
            let name = fresh_name("dropped");
            let who = LockOwner::random().digest();
            let waiter = LockStore::acquire_queued(&locks, &name, who, long, long).unwrap();
            let answered = tokio::time::timeout(Duration::from_micros(round * 100), waiter).await;
            if let Ok(queued) = answered {
                // Answered in time: its holding is the caller's, given back.
                let Acquire::Acquired(held) = queued.unwrap().answer else {
                    panic!("a free lock was busy");
                };
                locks.release(&name, who, held.fence).await.unwrap();
            }
            // The key taken back in the background: the lock is free well within the dropped
            // one's lease, however loaded the machine.
            let other = LockOwner::random().digest();
            let free = tokio::time::timeout(Duration::from_secs(10), async {
                loop {
                    if let Acquire::Acquired(_) = locks.acquire(&name, other, long).await.unwrap() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
            assert!(
                free.is_ok(),
                "round {round}: the dropped acquire still holds the lock"
            );
        }
    });
}

/// Retries `op` while the cluster elects a new leader (transient errors), for up to 30 s.
async fn through_election<T, E: std::fmt::Debug, F: std::future::Future<Output = Result<T, E>>>(
    mut op: impl FnMut() -> F,
) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("retrying through the election: {e:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("the cluster did not recover: {e:?}"),
        }
    }
}

/// A three-member cluster loses its leader while a lock is held and another owner waits for
/// it: the client moves to a surviving member, the holder releases, the waiter gets the lock
/// with a higher fence, and a lock taken after the election is fenced higher still.
#[test]
fn a_cluster_losing_its_leader_keeps_holders_and_waiters() {
    idem_testkit::block_on(async {
        let Some(mut etcd) = Etcd::start_cluster() else {
            return;
        };
        let locks = locks_on(&etcd).await;
        let name = fresh_name("cluster");
        let (a, b) = (LockOwner::random().digest(), LockOwner::random().digest());
        let Acquire::Acquired(first) = locks
            .acquire(&name, a, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("a free lock was busy");
        };
        let waiter = LockStore::acquire_queued(
            &locks,
            &name,
            b,
            Duration::from_secs(60),
            Duration::from_secs(60),
        )
        .unwrap();
        let waiter = tokio::spawn(waiter);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let leader = etcd.leader().expect("the cluster has a leader");
        etcd.kill(leader);
        through_election(|| locks.release(&name, a, first.fence)).await;
        let queued = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("the waiter is served after the election")
            .unwrap()
            .unwrap();
        let Acquire::Acquired(second) = queued.answer else {
            panic!("the waiter timed out");
        };
        assert!(second.fence > first.fence);
        locks.release(&name, b, second.fence).await.unwrap();
        etcd.restart(leader);
        let other = fresh_name("cluster");
        let later = through_election(|| locks.acquire(&other, a, Duration::from_secs(60))).await;
        let Acquire::Acquired(later) = later else {
            panic!("a free lock was busy");
        };
        assert!(later.fence > second.fence, "revisions only rise");
    });
}

/// The store's session is watched: a revoked session is heard at its next keep-alive, and one
/// whose keep-alives stopped being answered (the server stopped, SIGSTOP) when the cluster may
/// drop it, without waiting for a holding's renewal, so a holder can stop before its keys are
/// gone for good.
#[test]
fn a_session_end_is_heard_without_a_renewal() {
    idem_testkit::block_on(async {
        let Some(etcd) = Etcd::start() else {
            return;
        };
        let options = EtcdOptions::default().session_ttl(Duration::from_secs(3));
        let locks = EtcdLocks::connect(&etcd.endpoints(), options.clone())
            .await
            .unwrap();
        let name = fresh_name("heard");
        let who = LockOwner::random().digest();
        let lease = Duration::from_secs(60);
        let ended = LockStore::session_end(&locks).expect("etcd holdings have a session");
        let Acquire::Acquired(_) = locks.acquire(&name, who, lease).await.unwrap() else {
            panic!("a free lock was busy");
        };
        let mut ended = std::pin::pin!(ended);
        assert!(
            tokio::time::timeout(Duration::from_secs(4), &mut ended)
                .await
                .is_err(),
            "a session kept alive lasts past its length"
        );
        assert!(etcd.revoke_leases() > 0);
        tokio::time::timeout(Duration::from_secs(3), ended)
            .await
            .expect("a revoked session is heard at its next keep-alive, a third of 3 s on");

        // Cut off: heard once no keep-alive was answered for the session's length.
        let locks = EtcdLocks::connect(&etcd.endpoints(), options)
            .await
            .unwrap();
        let ended = LockStore::session_end(&locks).expect("etcd holdings have a session");
        let Acquire::Acquired(_) = locks.acquire(&name, who, lease).await.unwrap() else {
            panic!("the lock of a revoked session is free");
        };
        etcd.pause(0);
        let heard = tokio::time::timeout(Duration::from_secs(5), ended).await;
        etcd.resume(0);
        heard.expect("a session unanswered for its 3 s is given up");
    });
}
