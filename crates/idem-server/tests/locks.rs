//! The lock endpoints: acquire, renew, release, the refusal codes, scopes, retried acquires,
//! waiting, and a store that keeps no locks.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::{BANK, SHOP, post, with_callers};
use idem_server::AppState;
use idem_server::auth::Auth;
use idem_store::MemoryStore;
use idem_testkit::{Fault, FaultyStore, Op, Stall, within};
use serde_json::{Value, json};

fn state() -> AppState {
    let store = Arc::new(MemoryStore::new());
    with_callers(AppState::new(store.clone()).with_locks(store))
}

#[tokio::test]
async fn acquire_renew_release_and_the_refusals() {
    let state = state();
    let (status, first) = post(
        &state,
        SHOP,
        "/v1/locks/payouts/acquire",
        json!({"lease_ms": 60000}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let lock = first["lock"].as_str().unwrap().to_owned();
    let fence = first["fence"].as_u64().unwrap();
    assert!(lock.ends_with(&format!(".{fence}")));
    assert!(first["expires_at"].is_string());

    // Held: another acquire is refused with when to come back.
    let (status, body) = post(
        &state,
        SHOP,
        "/v1/locks/payouts/acquire",
        json!({"lease_ms": 1000}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body["code"], "lock_held");
    assert!(body["retry_after_ms"].as_u64().unwrap() > 0);
    // ...and a bounded wait ends the same way.
    let (status, body) = post(
        &state,
        SHOP,
        "/v1/locks/payouts/acquire",
        json!({"lease_ms": 1000, "wait_ms": 100}),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("lock_held"))
    );

    // Another caller's lock of the same name is another lock.
    let (status, _) = post(
        &state,
        BANK,
        "/v1/locks/payouts/acquire",
        json!({"lease_ms": 1000}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    // Renew by the holder; by a forged handle (other owner, other fence): not_owner.
    let (status, renewed) = post(
        &state,
        SHOP,
        "/v1/locks/payouts/renew",
        json!({"lock": lock, "lease_ms": 60000}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{renewed}");
    assert_eq!(renewed["fence"], fence);
    let forged = [
        format!("0123456789abcdef0123456789abcdef.{fence}"),
        format!("{}.{}", lock.rsplit_once('.').unwrap().0, fence + 1),
    ];
    for handle in &forged {
        for (path, body) in [
            ("renew", json!({"lock": handle, "lease_ms": 1000})),
            ("release", json!({"lock": handle})),
        ] {
            let (status, body) =
                post(&state, SHOP, &format!("/v1/locks/payouts/{path}"), body).await;
            assert_eq!(status, StatusCode::CONFLICT, "{path}: {body}");
            assert_eq!(body["code"], "not_owner");
        }
    }
    // The other caller cannot release the shop's lock with its handle either.
    let (status, body) = post(
        &state,
        BANK,
        "/v1/locks/payouts/release",
        json!({"lock": lock}),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not_owner"))
    );

    // Release, twice (a retry), then the lock is free with a higher fence.
    for _ in 0..2 {
        let (status, body) = post(
            &state,
            SHOP,
            "/v1/locks/payouts/release",
            json!({"lock": lock}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["released"], true);
    }
    let (status, body) = post(
        &state,
        SHOP,
        "/v1/locks/payouts/renew",
        json!({"lock": lock, "lease_ms": 1000}),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("not_owner"))
    );
    let (status, next) = post(
        &state,
        SHOP,
        "/v1/locks/payouts/acquire",
        json!({"lease_ms": 1000}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(next["fence"].as_u64().unwrap() > fence);
}

/// With its own owner id, an acquire whose answer was lost is repeated safely: the same
/// holding comes back.
#[tokio::test]
async fn a_retried_acquire_with_an_owner_gets_the_same_holding() {
    let state = state();
    let body = json!({"lease_ms": 60000, "owner": "worker-7-0123456789"});
    let (s1, a) = post(&state, SHOP, "/v1/locks/nightly/acquire", body.clone()).await;
    let (s2, b) = post(&state, SHOP, "/v1/locks/nightly/acquire", body).await;
    assert_eq!((s1, s2), (StatusCode::OK, StatusCode::OK));
    assert_eq!(a["lock"], b["lock"]);
    assert_eq!(a["fence"], b["fence"]);
    let (status, _) = post(
        &state,
        SHOP,
        "/v1/locks/nightly/acquire",
        json!({"lease_ms": 60000, "owner": "worker-8-0123456789"}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
}

/// A waiting acquire gets the lock as soon as the holder releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_gets_the_released_lock() {
    waiting_acquire_gets_the_released_lock(state()).await;
}

/// The same with locks in ZooKeeper, apart from the records, where the waiter waits in the
/// lock's queue: woken by its watch, not by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_gets_the_released_lock_in_zookeeper() {
    let Some(zk) = tokio::task::spawn_blocking(idem_testkit::coordination::ZooKeeper::start)
        .await
        .unwrap()
    else {
        return;
    };
    let options = idem_store::ZooKeeperOptions::default().root("/serve-test");
    let locks = idem_store::ZooKeeperLocks::connect(&zk.hosts(), options)
        .await
        .unwrap();
    let store = Arc::new(MemoryStore::new());
    let state = with_callers(AppState::new(store).with_locks(Arc::new(locks.clone())));
    waiting_acquire_gets_the_released_lock(state).await;
    assert!(locks.wakeups() >= 1, "the waiter did not wait in the queue");
}

/// The same with locks in etcd: the waiter waits in the lock's queue, woken by its watch.
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_acquire_gets_the_released_lock_in_etcd() {
    let Some(etcd) = tokio::task::spawn_blocking(idem_testkit::coordination::Etcd::start)
        .await
        .unwrap()
    else {
        return;
    };
    let options = idem_store::EtcdOptions::default().prefix("/serve-test");
    let locks = idem_store::EtcdLocks::connect(&etcd.endpoints(), options)
        .await
        .unwrap();
    let store = Arc::new(MemoryStore::new());
    let state = with_callers(AppState::new(store).with_locks(Arc::new(locks.clone())));
    waiting_acquire_gets_the_released_lock(state).await;
    assert!(locks.wakeups() >= 1, "the waiter did not wait in the queue");
}

async fn waiting_acquire_gets_the_released_lock(state: AppState) {
    let (_, held) = post(
        &state,
        SHOP,
        "/v1/locks/report/acquire",
        json!({"lease_ms": 60000}),
    )
    .await;
    let waiter = {
        let state = state.clone();
        tokio::spawn(async move {
            post(
                &state,
                SHOP,
                "/v1/locks/report/acquire",
                json!({"lease_ms": 60000, "wait_ms": 30000}),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _) = post(
        &state,
        SHOP,
        "/v1/locks/report/release",
        json!({"lock": held["lock"]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, got) = waiter.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{got}");
    assert!(got["fence"].as_u64() > held["fence"].as_u64());
}

#[tokio::test]
async fn bad_input_gets_its_code() {
    let state = state();
    let long = "n".repeat(129);
    let cases = [
        (
            "/v1/locks/x/acquire",
            json!({"lease_ms": 0}),
            "invalid_lease",
        ),
        (
            "/v1/locks/x/acquire",
            json!({"lease_ms": 86_400_001u64}),
            "invalid_lease",
        ),
        (
            "/v1/locks/x/acquire",
            json!({"lease_ms": 1000, "wait_ms": 60001}),
            "invalid_wait",
        ),
        (
            "/v1/locks/x/acquire",
            json!({"lease_ms": 1000, "owner": "short"}),
            "invalid_owner",
        ),
        (
            &format!("/v1/locks/{long}/acquire"),
            json!({"lease_ms": 1000}),
            "invalid_lock_name",
        ),
        (
            "/v1/locks/x/release",
            json!({"lock": "no-fence-here-0123456789"}),
            "invalid_lock",
        ),
        (
            "/v1/locks/x/release",
            json!({"lock": "0123456789abcdef0123.-1"}),
            "invalid_lock",
        ),
        (
            "/v1/locks/x/acquire",
            json!({"wait_ms": 5}),
            "invalid_request",
        ),
    ];
    for (path, body, code) in cases {
        let (status, answer) = post(&state, SHOP, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {answer}");
        assert_eq!(answer["code"], code, "{path}: {answer}");
    }
}

#[tokio::test]
async fn a_store_without_locks_says_so() {
    let mut state = AppState::new(Arc::new(MemoryStore::new()));
    state.auth = Arc::new(Auth::parse_keys(&format!("shop {SHOP}\n"), "keys").unwrap());
    let (status, body) = post(
        &state,
        SHOP,
        "/v1/locks/x/acquire",
        json!({"lease_ms": 1000}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(body["code"], "locks_unsupported");
}

/// An acquire of `name` as the shop, with `body`, whose client hangs up while the store
/// grants it: the grant lands once the client has gone. `before` plans more faults first.
async fn an_acquire_granted_after_the_client_left(
    name: &str,
    body: &Value,
    before: impl FnOnce(&FaultyStore<MemoryStore>),
) -> AppState {
    let store = FaultyStore::new(MemoryStore::new());
    let state =
        with_callers(AppState::new(Arc::new(store.clone())).with_locks(Arc::new(store.clone())));
    // The acquire is sent and waits at the store, then takes effect whatever the client does.
    let granted = Stall::new();
    store.fail_next(Op::LockAcquire, Fault::StallThenLand(granted.clone()));
    before(&store);
    let caller = {
        let (state, body) = (state.clone(), body.clone());
        let path = format!("/v1/locks/{name}/acquire");
        async move { post(&state, SHOP, &path, body).await }
    };
    granted.abandon(caller).await;
    granted.release();
    within("the grant", granted.landed()).await;
    state
}

/// An acquire without an owner id whose client hangs up while the store grants it leaves the
/// lock free: nobody else knows its owner id, so the grant is released for the caller that
/// left rather than held for its whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_its_lock_is_granted_leaves_the_lock_free() {
    let acquire = json!({"lease_ms": 600_000});
    // Tells when the lock is given back.
    let given_back = Stall::new();
    given_back.release();
    let state = an_acquire_granted_after_the_client_left("payouts", &acquire, |store| {
        store.fail_next(Op::LockRelease, Fault::Stall(given_back.clone()));
    })
    .await;
    within("the lock to be given back", given_back.landed()).await;
    let (status, body) = post(&state, SHOP, "/v1/locks/payouts/acquire", acquire).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// With its own owner id, the client keeps the holding when it hangs up: it gets it back by
/// asking again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_an_owner_id_that_hangs_up_gets_its_holding_back() {
    let acquire = json!({"lease_ms": 600_000, "owner": "worker-0123456789abcdef"});
    let state = an_acquire_granted_after_the_client_left("kept", &acquire, |_| {}).await;
    let (status, body) = post(
        &state,
        SHOP,
        "/v1/locks/kept/acquire",
        json!({"lease_ms": 1000}),
    )
    .await;
    assert_eq!(
        (status, &body["code"]),
        (StatusCode::CONFLICT, &json!("lock_held"))
    );
    let (status, body) = post(&state, SHOP, "/v1/locks/kept/acquire", acquire).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}
