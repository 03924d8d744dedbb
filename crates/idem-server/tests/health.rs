//! Health by component: a lost Snowflake worker id shows as degraded (200) and is logged once
//! as it begins and once as it ends, however often health is asked; a failing store is 503;
//! a failed purge is degraded.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use idem_core::{Clock, SharedStore, SystemClock};
use idem_id::{Layout, ManagedSnowflake, SnowflakeOptions, WorkerPool};
use idem_server::{AppState, router};
use idem_store::MemoryStore;
use idem_testkit::FaultyStore;
use serde_json::Value;
use tower::ServiceExt;

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Value,
}

async fn get(state: &AppState, uri: &str) -> Answer {
    let req = Request::get(uri).body(Body::empty()).unwrap();
    let res = router(state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    Answer {
        status,
        headers,
        body: serde_json::from_slice(&body).unwrap(),
    }
}

/// Asks for health until `done` says so, at most 30 s; every answer goes to `seen`.
async fn health_until(
    state: &AppState,
    seen: &mut Vec<Answer>,
    what: &str,
    done: impl Fn(&Answer) -> bool,
) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let a = get(state, "/healthz").await;
            let finished = done(&a);
            seen.push(a);
            if finished {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let last = seen.last().map(|a| a.body.to_string());
    assert!(waited.is_ok(), "not {what} within 30 s; last: {last:?}");
}

fn snowflake_status(a: &Answer) -> &str {
    a.body["components"]["snowflake"]["status"]
        .as_str()
        .unwrap_or("")
}

/// Redis restarts empty under `idem serve`'s state (a server of the test's own): the worker
/// id is lost. Health says so (200, `degraded`, with a reason) while the Snowflake endpoint
/// answers 503 `no_worker_id` with a Retry-After; once a new worker id issues both are ok
/// again. The change is logged once each way, though health was asked many times between.
/// (A new worker id's first ids wait `idem_id::ISSUE_WINDOW`: long enough to look at.)
#[tokio::test]
async fn a_lost_worker_id_is_reported_degraded_logged_once_and_recovers() {
    use idem_store::{RedisOptions, RedisStore};
    use idem_testkit::services::RedisServer;

    let log = tempfile::NamedTempFile::new().unwrap();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(Mutex::new(log.reopen().unwrap()))
        .finish();
    // The process's subscriber, so that no test running beside this one can leave a call
    // site's interest cached as "nobody listens"; only this test logs about a Snowflake id.
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let options = RedisOptions {
        response_timeout: Duration::from_secs(1),
        ..RedisOptions::default()
    };
    let store: SharedStore = Arc::new(RedisStore::connect(&server.url(), options).await.unwrap());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let pool = WorkerPool::new(store.clone(), clock, "health")
        .lease(Duration::from_secs(5))
        .quarantine(Duration::from_secs(1));
    let snowflake = ManagedSnowflake::start(pool, Layout::default(), SnowflakeOptions::default())
        .await
        .unwrap();
    let mut state = AppState::new(store);
    state.snowflake = Some(snowflake.clone());
    // The first worker id's wait, seen in the log as it began and ended.
    health_until(&state, &mut Vec::new(), "ok at start", |a| {
        snowflake_status(a) == "ok"
    })
    .await;
    let logged_at_start = std::fs::read_to_string(log.path()).unwrap().len();

    let a = get(&state, "/healthz").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["status"], "ok", "{}", a.body);
    assert_eq!(a.body["store"], "redis");
    assert_eq!(snowflake_status(&a), "ok", "{}", a.body);
    let before = get(&state, "/v1/ids/snowflake").await;
    assert_eq!(before.status, StatusCode::OK, "{}", before.body);

    server.restart();
    let mut seen = Vec::new();
    health_until(&state, &mut seen, "degraded", |a| {
        snowflake_status(a) == "degraded"
            && a.body["components"]["snowflake"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("no worker id") || r.contains("just claimed"))
    })
    .await;
    let degraded = seen.last().unwrap();
    assert_eq!(degraded.status, StatusCode::OK, "{}", degraded.body);
    assert_eq!(degraded.body["status"], "degraded");
    assert!(degraded.body["components"]["snowflake"]["since"].is_string());
    let refused = get(&state, "/v1/ids/snowflake").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.body
    );
    assert_eq!(refused.body["code"], "no_worker_id", "{}", refused.body);
    assert!(refused.headers.contains_key("retry-after"));

    health_until(&state, &mut seen, "ok again", |a| {
        a.status == StatusCode::OK && a.body["status"] == "ok"
    })
    .await;
    let after = get(&state, "/v1/ids/snowflake").await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.body);
    assert!(after.body["ids"][0].as_u64() > before.body["ids"][0].as_u64());

    // Asked many times while degraded, logged once as it began and once as it ended.
    let polls = seen
        .iter()
        .filter(|a| snowflake_status(a) == "degraded")
        .count();
    assert!(
        polls >= 2,
        "health was asked only {polls} time(s) while degraded"
    );
    let text = std::fs::read_to_string(log.path()).unwrap();
    let text = &text[logged_at_start..];
    assert_eq!(text.matches("snowflake is degraded").count(), 1, "{text}");
    assert_eq!(text.matches("snowflake is ok again").count(), 1, "{text}");
    snowflake.release().await.unwrap();
}

/// A store that does not answer: 503, `down`, the store component down; then ok again.
#[tokio::test]
async fn a_failing_store_is_503_with_the_store_down() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let state = AppState::new(Arc::new(faulty.clone()));
    faulty.set_down(true);
    let a = get(&state, "/healthz").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.body);
    assert_eq!(a.headers["content-type"], "application/problem+json");
    assert_eq!(a.body["code"], "store_unavailable");
    assert_eq!(a.body["store"], "memory");
    assert_eq!(a.body["components"]["store"]["status"], "down");
    assert!(a.body["components"]["store"]["reason"].is_string());
    faulty.set_down(false);
    let a = get(&state, "/healthz").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["status"], "ok");
}

/// A purge pass that failed makes the purge component degraded (200), with why and when.
#[tokio::test]
async fn a_failed_purge_is_degraded() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let state = AppState::new(Arc::new(faulty.clone()));
    let status = state.health.purge_status();
    faulty.set_down(true);
    // The first pass runs at once; the next in an hour.
    let purger = tokio::spawn(idem::purge::purge_loop_reporting(
        Arc::new(faulty.clone()),
        Arc::new(SystemClock),
        Duration::from_secs(3600),
        status.clone(),
    ));
    let ran = tokio::time::timeout(Duration::from_secs(30), async {
        while status.get().last_run.is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(ran.is_ok(), "no purge pass within 30 s");
    faulty.set_down(false);
    let a = get(&state, "/healthz").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.body["status"], "degraded", "{}", a.body);
    let purge = &a.body["components"]["purge"];
    assert_eq!(purge["status"], "degraded", "{}", a.body);
    assert!(purge["reason"].as_str().unwrap().contains("purge"));
    assert!(purge["since"].is_string() && purge["last_run"].is_string());
    assert_eq!(a.body["components"]["store"]["status"], "ok");
    purger.abort();
}
