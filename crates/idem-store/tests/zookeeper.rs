//! Locks in ZooKeeper against a server this test starts itself: the lock conformance suite,
//! waiters woken one at a time, fences across a lost session and a restarted server, and an
//! ensemble losing its leader. Skipped (with a note) where ZooKeeper cannot run, except under
//! `CI=true`.

#![cfg(feature = "zookeeper")]
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::{Acquire, LockOwner, LockStore, SharedLockStore};
use idem_store::{ZooKeeperLocks, ZooKeeperOptions};
use idem_testkit::coordination::ZooKeeper;
use idem_testkit::locks::fresh_name;

/// One server for the whole binary.
fn server() -> Option<&'static ZooKeeper> {
    static SERVER: OnceLock<Option<ZooKeeper>> = OnceLock::new();
    SERVER.get_or_init(ZooKeeper::start).as_ref()
}

async fn locks_on(zk: &ZooKeeper, session: Duration) -> ZooKeeperLocks {
    let options = ZooKeeperOptions::default().session_timeout(session);
    ZooKeeperLocks::connect(&zk.hosts(), options).await.unwrap()
}

async fn fixture() -> Option<SharedLockStore> {
    let zk = server()?;
    Some(Arc::new(locks_on(zk, Duration::from_secs(10)).await))
}

idem_testkit::lock_conformance_tests!(fixture());

/// Waiters are served in order, each woken by its predecessor only
/// ([`idem_testkit::locks::a_release_wakes_only_the_next_waiter`]).
#[test]
fn a_release_wakes_only_the_next_waiter() {
    idem_testkit::block_on(async {
        let Some(zk) = server() else { return };
        let locks = locks_on(zk, Duration::from_secs(10)).await;
        let counter = locks.clone();
        idem_testkit::locks::a_release_wakes_only_the_next_waiter(Arc::new(locks), move || {
            counter.wakeups()
        })
        .await;
    });
}

/// A holder whose session ends (its process stopped) loses its holding at once; the next
/// holder's fence is higher, also once the lock's node was removed as empty and made again
/// (which starts sequence numbers over).
#[test]
fn fences_rise_past_an_ended_session() {
    idem_testkit::block_on(async {
        let Some(zk) = server() else { return };
        let name = fresh_name("session");
        let mut last = 0;
        for round in 0..3 {
            let locks = locks_on(zk, Duration::from_secs(10)).await;
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
            // The session ends with the store; then the empty lock node is reaped.
            drop(locks);
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
    });
}

/// Retries `op` while the ensemble elects a new leader (transient errors), for up to 30 s.
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
            Err(e) => panic!("the ensemble did not recover: {e:?}"),
        }
    }
}

/// A three-member ensemble loses its leader while a lock is held and another owner waits for
/// it: the session moves to a surviving member, the holder releases, the waiter gets the lock
/// with a higher fence, and a lock taken after the election is fenced higher still.
#[test]
fn an_ensemble_losing_its_leader_keeps_holders_and_waiters() {
    idem_testkit::block_on(async {
        let Some(mut zk) = ZooKeeper::start_ensemble() else {
            return;
        };
        let locks = locks_on(&zk, Duration::from_secs(10)).await;
        let name = fresh_name("ensemble");
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
        let leader = zk.leader().expect("the ensemble has a leader");
        zk.kill(leader);
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
        zk.restart(leader);
        let other = fresh_name("ensemble");
        let later = through_election(|| locks.acquire(&other, a, Duration::from_secs(60))).await;
        let Acquire::Acquired(later) = later else {
            panic!("a free lock was busy");
        };
        assert!(later.fence > second.fence, "a new epoch's zxids are higher");
    });
}

/// A released holding stays releasable again by its owner until another owner takes the lock,
/// also when that owner's own next acquire finds the lock busy (here: another owner's waiter,
/// written by hand, first in line) and so takes nothing.
#[test]
fn a_release_stays_repeatable_after_the_owner_finds_the_lock_busy() {
    idem_testkit::block_on(async {
        let Some(zk) = server() else { return };
        let locks = locks_on(zk, Duration::from_secs(10)).await;
        let name = fresh_name("repeat");
        let a = LockOwner::random().digest();
        let lease = Duration::from_secs(60);
        let Acquire::Acquired(held) = locks.acquire(&name, a, lease).await.unwrap() else {
            panic!("a free lock was busy");
        };
        locks.release(&name, a, held.fence).await.unwrap();

        let raw = zookeeper_client::Client::connect(&zk.hosts())
            .await
            .unwrap();
        let waiter = format!(
            "{}/locks/{}/{}-",
            ZooKeeperOptions::default().root,
            name.digest_hex(),
            LockOwner::random().digest().to_hex()
        );
        let mode = zookeeper_client::CreateMode::EphemeralSequential
            .with_acls(zookeeper_client::Acls::anyone_all());
        let (_, seq) = raw.create(&waiter, b"w 60000", &mode).await.unwrap();

        let again = locks.acquire(&name, a, lease).await.unwrap();
        assert!(matches!(again, Acquire::Busy { .. }), "{again:?}");
        locks
            .release(&name, a, held.fence)
            .await
            .expect("no one took the lock since the release: it is released again");

        raw.delete(&format!("{waiter}{seq}"), None).await.unwrap();
        let Acquire::Acquired(next) = locks.acquire(&name, a, lease).await.unwrap() else {
            panic!("the lock is free once the waiter left");
        };
        assert!(next.fence > held.fence);
        assert!(
            locks.release(&name, a, held.fence).await.is_err(),
            "the earlier holding is over once the lock was taken again"
        );
    });
}

/// The store's session is watched: once the ensemble stops answering (here its server is
/// stopped, SIGSTOP, so the connection stays open and the client library goes on reporting it
/// up), its end is heard when no answer has vouched for it for as long as the ensemble keeps
/// a silent session (8 s of its 10 s), without waiting for a renewal, so a holder can stop
/// before the ensemble gives its lock to the next owner.
#[test]
fn a_session_that_loses_touch_is_heard_at_once() {
    idem_testkit::block_on(async {
        let Some(zk) = ZooKeeper::start() else {
            return;
        };
        let locks = locks_on(&zk, Duration::from_secs(10)).await;
        let name = fresh_name("touch");
        let who = LockOwner::random().digest();
        let ended = LockStore::session_end(&locks).expect("ZooKeeper holdings have a session");
        let Acquire::Acquired(_) = locks
            .acquire(&name, who, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("a free lock was busy");
        };
        let ended = tokio::spawn(ended);
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!ended.is_finished(), "a session the ensemble answers lasts");
        zk.pause(0);
        let heard = tokio::time::timeout(Duration::from_secs(11), ended).await;
        zk.resume(0);
        heard
            .expect("the silence is heard within the 8 s the ensemble keeps a session")
            .unwrap();
    });
}
