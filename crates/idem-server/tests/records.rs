//! The record tools under /_idem/records on `idem serve`: behind the admin token (never an API
//! key), listing by page and filter, counts, and repairs that touch only what was shown.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::{BANK, SHOP, acquisition, get, post, with_callers};
use idem_core::{ManualClock, Timestamp};
use idem_ops::admin::AdminToken;
use idem_server::AppState;
use serde_json::{Value, json};

const TOKEN: &str = "operator-token-0123456789";

const START: Timestamp = Timestamp::from_millis(1_700_000_000_000);

fn state() -> (AppState, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(START));
    let mut state = with_callers(AppState::new(Arc::new(idem_store::MemoryStore::new())));
    state.clock = clock.clone();
    state.admin_token = Some(AdminToken::new(TOKEN).unwrap());
    (state, clock)
}

async fn begin(state: &AppState, caller: &str, key: &str, lease_ms: u64) -> Value {
    let (status, body) = post(
        state,
        caller,
        "/v1/records/begin",
        json!({"namespace": "pay", "key": key, "fingerprint": "f", "lease_ms": lease_ms}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

/// Three of the shop's records (`a` with a short lease, `b`, and `c` completed) and one of the
/// bank's.
async fn populate(state: &AppState) {
    begin(state, SHOP, "a", 1_000).await;
    begin(state, SHOP, "b", 60_000).await;
    let lease = begin(state, SHOP, "c", 60_000).await["lease"]["id"].clone();
    let (status, _) = post(
        state,
        SHOP,
        "/v1/records/complete",
        json!({"namespace": "pay", "key": "c", "lease": lease, "response": {"ok": true}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    begin(state, BANK, "x", 60_000).await;
}

fn keys(page: &Value) -> Vec<String> {
    page["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{}/{}",
                r["scope"].as_str().unwrap(),
                r["key"].as_str().unwrap()
            )
        })
        .collect()
}

#[tokio::test]
async fn only_the_admin_token_opens_the_tools() {
    let (mut state, _) = state();
    populate(&state).await;
    for key in ["wrong-token-0123456789", SHOP] {
        let (status, _, body) = get(&state, key, "/_idem/records").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert_eq!(body["code"], "unauthorized");
    }
    state.admin_token = None;
    let (status, _, body) = get(&state, TOKEN, "/_idem/records").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["code"], "admin_disabled");
    // The server's own health stays open.
    let (status, _, body) = get(&state, "", "/_idem/health").await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// The API's listener serves health and metrics under /_idem, never the page or the tools that
/// take the admin token: those are on the admin listener, an origin of their own.
#[tokio::test]
async fn the_page_and_the_tools_are_on_the_admin_listener_only() {
    let (state, _) = state();
    let state = state.with_locks(Arc::new(idem_store::MemoryStore::new()));
    let status = |app: axum::Router, path: &'static str| async move {
        let req = axum::http::Request::get(path)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(axum::body::Body::empty())
            .unwrap();
        let res = tower::ServiceExt::oneshot(app, req).await.unwrap();
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    };
    let api = idem_server::router(state.clone());
    let admin = idem_server::admin_router(state);
    for path in [
        "/_idem",
        "/_idem/",
        "/_idem/assets/app.js",
        "/_idem/records",
        "/_idem/records/counts",
        "/_idem/segments",
        "/_idem/locks",
    ] {
        let (code, body) = status(api.clone(), path).await;
        assert_eq!(code, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(body.contains("--admin-listen"), "{path}: {body}");
        let (code, body) = status(admin.clone(), path).await;
        assert!(
            code.is_success() || code.is_redirection(),
            "{path}: {code} {body}"
        );
    }
    for path in ["/_idem/health", "/_idem/metrics"] {
        for app in [&api, &admin] {
            let (code, body) = status(app.clone(), path).await;
            assert_eq!(code, StatusCode::OK, "{path}: {body}");
        }
    }
    let (code, _) = status(admin, "/v1/ids/uuid7").await;
    assert_eq!(
        code,
        StatusCode::NOT_FOUND,
        "the admin listener serves no API"
    );
}

#[tokio::test]
async fn records_are_listed_by_page_and_filter_and_counted() {
    let (state, clock) = state();
    populate(&state).await;
    clock.advance(Duration::from_secs(2));

    let mut seen = Vec::new();
    let mut path = "/_idem/records?namespace=pay&limit=1".to_owned();
    loop {
        let (status, _, page) = get(&state, TOKEN, &path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert!(page["records"].as_array().unwrap().len() <= 1);
        seen.extend(keys(&page));
        match page["next"].as_str() {
            Some(next) => path = format!("/_idem/records?namespace=pay&limit=1&after={next}"),
            None => break,
        }
    }
    seen.sort();
    assert_eq!(seen, ["bank/x", "shop/a", "shop/b", "shop/c"]);

    let (_, _, page) = get(&state, TOKEN, "/_idem/records?scope=shop&state=stuck").await;
    assert_eq!(keys(&page), ["shop/a"]);
    assert_eq!(acquisition(&page["records"][0]["fence"]), 1);
    let (_, _, page) = get(&state, TOKEN, "/_idem/records?state=completed").await;
    assert_eq!(keys(&page), ["shop/c"]);
    let (_, _, page) = get(&state, TOKEN, "/_idem/records?namespace=pay&older_than=1h").await;
    assert_eq!(keys(&page), Vec::<String>::new());

    let (status, _, counts) = get(&state, TOKEN, "/_idem/records/counts?namespace=pay").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (
            counts["in_progress"].clone(),
            counts["stuck"].clone(),
            counts["completed"].clone()
        ),
        (json!(2), json!(1), json!(1))
    );
    assert_eq!(counts["oldest_in_progress_seconds"], 2.0);

    let (status, _, shown) = get(
        &state,
        TOKEN,
        "/_idem/records/show?scope=shop&namespace=pay&key=c",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(shown["state"], "completed");
    assert_eq!(shown["steps"], json!([]));
    let (status, _, missing) = get(
        &state,
        TOKEN,
        "/_idem/records/show?scope=shop&namespace=pay&key=zz",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(missing["code"], "record_not_found");
}

#[tokio::test]
async fn bad_queries_are_refused_with_invalid_request() {
    let (state, _) = state();
    for path in [
        "/_idem/records?state=done",
        "/_idem/records?limit=0",
        "/_idem/records?limit=1001",
        "/_idem/records?limit=many",
        "/_idem/records?after=not-a-cursor",
        "/_idem/records?older_than=soon",
        "/_idem/records?scope=has%20space",
        "/_idem/records?colour=blue",
        "/_idem/records/show?scope=shop&namespace=pay",
    ] {
        let (status, content_type, body) = get(&state, TOKEN, path).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        assert_eq!(content_type, "application/problem+json", "{path}");
        assert_eq!(body["code"], "invalid_request", "{path}");
    }
}

async fn repair(state: &AppState, body: Value) -> (StatusCode, Value) {
    let req = axum::http::Request::post("/_idem/records/repair")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    let res = tower::ServiceExt::oneshot(common::app_for(state, "/_idem/records/repair"), req)
        .await
        .unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// A record as shown, by the `acquisition`-th fence of a record created at the clock's start
/// (as `populate`'s are).
fn shown(scope: &str, key: &str, state: &str, acquisition: u64) -> Value {
    let fence = idem_core::Lease::first_fence(START) + acquisition - 1;
    json!({"scope": scope, "namespace": "pay", "key": key, "state": state, "fence": fence})
}

#[tokio::test]
async fn a_repair_touches_only_records_still_as_shown() {
    let (state, clock) = state();
    populate(&state).await;
    clock.advance(Duration::from_secs(2));

    // `b` is running, not stuck; `a` with another fence was never shown; `x` is as shown.
    let (status, done) = repair(
        &state,
        json!({"action": "release", "records": [
            shown("shop", "a", "stuck", 1),
            shown("shop", "b", "stuck", 1),
            shown("shop", "a", "stuck", 7),
        ]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(done, json!({"applied": 1, "skipped": 2}));
    let (_, _, page) = get(&state, TOKEN, "/_idem/records?state=released").await;
    assert_eq!(keys(&page), ["shop/a"]);
    // The shop's retry of `a` now runs, with a higher fence.
    assert_eq!(
        acquisition(&begin(&state, SHOP, "a", 60_000).await["lease"]["fence"]),
        2
    );

    // Released once: the same repair again changes nothing.
    let (_, done) = repair(
        &state,
        json!({"action": "release", "records": [shown("shop", "a", "stuck", 1)]}),
    )
    .await;
    assert_eq!(done, json!({"applied": 0, "skipped": 1}));

    // `reopen` takes unknown outcomes only: `c` holds an answer.
    let (_, done) = repair(
        &state,
        json!({"action": "reopen", "records": [shown("shop", "c", "completed", 1)]}),
    )
    .await;
    assert_eq!(done, json!({"applied": 0, "skipped": 1}));

    let (_, done) = repair(
        &state,
        json!({"action": "delete", "records": [shown("shop", "c", "completed", 1)]}),
    )
    .await;
    assert_eq!(done, json!({"applied": 1, "skipped": 0}));
    let (status, _, _) = get(
        &state,
        TOKEN,
        "/_idem/records/show?scope=shop&namespace=pay&key=c",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    for bad in [
        json!({"action": "undo", "records": [shown("shop", "b", "in_progress", 1)]}),
        json!({"action": "delete", "records": []}),
        json!({"action": "delete", "records": [shown("shop", "b", "busy", 1)]}),
        json!({"action": "delete", "records": [shown("shop", "b b", "in_progress", 1)]}),
        json!({"action": "delete"}),
    ] {
        let (status, body) = repair(&state, bad.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let too_many: Vec<Value> = (0..=idem_ops::admin::records::MAX_BULK)
        .map(|i| shown("shop", &format!("k{i}"), "stuck", 1))
        .collect();
    let (status, _) = repair(&state, json!({"action": "delete", "records": too_many})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// A repair that names an attempt still in progress is refused whole without `force`, and one
/// that names idem's own records is refused even with it; neither touches anything.
#[tokio::test]
async fn running_attempts_need_force_and_idems_own_records_are_never_repaired() {
    let (state, _) = state();
    populate(&state).await;
    let running = [
        shown("shop", "b", "in_progress", 1),
        shown("shop", "c", "completed", 1),
    ];
    let (status, body) = repair(&state, json!({"action": "delete", "records": running})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["code"], "force_required");
    assert_eq!(body["in_progress"], 1);
    let (_, _, page) = get(&state, TOKEN, "/_idem/records?scope=shop").await;
    assert_eq!(
        keys(&page),
        ["shop/a", "shop/b", "shop/c"],
        "nothing was deleted"
    );

    // The Snowflake worker lease of a running server, as idem keeps it.
    let worker = idem_core::BeginRequest::new(
        idem_core::Key::parse("idem.ids", "snowflake.default", "7").unwrap(),
        idem_core::Fingerprint::of_bytes(b"worker"),
    );
    state.store.begin(&worker, state.clock.now()).await.unwrap();
    let (_, _, page) = get(&state, TOKEN, "/_idem/records?scope=idem.ids").await;
    assert_eq!(page["records"][0]["internal"], true, "{page}");
    let internal = json!({"scope": "idem.ids", "namespace": "snowflake.default", "key": "7",
        "state": "in_progress", "fence": 1});
    let (status, body) = repair(
        &state,
        json!({"action": "delete", "records": [internal], "force": true}),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert_eq!(body["code"], "internal_record");
    let (_, _, page) = get(&state, TOKEN, "/_idem/records?scope=idem.ids").await;
    assert_eq!(page["records"].as_array().unwrap().len(), 1, "{page}");

    let (status, done) = repair(
        &state,
        json!({"action": "delete", "records": running, "force": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(done, json!({"applied": 2, "skipped": 0}));
}

#[tokio::test]
async fn the_segment_tags_in_use_are_shown_with_their_runway() {
    let (state, _) = state();
    let (status, _, body) = get(&state, SHOP, "/v1/ids/segment/orders?count=3").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _, body) = get(&state, SHOP, "/_idem/segments").await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "an API key does not open it: {body}"
    );
    let (status, _, body) = get(&state, TOKEN, "/_idem/segments").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let tags = body["segments"].as_array().unwrap();
    assert_eq!(tags.len(), 1, "{body}");
    assert_eq!(tags[0]["scope"], "shop");
    assert_eq!(tags[0]["tag"], "orders");
    assert!(tags[0]["remaining"].as_u64().unwrap() > 0, "{body}");
    assert_eq!(tags[0]["failing"], Value::Null);
}

async fn metrics_text(state: &AppState) -> String {
    let req = axum::http::Request::get("/_idem/metrics")
        .body(axum::body::Body::empty())
        .unwrap();
    let res = tower::ServiceExt::oneshot(idem_server::router(state.clone()), req)
        .await
        .unwrap();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn the_metrics_page_counts_claims_ids_and_lock_acquisitions() {
    idem_ops::metrics::Registry::global();
    let (state, _) = state();
    let state = state.with_locks(Arc::new(idem_store::MemoryStore::new()));
    let (status, _, _) = get(&state, SHOP, "/v1/ids/uuid7?count=3").await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = post(
        &state,
        SHOP,
        "/v1/locks/l/acquire",
        json!({"lease_ms": 1000}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    begin(&state, SHOP, "m", 1_000).await;
    let text = metrics_text(&state).await;
    let value = |line: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in\n{text}"))
    };
    assert!(value(r#"idem_ids_issued_total{kind="uuid7"}"#) >= 3.0);
    assert!(value(r#"idem_lock_acquire_seconds_count{result="acquired"}"#) >= 1.0);
    assert!(value(r#"idem_api_begins_total{outcome="acquired"}"#) >= 1.0);
}

#[tokio::test]
async fn metrics_may_need_the_admin_token() {
    let (mut state, _) = state();
    state.metrics_require_token = true;
    let send = |auth: &'static str| {
        let state = state.clone();
        async move {
            let req = axum::http::Request::get("/_idem/metrics")
                .header("authorization", auth)
                .body(axum::body::Body::empty())
                .unwrap();
            tower::ServiceExt::oneshot(idem_server::router(state), req)
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(send("").await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        send("Bearer shop-key-0123456789abcdef").await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send("Bearer operator-token-0123456789").await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn the_locks_held_are_listed_without_their_owners() {
    let (state, _) = state();
    let (status, _, body) = get(&state, TOKEN, "/_idem/locks").await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "no lock store: {body}");
    assert_eq!(body["code"], "locks_unsupported");
    listed_without_owners(state.with_locks(Arc::new(idem_store::MemoryStore::new()))).await;
}

/// The same with locks in ZooKeeper (`--locks zk://…`), whose listing reads the lock nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_held_in_zookeeper_are_listed_without_their_owners() {
    let Some(zk) = tokio::task::spawn_blocking(idem_testkit::coordination::ZooKeeper::start)
        .await
        .unwrap()
    else {
        return;
    };
    let locks = idem_store::open_locks(&zk.url("/listing")).await.unwrap();
    let (state, _) = state();
    listed_without_owners(state.with_locks(locks)).await;
}

/// The same with locks in etcd (`--locks etcd://…`), whose listing reads the lock keys.
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_held_in_etcd_are_listed_without_their_owners() {
    let Some(etcd) = tokio::task::spawn_blocking(idem_testkit::coordination::Etcd::start)
        .await
        .unwrap()
    else {
        return;
    };
    let locks = idem_store::open_locks(&etcd.url("/listing")).await.unwrap();
    let (state, _) = state();
    listed_without_owners(state.with_locks(locks)).await;
}

/// A lock taken through the API is listed to the operator, with its fence and lease end and
/// nothing else; a caller's key cannot list.
async fn listed_without_owners(state: AppState) {
    let (status, held) = post(
        &state,
        SHOP,
        "/v1/locks/nightly/acquire",
        json!({"lease_ms": 60_000}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{held}");
    let (status, _, body) = get(&state, SHOP, "/_idem/locks").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let (status, _, body) = get(&state, TOKEN, "/_idem/locks").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let locks = body["locks"].as_array().unwrap();
    assert_eq!(locks.len(), 1, "{body}");
    assert!(
        locks[0]["name"].as_str().unwrap().contains("nightly"),
        "{body}"
    );
    assert_eq!(locks[0]["fence"], held["fence"]);
    assert_eq!(locks[0]["expires_at"], held["expires_at"]);
    assert_eq!(locks[0].as_object().unwrap().len(), 3, "no owner: {body}");
}
