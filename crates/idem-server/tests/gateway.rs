//! `idem gateway` over real sockets: a counting upstream, the gateway in front of it, and a
//! real HTTP client, for every rule and every way the upstream can fail.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, Request, StatusCode};
use idem_server::gateway::{FileConfig, Gateway, Upstream as UpstreamUrl};
use serde_json::Value;
use tokio::net::TcpListener;

mod gateway_support;
use gateway_support::*;

#[tokio::test]
async fn a_retry_is_answered_by_the_gateway_without_reaching_the_upstream() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let first = post(gw, "/orders", "k1", "pay 10").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let again = post(gw, "/orders", "k1", "pay 10").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.json(), first.json());
    assert_eq!(again.headers["x-upstream"], "yes");
    assert!(again.headers.get("set-cookie").is_none());
    assert_eq!(seen.runs(), 1);
    // without a key, or with GET, every request reaches the upstream
    send(gw, Method::POST, "/orders", &[], "x").await;
    send(gw, Method::GET, "/orders", &[("idempotency-key", "k1")], "").await;
    assert_eq!(seen.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_reaches_the_upstream_once() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let requests = (0..200).map(|_| {
        tokio::spawn(async move {
            send(
                gw,
                Method::POST,
                "/orders",
                &[("idempotency-key", "storm"), ("x-delay-ms", "50")],
                "once",
            )
            .await
        })
    });
    let mut executed = 0;
    let mut replayed = 0;
    let mut in_progress = 0;
    for r in requests {
        let r = r.await.unwrap();
        match r.status {
            StatusCode::CREATED if r.replayed() => replayed += 1,
            StatusCode::CREATED => executed += 1,
            StatusCode::CONFLICT => {
                assert_eq!(r.code(), "request_in_progress");
                assert!(r.headers.contains_key("retry-after"));
                in_progress += 1;
            }
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(executed + replayed + in_progress, 200);
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn a_lost_response_is_replayed_to_the_retry() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "[defaults]\nwait = \"10s\"").await;
    // The client gives up (its connection closes) while the upstream is still working.
    let impatient = tokio::time::timeout(
        Duration::from_millis(100),
        send(
            gw,
            Method::POST,
            "/orders",
            &[("idempotency-key", "lost"), ("x-delay-ms", "400")],
            "pay",
        ),
    )
    .await;
    assert!(impatient.is_err(), "the first answer arrived after all");
    // The retry waits for the first attempt and gets its answer.
    let retry = send(
        gw,
        Method::POST,
        "/orders",
        &[("idempotency-key", "lost"), ("x-delay-ms", "400")],
        "pay",
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn the_same_key_with_another_request_is_refused() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    post(gw, "/orders", "k", "pay 10").await;
    let r = post(gw, "/orders", "k", "pay 1000").await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.code(), "idempotency_key_mismatch");
    assert_eq!(r.headers["content-type"], "application/problem+json");
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn callers_are_kept_apart() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let as_caller = |who: &'static str| async move {
        send(
            gw,
            Method::POST,
            "/orders",
            &[("idempotency-key", "same"), ("authorization", who)],
            "same body",
        )
        .await
    };
    let a = as_caller("Bearer alice").await;
    let b = as_caller("Bearer bob").await;
    assert!(!b.replayed(), "bob got alice's stored answer");
    assert_ne!(a.json()["run"], b.json()["run"]);
    assert!(as_caller("Bearer alice").await.replayed());
    assert_eq!(seen.runs(), 2);
}

#[tokio::test]
async fn an_unreachable_upstream_releases_the_key() {
    // A port with nothing behind it.
    let spare = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = spare.local_addr().unwrap();
    drop(spare);
    let gw = start_gateway(up, memory(), "").await;
    let r = post(gw, "/orders", "k", "pay").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.code(), "upstream_unreachable");
    // The upstream comes up: the retry runs, since nothing was sent before.
    let seen = start_upstream_on(TcpListener::bind(up).await.unwrap()).await;
    let r = post(gw, "/orders", "k", "pay").await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(!r.replayed());
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn an_upstream_timeout_is_an_unknown_outcome_and_never_rerun_silently() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "upstream_timeout = \"200ms\"").await;
    let slow = [("idempotency-key", "t"), ("x-delay-ms", "1000")];
    let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.code(), "upstream_timeout");
    for _ in 0..2 {
        let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
        assert_eq!(r.status, StatusCode::CONFLICT);
        assert_eq!(r.code(), "outcome_unknown");
    }
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn an_unknown_outcome_may_run_again_after_the_lease() {
    let (seen, up) = start_upstream().await;
    let config = "upstream_timeout = \"100ms\"\n[defaults]\nlease = \"300ms\"\non_unknown = \"release_after_lease\"";
    let gw = start_gateway(up, memory(), config).await;
    let slow = [("idempotency-key", "t"), ("x-delay-ms", "150")];
    assert_eq!(
        send(gw, Method::POST, "/orders", &slow, "pay").await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
    assert_eq!(r.code(), "outcome_unknown");
    assert!(r.headers.contains_key("retry-after"));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fast = [("idempotency-key", "t"), ("x-delay-ms", "0")];
    // The delay header is not part of the fingerprint by default, so this is the same request.
    let r = send(gw, Method::POST, "/orders", &fast, "pay").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(seen.runs(), 2);
    assert!(
        send(gw, Method::POST, "/orders", &fast, "pay")
            .await
            .replayed()
    );
}

#[tokio::test]
async fn an_operator_reopens_an_unknown_outcome_for_the_next_retry() {
    const TOKEN: &str = "operator-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let (seen, up) = start_upstream().await;
    let config = format!(
        "upstream_timeout = \"200ms\"\nadmin_token_file = {:?}\n\
         [[route]]\npath = \"/v1/payments\"\nnamespace = \"payments\"",
        token_file.display()
    );
    let gw = start_gateway(up, memory(), &config).await;
    let alice = "Bearer alice-secret";
    let slow = [
        ("idempotency-key", "t"),
        ("authorization", alice),
        ("x-delay-ms", "1000"),
    ];
    let r = send(gw, Method::POST, "/v1/payments", &slow, "pay").await;
    assert_eq!(r.code(), "upstream_timeout");

    let admin = |path: &'static str, auth: &'static str, body: Value| async move {
        let body = body.to_string();
        let headers = [
            ("authorization", auth),
            ("content-type", "application/json"),
        ];
        send(gw, Method::POST, path, &headers, &body).await
    };
    let record = serde_json::json!({"path": "/v1/payments", "key": "t", "credential": alice});
    let bearer = "Bearer operator-token-0123456789";
    // The operator's token, and only it, opens the tools; the caller's own credential does not.
    for auth in ["Bearer alice-secret", "Bearer nope", ""] {
        let r = admin("/_idem/records/reopen", auth, record.clone()).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{auth:?}");
    }
    let r = admin("/_idem/records/inspect", bearer, record.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.json()["state"], "unknown");
    assert_eq!(r.json()["fence"], 1);
    // The scope as logged names the same record; another route's namespace does not.
    let parts = Request::builder()
        .header("authorization", alice)
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let scope = idem_http::ScopeSource::default().scope_of(&parts);
    let by_scope = serde_json::json!({"path": "/v1/payments", "key": "t", "scope": scope.as_str()});
    let r = admin("/_idem/records/inspect", bearer, by_scope).await;
    assert_eq!(r.json()["state"], "unknown", "{}", r.body);
    let elsewhere = serde_json::json!({"path": "/orders", "key": "t", "credential": alice});
    let r = admin("/_idem/records/reopen", bearer, elsewhere).await;
    assert_eq!(r.code(), "record_not_found");

    // Retries are held until the operator reopens the record; then the next one runs.
    let fast = [("idempotency-key", "t"), ("authorization", alice)];
    let r = send(gw, Method::POST, "/v1/payments", &fast, "pay").await;
    assert_eq!(r.code(), "outcome_unknown");
    let r = admin("/_idem/records/reopen", bearer, record.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.json(), serde_json::json!({"reopened": true, "fence": 1}));
    let r = admin("/_idem/records/reopen", bearer, record.clone()).await;
    assert_eq!(r.code(), "not_unknown");
    assert_eq!(r.json()["record"]["state"], "released");
    let r = send(gw, Method::POST, "/v1/payments", &fast, "pay").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(seen.runs(), 2);
    // A stored answer is never reopened.
    let r = admin("/_idem/records/reopen", bearer, record.clone()).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.json()["record"]["state"], "stored");
    assert_eq!(r.json()["record"]["status"], 201);
    assert!(
        send(gw, Method::POST, "/v1/payments", &fast, "pay")
            .await
            .replayed()
    );

    // Bad requests are refused with a reason.
    for (body, code) in [
        (
            serde_json::json!({"path": "/v1/payments", "key": "t"}),
            "invalid_request",
        ),
        (
            serde_json::json!({"path": "/v1/payments", "key": "t", "scope": "a", "credential": "b"}),
            "invalid_request",
        ),
        (
            serde_json::json!({"path": "v1", "key": "t", "scope": "a"}),
            "invalid_request",
        ),
        (
            serde_json::json!({"path": "/v1/payments", "key": "", "scope": "a"}),
            "invalid_key",
        ),
        (
            serde_json::json!({"path": "/", "key": "t", "scope": "a", "x": 1}),
            "invalid_request",
        ),
    ] {
        let r = admin("/_idem/records/inspect", bearer, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.code(), code, "{body}");
    }
}

/// Two gateways on one store, each with its own replay cache: a stored answer is replayed
/// from memory, but an unknown outcome never is, so that once an operator reopens it on one
/// gateway, a retry through the other runs at once.
#[tokio::test]
async fn replays_come_from_memory_but_unknown_outcomes_never_do() {
    use idem_store::{ReplayCache, ReplayCacheLimits};
    const TOKEN: &str = "operator-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let (seen, up) = start_upstream().await;
    let config = format!(
        "upstream_timeout = \"200ms\"\nadmin_token_file = {:?}",
        token_file.display()
    );
    let shared = memory();
    let cached = || {
        ReplayCache::new(shared.clone(), ReplayCacheLimits::default())
            .skip(idem_http::operator::is_unknown_outcome)
    };
    let (cache_a, cache_b) = (cached(), cached());
    let a = start_gateway(up, Arc::new(cache_a.clone()), &config).await;
    let b = start_gateway(up, Arc::new(cache_b.clone()), &config).await;

    // A stored answer: run through A, replayed by B, the second time from B's memory.
    assert_eq!(
        post(a, "/v1/orders", "k1", "x").await.status,
        StatusCode::CREATED
    );
    for _ in 0..2 {
        assert!(post(b, "/v1/orders", "k1", "x").await.replayed());
    }
    assert_eq!((seen.runs(), cache_b.hits()), (1, 1));

    // An unknown outcome: held on B, from the store every time.
    let slow = [("idempotency-key", "k2"), ("x-delay-ms", "1000")];
    let r = send(a, Method::POST, "/v1/orders", &slow, "y").await;
    assert_eq!(r.code(), "upstream_timeout");
    for _ in 0..2 {
        assert_eq!(
            post(b, "/v1/orders", "k2", "y").await.code(),
            "outcome_unknown"
        );
    }
    assert_eq!(cache_b.hits(), 1);
    // The operator reopens it on A; B lets the next retry run.
    let record = serde_json::json!({"path": "/v1/orders", "key": "k2", "credential": CALLER});
    let headers = [
        ("authorization", "Bearer operator-token-0123456789"),
        ("content-type", "application/json"),
    ];
    let body = record.to_string();
    let r = send(a, Method::POST, "/_idem/records/reopen", &headers, &body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = post(b, "/v1/orders", "k2", "y").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(!r.replayed());
    assert_eq!(seen.runs(), 3);
}

#[tokio::test]
async fn an_operator_lists_unknown_outcomes_and_reopens_what_was_shown() {
    const TOKEN: &str = "operator-token-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let (seen, up) = start_upstream().await;
    let config = format!(
        "upstream_timeout = \"200ms\"\nadmin_token_file = {:?}\n\
         [[route]]\npath = \"/v1/payments\"\nnamespace = \"payments\"",
        token_file.display()
    );
    let gw = start_gateway(up, memory(), &config).await;
    for key in ["t1", "t2"] {
        let slow = [("idempotency-key", key), ("x-delay-ms", "1000")];
        let r = send(gw, Method::POST, "/v1/payments", &slow, "pay").await;
        assert_eq!(r.code(), "upstream_timeout");
    }
    let fine = [("idempotency-key", "ok")];
    send(gw, Method::POST, "/v1/payments", &fine, "pay").await;
    let bearer = [("authorization", "Bearer operator-token-0123456789")];

    let r = send(gw, Method::GET, "/_idem/records/counts", &bearer, "").await;
    assert_eq!(r.json()["unknown"], 2, "{}", r.body);
    assert_eq!(r.json()["completed"], 3);
    let r = send(gw, Method::GET, "/_idem/records?state=unknown", &bearer, "").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let shown: Vec<Value> = r.json()["records"].as_array().unwrap().clone();
    assert_eq!(shown.len(), 2);
    assert!(
        shown
            .iter()
            .all(|r| r["kind"] == "unknown" && r["namespace"] == "payments")
    );

    // One of them is retried by its client and reopened meanwhile by hand: the bulk reopen of
    // what was shown leaves it alone.
    let scope = shown[0]["scope"].as_str().unwrap();
    let inspect = serde_json::json!({"path": "/v1/payments", "key": "t1", "scope": scope});
    let headers = [
        ("authorization", "Bearer operator-token-0123456789"),
        ("content-type", "application/json"),
    ];
    let r = send(
        gw,
        Method::POST,
        "/_idem/records/reopen",
        &headers,
        &inspect.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    send(
        gw,
        Method::POST,
        "/v1/payments",
        &[("idempotency-key", "t1")],
        "pay",
    )
    .await;
    let records: Vec<Value> = shown
        .iter()
        .map(|r| {
            serde_json::json!({
                "scope": r["scope"], "namespace": r["namespace"], "key": r["key"],
                "state": r["state"], "fence": r["fence"],
            })
        })
        .collect();
    let body = serde_json::json!({"action": "reopen", "records": records}).to_string();
    let r = send(gw, Method::POST, "/_idem/records/repair", &headers, &body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.json(), serde_json::json!({"applied": 1, "skipped": 1}));
    let r = send(gw, Method::GET, "/_idem/records/counts", &bearer, "").await;
    assert_eq!(r.json()["unknown"], 0);
    // t1 ran again once (by its retry), t2 is free to; nothing else was forwarded.
    assert_eq!(seen.runs(), 4);
    let r = send(gw, Method::GET, "/_idem", &bearer, "").await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn a_request_id_is_passed_to_the_upstream_and_returned() {
    let (seen, up) = start_upstream().await;
    let last_headers = || seen.headers.lock().unwrap().last().cloned().unwrap();
    let gw = start_gateway(up, memory(), "").await;
    let r = send(
        gw,
        Method::POST,
        "/orders",
        &[("idempotency-key", "k"), ("x-request-id", "req-7")],
        "",
    )
    .await;
    assert_eq!(r.headers["x-request-id"], "req-7");
    assert_eq!(last_headers()["x-request-id"], "req-7");
    // Made up when absent or unfit, and still returned.
    let r = send(
        gw,
        Method::POST,
        "/orders",
        &[("x-request-id", "two words")],
        "",
    )
    .await;
    let made = r.headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(made.len(), 32);
    assert_eq!(last_headers()["x-request-id"], made.as_str());
}

#[tokio::test]
async fn the_record_tools_are_disabled_without_an_admin_token() {
    let (_, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let body = serde_json::json!({"path": "/orders", "key": "t", "scope": "anonymous"});
    let headers = [
        ("authorization", "Bearer anything-at-all-here"),
        ("content-type", "application/json"),
    ];
    let r = send(
        gw,
        Method::POST,
        "/_idem/records/reopen",
        &headers,
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.code(), "admin_disabled");
}

#[tokio::test]
async fn a_connection_broken_after_sending_is_an_unknown_outcome() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let r = post(gw, "/broken", "b", "").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.code(), "upstream_failed");
    let r = post(gw, "/broken", "b", "").await;
    assert_eq!(r.code(), "outcome_unknown");
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn routes_choose_their_policy() {
    let (seen, up) = start_upstream().await;
    let config = r#"
        [[route]]
        path = "/v1/payments"
        key = "required"
        preset = "stripe"
    "#;
    let gw = start_gateway(up, memory(), config).await;
    let r = send(gw, Method::POST, "/v1/payments", &[], "pay").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "idempotency_key_missing");
    assert_eq!(seen.runs(), 0);
    post(gw, "/v1/payments", "p", "pay").await;
    let r = post(gw, "/v1/payments", "p", "pay more").await;
    assert_eq!(
        r.status,
        StatusCode::BAD_REQUEST,
        "the stripe preset answers 400"
    );
    // other paths keep the defaults: optional key
    assert_eq!(
        send(gw, Method::POST, "/orders", &[], "x").await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn the_gateway_owns_only_its_prefix_and_forwards_clean_headers() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let health = send(gw, Method::GET, "/_idem/health", &[], "").await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.json()["store"], "memory");
    // A proxied request first: the exporter shows a metric once something recorded it.
    post(gw, "/orders", "m-1", "x").await;
    let metrics = send(gw, Method::GET, "/_idem/metrics", &[], "").await;
    assert!(metrics.body.contains("# TYPE"), "{}", metrics.body);

    let moved = start_gateway(up, memory(), "admin_prefix = \"/_gateway\"").await;
    let r = send(moved, Method::GET, "/_idem/health", &[], "").await;
    assert_eq!(r.body, "the upstream's own path");
    assert_eq!(
        send(moved, Method::GET, "/_gateway/health", &[], "")
            .await
            .status,
        StatusCode::OK
    );

    send(
        gw,
        Method::POST,
        "/orders",
        &[
            ("connection", "x-hop"),
            ("x-hop", "secret"),
            ("keep-alive", "timeout=5"),
            ("x-end-to-end", "kept"),
        ],
        "",
    )
    .await;
    let headers = seen.headers.lock().unwrap().last().cloned().unwrap();
    assert!(headers.get("x-hop").is_none());
    assert!(headers.get("keep-alive").is_none());
    assert_eq!(headers["x-end-to-end"], "kept");
    assert_eq!(headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(headers["x-forwarded-proto"], "http");
    assert_eq!(headers["host"], up.to_string());
}

#[tokio::test]
async fn an_upstream_answer_too_large_to_store_is_delivered_once_and_never_rerun() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "[defaults]\nmax_response = 1000").await;
    let r = post(gw, "/big", "k", "").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body.len(), 10_000);
    let r = post(gw, "/big", "k", "").await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "response_not_replayable");
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn an_answer_body_that_stalls_past_the_timeout_is_an_unknown_outcome() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "upstream_timeout = \"200ms\"").await;
    let r = post(gw, "/stalls", "s", "").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
    assert_eq!(r.code(), "response_failed");
    assert_eq!(post(gw, "/stalls", "s", "").await.code(), "outcome_unknown");
    // unguarded, the same answer streams through whole, however long it takes
    let r = send(gw, Method::POST, "/stalls", &[], "").await;
    assert_eq!(r.body, "{\"slow\":true}");
    assert_eq!(seen.runs(), 2);
}

#[tokio::test]
async fn answers_lose_their_hop_by_hop_fields_and_metrics_are_named() {
    let (_, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    for _ in 0..2 {
        let r = post(gw, "/private", "p", "").await;
        assert!(r.headers.get("x-secret").is_none(), "{:?}", r.headers);
    }
    let r = send(gw, Method::GET, "/_idem/nothing-here", &[], "").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let metrics = send(gw, Method::GET, "/_idem/metrics", &[], "").await.body;
    for line in [
        "# HELP idem_http_requests_total ",
        "idem_http_requests_total{outcome=\"replayed\"} ",
        "idem_http_settled_total{result=\"stored\"} ",
        "idem_gateway_upstream_total{outcome=\"answered\"} ",
        "idem_gateway_upstream_seconds_count ",
    ] {
        assert!(metrics.contains(line), "no {line:?} in\n{metrics}");
    }
}

fn is_problem(r: &Reply) -> bool {
    r.headers
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json")
}

#[tokio::test]
async fn no_spelling_of_a_guarded_path_reaches_the_upstream_unguarded() {
    let (seen, up) = start_upstream().await;
    let config = r#"
        [[route]]
        path = "/v1/payments/**"
        key = "required"
        namespace = "payments"
    "#;
    let gw = start_gateway(up, memory(), config).await;
    for (path, code) in [
        ("/v1/./payments/charge", "idempotency_key_missing"),
        ("/v1/x/../payments/charge", "idempotency_key_missing"),
        ("//v1//%70ayments/charge", "idempotency_key_missing"),
        ("/v1/%2e/payments/charge", "ambiguous_path"),
        ("/v1/x/%2E%2E/payments/charge", "ambiguous_path"),
        ("/v1/payments%2Fcharge", "ambiguous_path"),
        ("/v1/payments%5ccharge", "ambiguous_path"),
        ("/v1\\payments/charge", "ambiguous_path"),
        ("/v1;x/payments/charge", "ambiguous_path"),
        ("/v1/payments;x/charge", "ambiguous_path"),
        ("/v1/%00/payments/charge", "ambiguous_path"),
        ("/../v1/payments/charge", "ambiguous_path"),
    ] {
        let r = send(gw, Method::POST, path, &[], "pay").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {}", r.body);
        assert_eq!(r.code(), code, "{path}");
        assert!(is_problem(&r), "{path}");
    }
    assert_eq!(seen.runs(), 0, "a spelling reached the upstream");

    // With a key, any clean spelling is the one request the upstream sees under its one name,
    // and a retry spelled differently is a retry of it.
    let r = post(gw, "/v1/./payments/x/../charge", "p-1", "pay").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        seen.paths.lock().unwrap().as_slice(),
        ["/v1/payments/charge"]
    );
    let r = post(gw, "/v1/payments/%63harge", "p-1", "pay").await;
    assert!(r.replayed(), "{}", r.body);
    // the query is kept as it was
    post(gw, "//v1/payments/charge?x=%2F", "p-2", "pay").await;
    assert_eq!(seen.runs(), 2);
    assert_eq!(
        seen.paths.lock().unwrap().last().unwrap(),
        "/v1/payments/charge"
    );
}

#[tokio::test]
async fn guarded_requests_without_a_credential_are_refused_unless_the_route_shares() {
    let (seen, up) = start_upstream().await;
    let config = r#"
        [[route]]
        path = "/public/**"
        anonymous = "shared"
    "#;
    let gw = start_gateway(up, memory(), config).await;
    let keyed = [("idempotency-key", "k")];
    for auth in [None, Some(""), Some("  ")] {
        let mut headers = keyed.to_vec();
        headers.extend(auth.map(|a| ("authorization", a)));
        let r = send_anonymous(gw, Method::POST, "/orders", &headers, "pay").await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(r.code(), "credential_required");
        assert!(is_problem(&r));
    }
    assert_eq!(seen.runs(), 0);
    // Unguarded requests pass as before: no key, or a method not guarded.
    let r = send_anonymous(gw, Method::POST, "/orders", &[], "pay").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = send_anonymous(gw, Method::GET, "/orders", &keyed, "").await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(seen.runs(), 2);

    // A route that shares: two anonymous callers are one scope.
    let first = send_anonymous(gw, Method::POST, "/public/poll", &keyed, "vote").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = send_anonymous(gw, Method::POST, "/public/poll", &keyed, "vote").await;
    assert!(second.replayed());
    assert_eq!(seen.runs(), 3);

    // The auth scheme is case-insensitive: `bearer alice` is `Bearer alice`.
    let as_alice = |auth: &'static str| async move {
        send(
            gw,
            Method::POST,
            "/orders",
            &[("idempotency-key", "a"), ("authorization", auth)],
            "pay",
        )
        .await
    };
    assert!(!as_alice("Bearer alice").await.replayed());
    assert!(as_alice("bearer alice").await.replayed());
    assert!(as_alice("BEARER   alice").await.replayed());
    assert!(!as_alice("Bearer ALICE").await.replayed());
    assert_eq!(seen.runs(), 5);
}

#[test]
fn the_operator_is_warned_of_shared_scopes_and_withheld_logs() {
    let file = FileConfig::parse(
        r#"
        [[route]]
        path = "/public/**"
        anonymous = "shared"
        [[route]]
        path = "/private/**"
        "#,
    )
    .unwrap();
    let url = UpstreamUrl::parse("http://127.0.0.1:1").unwrap();
    let gateway = Gateway::new(url.clone(), memory())
        .configure(&file)
        .unwrap();
    let warnings = gateway.warnings();
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert!(warnings[0].starts_with("/public/**: "), "{warnings:#?}");
    assert!(
        warnings[1].contains("no scope_secret_file"),
        "{warnings:#?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("scope-secret");
    std::fs::write(&secret, format!("{}\n", "s".repeat(64))).unwrap();
    let file = FileConfig::parse(&format!(
        "scope_secret_file = {:?}\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n\
         [defaults]\nanonymous = \"shared\"",
        secret.display()
    ))
    .unwrap();
    let gateway = Gateway::new(url.clone(), memory())
        .configure(&file)
        .unwrap();
    assert_eq!(
        gateway.warnings(),
        [
            "requests no route matches: guarded requests without the authorization header share \
             one scope (anonymous = \"shared\"), so any such caller can replay another's stored \
             answer by reusing its key",
            "X-Forwarded-* and Forwarded headers are believed from 10.0.0.0/8, ::1/128; make \
             sure only those proxies can reach the gateway",
        ]
    );
    std::fs::write(&secret, "short").unwrap();
    let file = FileConfig::parse(&format!("scope_secret_file = {:?}", secret.display())).unwrap();
    let err = Gateway::new(url, memory()).configure(&file).err().unwrap();
    assert!(err.contains("at least 32 bytes"), "{err}");
}

#[tokio::test]
async fn forwarding_headers_are_this_hop_s_unless_the_peer_is_trusted() {
    let (seen, up) = start_upstream().await;
    let spoofed = [
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "admin.internal"),
        ("x-forwarded-port", "443"),
        ("x-real-ip", "203.0.113.9"),
        ("forwarded", "for=203.0.113.9;proto=https"),
    ];
    let last_headers = || seen.headers.lock().unwrap().last().cloned().unwrap();

    let gw = start_gateway(up, memory(), "").await;
    for method in [Method::GET, Method::POST] {
        send(gw, method, "/orders", &spoofed, "").await;
        let h = last_headers();
        assert_eq!(h["x-forwarded-for"], "127.0.0.1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], gw.to_string());
        for gone in ["x-forwarded-port", "x-real-ip", "forwarded"] {
            assert!(h.get(gone).is_none(), "{gone}");
        }
        assert_eq!(h["host"], up.to_string());
    }

    let behind = start_gateway(up, memory(), "trusted_proxies = [\"127.0.0.0/8\"]").await;
    send(behind, Method::POST, "/orders", &spoofed, "").await;
    let h = last_headers();
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(h["x-forwarded-host"], "admin.internal");
    assert_eq!(h["forwarded"], "for=203.0.113.9;proto=https");
    assert_eq!(h["x-real-ip"], "203.0.113.9");
    // From a trusted proxy that sent none, the gateway's own view.
    send(behind, Method::POST, "/orders", &[], "").await;
    let h = last_headers();
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");

    let elsewhere = start_gateway(up, memory(), "trusted_proxies = [\"10.0.0.0/8\"]").await;
    send(elsewhere, Method::POST, "/orders", &spoofed, "").await;
    assert_eq!(last_headers()["x-forwarded-for"], "127.0.0.1");
    let file = FileConfig::parse("trusted_proxies = [\"10.0.0.0/40\"]").unwrap();
    let url = UpstreamUrl::parse(&format!("http://{up}")).unwrap();
    assert!(Gateway::new(url, memory()).configure(&file).is_err());
}

#[tokio::test]
async fn nothing_under_the_reserved_prefix_is_ever_forwarded() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    for method in [Method::GET, Method::POST, Method::DELETE] {
        // The prefix itself is the admin page: off without an admin token, and GET only.
        for path in ["/_idem", "/_idem/", "/%5fidem/"] {
            let r = send(gw, method.clone(), path, &[("idempotency-key", "k")], "").await;
            let code = if method == Method::GET {
                "admin_disabled"
            } else {
                "method_not_allowed"
            };
            assert_eq!(r.code(), code, "{method} {path}: {}", r.body);
            assert!(is_problem(&r), "{method} {path}");
        }
        for path in [
            "/_idem/nothing-here",
            "//_idem/health/x",
            "/%5Fidem/x",
            "/x/../_idem/x",
            "/./_idem/x",
            "/_IDEM/health",
            "/_Idem/records/reopen",
        ] {
            let r = send(gw, method.clone(), path, &[("idempotency-key", "k")], "").await;
            assert_eq!(
                r.status,
                StatusCode::NOT_FOUND,
                "{method} {path}: {}",
                r.body
            );
            assert_eq!(r.code(), "not_found", "{method} {path}");
            assert!(is_problem(&r), "{method} {path}");
        }
    }
    for path in ["/_idem%2Fhealth", "/_idem/%2e%2e/orders", "/_idem;x/health"] {
        let r = send(gw, Method::POST, path, &[], "").await;
        assert_eq!(r.code(), "ambiguous_path", "{path}");
    }
    assert_eq!(seen.runs(), 0, "{:?}", seen.paths.lock().unwrap());

    // Every spelling of the exact prefix is the gateway's own endpoint.
    for path in [
        "/_idem/health",
        "//_idem/./health",
        "/%5Fidem/health/",
        "/_idem/metrics?x=1",
    ] {
        let r = send(gw, Method::GET, path, &[], "").await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
    }
    // A wrong method is a problem too, with the methods it takes.
    for (method, path, allow) in [
        (Method::POST, "/_idem/health", "GET,HEAD"),
        (Method::DELETE, "/_idem/metrics", "GET,HEAD"),
        (Method::GET, "/_idem/records/reopen", "POST"),
        (Method::PUT, "/_idem/records/inspect", "POST"),
    ] {
        let r = send(gw, method.clone(), path, &[], "").await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(r.code(), "method_not_allowed", "{method} {path}");
        assert!(is_problem(&r), "{method} {path}");
        assert_eq!(r.headers["allow"], allow, "{method} {path}");
    }
    assert_eq!(seen.runs(), 0);
}
