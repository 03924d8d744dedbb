//! Retries answered once: the stored answer replayed, from the store or from memory.

use super::*;

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
    let (a, a_tools) = start_gateway_with_admin(up, Arc::new(cache_a.clone()), &config).await;
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
    let r = send(
        a_tools,
        Method::POST,
        "/_idem/records/reopen",
        &headers,
        &body,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = post(b, "/v1/orders", "k2", "y").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(!r.replayed());
    assert_eq!(seen.runs(), 3);
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
