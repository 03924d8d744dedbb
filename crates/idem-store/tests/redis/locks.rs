//! Lock states: released with a plain `SET … IFEQ` where the server compares values, and a
//! state in the hash layout of before still honoured.

use std::time::Duration;

use idem_core::{Acquire, LockError, LockName, LockStore, OwnerDigest};
use idem_testkit::services::{REDIS, RedisServer};

use super::*;

fn name(n: &str) -> LockName {
    LockName::new(&format!("locks-{}-{n}", std::process::id())).unwrap()
}

fn held(answer: Acquire) -> idem_core::Held {
    match answer {
        Acquire::Acquired(held) => held,
        Acquire::Busy { .. } => panic!("busy"),
    }
}

/// On Valkey 9 a holder releases with one plain command, and waiters are woken; a release
/// after another call changed the state (a renewal elsewhere, a takeover) is the script's.
#[tokio::test]
async fn a_holder_releases_with_a_plain_command_where_the_server_compares() {
    let Some(server) = RedisServer::start_valkey() else {
        return;
    };
    let store = RedisStore::connect(&server.url(), options()).await.unwrap();
    let other = RedisStore::connect(&server.url(), options()).await.unwrap();
    let (a, b) = (OwnerDigest([1; 32]), OwnerDigest([2; 32]));
    let lease = Duration::from_secs(30);

    let lock = name("plain");
    let first = held(store.acquire(&lock, a, lease).await.unwrap());
    let renewed = store.renew(&lock, a, first.fence, lease).await.unwrap();
    let mut listener = store.listen().expect("a release feed");
    // The feed's own connection subscribes meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = scripts(&server);
    store.release(&lock, a, renewed.fence).await.unwrap();
    assert_eq!(scripts(&server), before, "released without a script");
    // Waiters heard of it, and the next holder's fence is higher.
    let heard = tokio::time::timeout(Duration::from_secs(5), async {
        while listener.next().await.as_deref() != Some(lock.as_str()) {}
    })
    .await;
    assert!(heard.is_ok(), "the release was published");
    let next = held(other.acquire(&lock, b, lease).await.unwrap());
    assert!(next.fence > first.fence);
    // The old holder's release again: not the owner now, said by the script.
    let before = scripts(&server);
    let again = store.release(&lock, a, first.fence).await;
    assert!(matches!(again, Err(LockError::NotOwner)), "{again:?}");
    assert!(scripts(&server) > before);

    // Renewed through another instance: the state moved on, and the script releases it.
    let lock = name("renewed-elsewhere");
    let first = held(store.acquire(&lock, a, lease).await.unwrap());
    // (A longer lease, so that the state changes even within the acquire's millisecond.)
    let longer = Duration::from_secs(60);
    other.renew(&lock, a, first.fence, longer).await.unwrap();
    let before = scripts(&server);
    store.release(&lock, a, first.fence).await.unwrap();
    assert!(scripts(&server) > before, "the script released it");
    let next = held(other.acquire(&lock, b, lease).await.unwrap());
    assert!(next.fence > first.fence);
}

/// A lock state written in the hash layout of before is read by every call: held, it keeps
/// others out and is listed; its holder renews it, releases it or acquires it again (keeping
/// its fence); the next holder's fence is higher.
#[tokio::test]
async fn a_state_in_the_hash_layout_is_still_honoured() {
    let Some(url) = REDIS.url() else {
        return;
    };
    let store = RedisStore::connect(&url, options()).await.unwrap();
    let c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (a, b) = (OwnerDigest([3; 32]), OwnerDigest([4; 32]));
    let now = idem_core::Timestamp::now().as_millis();
    let fence = now * 1000;
    // The state of `lock`, held by `a` under `fence` for 30 s more, as a hash.
    let as_hash = async |lock: &LockName| {
        let key = format!("idem-test:lock:{{{}}}", lock.digest_hex());
        let mut write = redis::pipe();
        write
            .cmd("HSET")
            .arg(&key)
            .arg("o")
            .arg(a.to_hex())
            .arg("f")
            .arg(fence)
            .arg("e")
            .arg(now + 30_000)
            .arg("n")
            .arg(lock.as_str())
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(60_000);
        let _: () = write.query_async(&mut c.clone()).await.unwrap();
    };
    let lease = Duration::from_secs(30);

    // Held: others are kept out, it is listed, its holder renews and releases it.
    let lock = name("hash");
    as_hash(&lock).await;
    let busy = store.acquire(&lock, b, lease).await.unwrap();
    assert!(matches!(busy, Acquire::Busy { .. }), "{busy:?}");
    let listed = store.held(100_000).await.unwrap().unwrap();
    assert!(
        listed.iter().any(|h| h.name == lock && h.fence == fence),
        "the hash state is listed"
    );
    store.renew(&lock, a, fence, lease).await.unwrap();
    store.release(&lock, a, fence).await.unwrap();
    let next = held(store.acquire(&lock, b, lease).await.unwrap());
    assert!(next.fence > fence);
    store.release(&lock, b, next.fence).await.unwrap();

    // Released as it is, and acquired again by its holder (the same fence).
    let lock = name("hash-released");
    as_hash(&lock).await;
    store.release(&lock, a, fence).await.unwrap();
    let next = held(store.acquire(&lock, b, lease).await.unwrap());
    assert!(next.fence > fence);
    let lock = name("hash-again");
    as_hash(&lock).await;
    let again = held(store.acquire(&lock, a, lease).await.unwrap());
    assert_eq!(again.fence, fence, "a repeated acquire keeps the fence");
    store.release(&lock, a, fence).await.unwrap();
}

/// A lock key holding a value this store did not write fails every call on it, and keeps its
/// value.
#[tokio::test]
async fn a_foreign_value_at_a_lock_key_is_left_alone() {
    let Some(url) = REDIS.url() else {
        return;
    };
    let store = RedisStore::connect(&url, options()).await.unwrap();
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let lock = name("foreign");
    let key = format!("idem-test:lock:{{{}}}", lock.digest_hex());
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("not a lock")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut c)
        .await
        .unwrap();
    let owner = OwnerDigest([5; 32]);
    let lease = Duration::from_secs(30);
    assert!(store.acquire(&lock, owner, lease).await.is_err());
    assert!(store.renew(&lock, owner, 1, lease).await.is_err());
    assert!(store.release(&lock, owner, 1).await.is_err());
    let kept: String = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(kept, "not a lock");
}
