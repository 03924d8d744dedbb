//! The id endpoints: counts, shapes (64-bit ids as numbers and strings), bad queries, and a
//! server without a worker id.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use idem_core::{Clock, SharedStore, SystemClock};
use idem_id::{Layout, ManagedSnowflake, SnowflakeOptions, WorkerPool};
use idem_server::{AppState, router};
use idem_store::MemoryStore;
use serde_json::Value;
use tower::ServiceExt;

async fn get(state: &AppState, uri: &str) -> (StatusCode, Value) {
    let req = Request::get(uri).body(Body::empty()).unwrap();
    let res = router(state.clone()).oneshot(req).await.unwrap();
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&body).unwrap())
}

async fn state_with_worker() -> AppState {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let pool = WorkerPool::new(store.clone(), clock, "test");
    let g = ManagedSnowflake::start(pool, Layout::default(), SnowflakeOptions::default())
        .await
        .unwrap();
    // A worker id's first ids wait while an earlier holder may still stamp (at most
    // idem_id::ISSUE_WINDOW after its claim).
    let issuing = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while !g.status().is_issuing() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(issuing.is_ok(), "{:?}", g.status());
    let mut state = AppState::new(store);
    state.snowflake = Some(g);
    state
}

#[tokio::test]
async fn snowflake_ids_come_as_numbers_and_strings_and_never_repeat() {
    let state = state_with_worker().await;
    let mut seen = HashSet::new();
    for _ in 0..5 {
        let (status, body) = get(&state, "/v1/ids/snowflake?count=1000").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let ids = body["ids"].as_array().unwrap();
        let strings = body["id_strings"].as_array().unwrap();
        assert_eq!(ids.len(), 1000);
        for (n, s) in ids.iter().zip(strings) {
            let n = n.as_u64().unwrap();
            assert_eq!(s.as_str().unwrap(), n.to_string());
            assert!(seen.insert(n), "repeated {n}");
            assert_eq!(
                Layout::default().decode(n).worker,
                body["worker"].as_u64().unwrap()
            );
        }
    }
    let (_, body) = get(&state, "/v1/ids/snowflake").await;
    assert_eq!(body["ids"].as_array().unwrap().len(), 1);
}

/// Right after its claim a worker id issues nothing yet (an earlier holder may still be
/// issuing under it): 503 `no_worker_id`, not an id.
#[tokio::test]
async fn a_server_whose_worker_id_was_just_claimed_says_so() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let pool = WorkerPool::new(store.clone(), Arc::new(SystemClock), "test");
    let g = ManagedSnowflake::start(pool, Layout::default(), SnowflakeOptions::default())
        .await
        .unwrap();
    let mut state = AppState::new(store);
    state.snowflake = Some(g);
    let (status, body) = get(&state, "/v1/ids/snowflake").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["code"], "no_worker_id");
    assert!(
        body["detail"].as_str().unwrap().contains("just claimed"),
        "{body}"
    );
}

#[tokio::test]
async fn uuids_come_in_order() {
    let state = AppState::new(Arc::new(MemoryStore::new()));
    let (status, body) = get(&state, "/v1/ids/uuid7?count=50").await;
    assert_eq!(status, StatusCode::OK);
    let ids: Vec<uuid::Uuid> = body["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 50);
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    assert!(ids.iter().all(|u| u.get_version_num() == 7));
}

#[tokio::test]
async fn bad_counts_and_queries_are_refused_and_a_server_without_a_worker_id_says_so() {
    let state = AppState::new(Arc::new(MemoryStore::new()));
    for uri in [
        "/v1/ids/uuid7?count=0",
        "/v1/ids/uuid7?count=1001",
        "/v1/ids/uuid7?count=-1",
        "/v1/ids/uuid7?count=ten",
    ] {
        let (status, body) = get(&state, uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(body["code"], "invalid_count", "{uri}");
    }
    for uri in ["/v1/ids/uuid7?n=2", "/v1/ids/uuid7?count=1&count=2"] {
        let (status, body) = get(&state, uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(body["code"], "invalid_request", "{uri}");
    }
    let (status, body) = get(&state, "/v1/ids/snowflake").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["code"], "no_worker_id");
}

#[tokio::test]
async fn segment_ids_increase_per_tag_and_bad_tags_are_refused() {
    let state = AppState::new(Arc::new(MemoryStore::new()));
    let (status, body) = get(&state, "/v1/ids/segment/orders?count=1000").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let ids: Vec<u64> = body["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(ids.first(), Some(&1));
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    let (_, body) = get(&state, "/v1/ids/segment/orders?count=5").await;
    assert!(body["ids"][0].as_u64().unwrap() > *ids.last().unwrap());
    assert_eq!(body["id_strings"][0], body["ids"][0].to_string());
    // Another tag is another sequence.
    let (_, body) = get(&state, "/v1/ids/segment/invoices").await;
    assert_eq!(body["ids"][0], 1);
    let (status, body) = get(&state, "/v1/ids/segment/%20bad").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["code"], "invalid_tag");
}

#[tokio::test]
async fn a_caller_at_its_tag_quota_is_refused_and_other_callers_are_not() {
    let state = common::with_callers(AppState::new(Arc::new(MemoryStore::new())));
    let quota = idem_server::ids::TAGS_PER_SCOPE;
    for n in 0..quota {
        let (status, _, body) =
            common::get(&state, common::SHOP, &format!("/v1/ids/segment/t{n}")).await;
        assert_eq!(status, StatusCode::OK, "tag {n}: {body}");
    }
    let (status, content_type, body) =
        common::get(&state, common::SHOP, "/v1/ids/segment/one-more").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(content_type, "application/problem+json");
    assert_eq!(body["code"], "tag_quota_exceeded");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains(&quota.to_string()),
        "{body}"
    );
    assert_eq!(body["quota"], quota);
    // The caller's own tags still answer.
    let (status, _, _) = common::get(&state, common::SHOP, "/v1/ids/segment/t0").await;
    assert_eq!(status, StatusCode::OK);
    // Another caller still gets new tags.
    for tag in ["t0", "fresh"] {
        let (status, _, body) =
            common::get(&state, common::BANK, &format!("/v1/ids/segment/{tag}")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["ids"][0], 1);
    }
}
