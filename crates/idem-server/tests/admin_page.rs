//! The admin page end to end in headless Chromium: sign in with the token, filter, open a
//! record, reopen an unknown outcome and see the counts change (the browser's half is
//! `tests/browser/admin_page.mjs`, driven by `playwright-core`). The store is checked
//! afterwards from here, so the page cannot pass by showing what did not happen.
//!
//! Needs Chromium (`/usr/bin/chromium`, or `IDEM_CHROMIUM`), Node.js, and `npm ci` in
//! `tests/browser`; `.ci/run` installs them. Without them it prints why it skipped, and fails
//! under `CI=true`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_core::{
    BeginOutcome, BeginRequest, Fingerprint, Key, RecordFilter, SharedStore, Step, StepName, Store,
    Timestamp,
};
use idem_http::{IdempotencyLayer, Policy, Settle};
use idem_ops::admin::AdminToken;
use idem_server::AppState;
use tower::ServiceExt;

const TOKEN: &str = "page-test-token-0123456789";

/// What the browser test needs, or why it cannot run here.
fn browser() -> Result<(PathBuf, PathBuf), String> {
    let chromium = std::env::var_os("IDEM_CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    if !chromium.exists() {
        return Err(format!(
            "no Chromium at {} (apt-get install chromium, or set IDEM_CHROMIUM)",
            chromium.display()
        ));
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    if !dir.join("node_modules/playwright-core").exists() {
        return Err(format!(
            "playwright-core is not installed: run `npm ci` in {}",
            dir.display()
        ));
    }
    match Command::new("node").arg("--version").output() {
        Ok(o) if o.status.success() => Ok((chromium, dir)),
        _ => Err("no Node.js (`node`) on the PATH".to_owned()),
    }
}

/// An app behind the idempotency layer on `store`: `/orders` stores its answer, `/unknown`
/// ends with an unknown outcome.
async fn make_http_records(store: SharedStore) {
    async fn order(body: String) -> Response {
        (
            StatusCode::CREATED,
            [("content-type", "application/json")],
            body,
        )
            .into_response()
    }
    async fn unknown() -> Response {
        let mut res = (StatusCode::GATEWAY_TIMEOUT, "upstream timed out").into_response();
        res.extensions_mut().insert(Settle::Unknown);
        res
    }
    let app = axum::Router::new()
        .route("/orders", post(order))
        .route("/unknown", post(unknown))
        .layer(IdempotencyLayer::new(store, Policy::default()));
    for (path, key, body) in [
        ("/orders", "order-1", r#"{"id":"order-1"}"#),
        ("/orders", "order-2", r#"{"id":"order-2"}"#),
        ("/unknown", "u-1", ""),
    ] {
        let req = Request::post(path)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        app.clone().oneshot(req).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_signs_in_filters_and_reopens_an_unknown_outcome() {
    let (chromium, dir) = match browser() {
        Ok(found) => found,
        Err(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("the admin page's browser test cannot run under CI: {why}")
        }
        Err(why) => {
            eprintln!("skipped: the admin page's browser test needs {why}");
            return;
        }
    };
    let store: SharedStore = Arc::new(idem_store::MemoryStore::new());
    make_http_records(store.clone()).await;
    // An attempt whose lease ran out: stuck.
    let stuck = BeginRequest::new(
        Key::parse("anonymous", "jobs", "stuck-1").unwrap(),
        Fingerprint::of_bytes(b"job"),
    )
    .with_lease(Duration::from_millis(1));
    let then = Timestamp::now();
    let BeginOutcome::Acquired(lease) = store.begin(&stuck, then).await.unwrap() else {
        panic!("acquired");
    };
    // It got as far as one step of several.
    let debit = Step::done(StepName::new("debit").unwrap(), &b"abc"[..]).unwrap();
    store
        .record_step(&stuck.key, &lease, &debit, then)
        .await
        .unwrap();
    // Another namespace: two answers and an attempt still running.
    for (key, lease) in [
        ("batch-1", Duration::ZERO),
        ("batch-2", Duration::ZERO),
        ("batch-running", Duration::from_secs(600)),
    ] {
        let req = BeginRequest::new(
            Key::parse("tenant-b", "batch", key).unwrap(),
            Fingerprint::of_bytes(b"batch"),
        )
        .with_lease(Duration::from_secs(600));
        let BeginOutcome::Acquired(l) = store.begin(&req, then).await.unwrap() else {
            panic!("acquired");
        };
        if lease.is_zero() {
            store
                .complete(&req.key, &l, idem_core::Bytes::from_static(b"done"), then)
                .await
                .unwrap();
        }
    }
    // A running server's Snowflake worker lease, as idem keeps it.
    let worker = BeginRequest::new(
        Key::parse("idem.ids", "snowflake.default", "worker-7").unwrap(),
        Fingerprint::of_bytes(b"worker"),
    )
    .with_lease(Duration::from_secs(600));
    store.begin(&worker, then).await.unwrap();

    let mut state =
        AppState::new(store.clone()).with_locks(Arc::new(idem_store::MemoryStore::new()));
    state.admin_token = Some(AdminToken::new(TOKEN).unwrap());
    // Two earlier counts, so the chart is drawn (its legend's colours are set from script,
    // which the page's policy must allow).
    let counts = idem_http::operator::counts(
        store.admin().unwrap(),
        &RecordFilter::default(),
        Timestamp::now(),
    )
    .await
    .unwrap();
    let minute_ago = Timestamp::from_millis(Timestamp::now().as_millis() - 60_000);
    state.records_history.push(minute_ago, counts);
    state.records_history.push(Timestamp::now(), counts);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    // The API on one router, the page on the admin listener's, as `idem serve` runs them.
    let app = idem_server::router(state.clone());
    // A segment tag in use, for the page's table of them.
    let ids = Request::get("/v1/ids/segment/orders?count=5")
        .body(Body::empty())
        .unwrap();
    let res = app.clone().oneshot(ids).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // A lock held, for the page's table of them.
    let lock = Request::post("/v1/locks/nightly-report/acquire")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"lease_ms": 600000}"#))
        .unwrap();
    let res = app.clone().oneshot(lock).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let admin = idem_server::admin_router(state);
    let server = tokio::spawn(async move { axum::serve(listener, admin).await });

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("admin-page.png");
    let script = dir.join("admin_page.mjs");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(script)
            .arg(&base)
            .arg(TOKEN)
            .arg(&shot)
            .env("IDEM_CHROMIUM", chromium)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    server.abort();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser test failed:\n{stdout}\n{stderr}"
    );
    eprintln!(
        "{stdout}screenshot: {}",
        Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("admin-page.png")
            .display()
    );

    // What the page did, seen from the store: the unknown outcome is released.
    let counts = idem_http::operator::counts(
        store.admin().unwrap(),
        &RecordFilter::default(),
        Timestamp::now(),
    )
    .await
    .unwrap();
    assert_eq!(counts.unknown, 0);
    assert_eq!(counts.records.released, 1);
    let rec = store
        .get(
            &Key::parse("anonymous", "http", "u-1").unwrap(),
            Timestamp::now(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.status, idem_core::Status::Released);
    // The bulk delete took exactly the namespace it showed; idem's own record is untouched.
    let live = |scope: &'static str, ns: &'static str, key: &'static str| {
        let store = store.clone();
        async move {
            store
                .get(&Key::parse(scope, ns, key).unwrap(), Timestamp::now())
                .await
                .unwrap()
                .is_some()
        }
    };
    for key in ["batch-1", "batch-2", "batch-running"] {
        assert!(
            !live("tenant-b", "batch", key).await,
            "{key} was not deleted"
        );
    }
    assert!(live("anonymous", "jobs", "stuck-1").await);
    assert!(live("idem.ids", "snowflake.default", "worker-7").await);
}
