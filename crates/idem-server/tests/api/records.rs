//! Records through the API: their lifecycle, leases, fingerprints, callers, the purge.

use super::*;

#[tokio::test]
async fn health_reports_the_store() {
    let api = Api::new();
    let r = api.get("/healthz", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body["status"], "ok", "{}", r.body);
    assert_eq!(r.body["store"], "memory");
    assert_eq!(r.body["components"]["store"], json!({"status": "ok"}));
}

#[tokio::test]
async fn full_record_lifecycle() {
    let api = Api::new();
    let b = api
        .begin(None, "k1", json!({"amount": 1, "to": "bob"}))
        .await;
    let lease = lease_of(&b);
    assert_eq!(acquisition(&b.body["lease"]["fence"]), 1);

    let again = api
        .begin(None, "k1", json!({"to": "bob", "amount": 1}))
        .await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.code(), "in_progress");
    assert_eq!(again.headers[header::RETRY_AFTER], "10");

    let other = api
        .begin(None, "k1", json!({"amount": 2, "to": "bob"}))
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.code(), "fingerprint_mismatch");

    let c = api.complete(None, "k1", &lease, json!({"tx": "t-1"})).await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);

    let replay = api
        .begin(None, "k1", json!({"amount": 1, "to": "bob"}))
        .await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.body["outcome"], "replay");
    assert_eq!(replay.body["response"], json!({"tx": "t-1"}));
    assert_eq!(acquisition(&replay.body["fence"]), 1);

    let rec = api.get("/v1/records/pay/k1", None).await;
    assert_eq!(rec.status, StatusCode::OK);
    assert_eq!(rec.body["status"], "completed");
    assert_eq!(acquisition(&rec.body["fence"]), 1);
    assert_eq!(rec.body["response"], json!({"tx": "t-1"}));
    assert!(rec.body["expires_at"].as_str().unwrap().ends_with('Z'));
}

#[tokio::test]
async fn release_then_retry_runs_again_with_a_higher_fence() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    let r = api
        .post(
            "/v1/records/release",
            None,
            &json!({"namespace": "pay", "key": "k", "lease": lease}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let again = api.begin(None, "k", json!(1)).await;
    assert_eq!(acquisition(&again.body["lease"]["fence"]), 2);
}

#[tokio::test]
async fn a_renewed_lease_keeps_the_key_past_its_first_end() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    let renew = |lease_ms: Option<u64>| {
        let mut body = json!({"namespace": "pay", "key": "k", "lease": lease});
        if let Some(ms) = lease_ms {
            body["lease_ms"] = json!(ms);
        }
        body
    };
    // Renewed before its 10 s end, for 30 s from then: the key is still held at 25 s.
    api.clock.advance(Duration::from_secs(8));
    let r = api
        .post("/v1/records/renew", None, &renew(Some(30_000)))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["lease"]["id"], json!(lease));
    api.clock.advance(Duration::from_secs(17));
    let r = api.begin(None, "k", json!(1)).await;
    assert_eq!(r.code(), "in_progress", "{}", r.body);
    // Past the renewed end another attempt takes it over, and the old lease renews no more.
    api.clock.advance(Duration::from_secs(14));
    let new = lease_of(&api.begin(None, "k", json!(1)).await);
    assert_ne!(new, lease);
    let r = api.post("/v1/records/renew", None, &renew(None)).await;
    assert_eq!((r.status, r.code()), (StatusCode::CONFLICT, "stale_lease"));
    let r = api.post("/v1/records/renew", None, &renew(Some(0))).await;
    assert_eq!(r.code(), "invalid_duration");
}

#[tokio::test]
async fn stale_lease_is_refused_after_takeover() {
    let api = Api::new();
    let old = lease_of(&api.begin(None, "k", json!(1)).await);
    api.clock.advance(Duration::from_secs(11));
    let new = lease_of(&api.begin(None, "k", json!(1)).await);
    assert_ne!(old, new);
    let r = api.complete(None, "k", &old, json!("old")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "stale_lease");
    let r = api
        .post(
            "/v1/records/release",
            None,
            &json!({"namespace": "pay", "key": "k", "lease": old}),
        )
        .await;
    assert_eq!(r.code(), "stale_lease");
    let r = api.complete(None, "k", &new, json!("new")).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn a_late_complete_is_accepted_and_a_different_repeat_is_stale() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    // The lease ran out but nobody took the key over: the result is kept.
    api.clock.advance(Duration::from_secs(11));
    let r = api.complete(None, "k", &lease, json!("first")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = api.complete(None, "k", &lease, json!("first")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = api.complete(None, "k", &lease, json!("second")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "stale_lease");
    let replay = api.begin(None, "k", json!(1)).await;
    assert_eq!(replay.body["response"], json!("first"));
}

#[tokio::test]
async fn a_null_request_is_a_request() {
    let api = Api::new();
    let lease = lease_of(&api.begin(None, "null", Value::Null).await);
    api.complete(None, "null", &lease, json!("done")).await;
    assert_eq!(
        api.begin(None, "null", Value::Null).await.body["outcome"],
        "replay"
    );
    assert_eq!(
        api.begin(None, "null", json!(0)).await.code(),
        "fingerprint_mismatch"
    );
}

/// A request is fingerprinted as written: numbers `f64` cannot tell apart are two requests,
/// and an object that names a member twice is refused. A stored response comes back byte for
/// byte: its numbers as written, its members in their order.
#[tokio::test]
async fn numbers_are_kept_exactly_and_a_member_named_twice_is_refused() {
    let api = Api::new();
    let begin = |key: &str, request: &str| {
        api.post_raw(
            "/v1/records/begin",
            None,
            "application/json",
            format!(r#"{{"namespace":"pay","key":"{key}","request":{request}}}"#),
        )
    };
    let lease = lease_of(&begin("big", r#"{"amount":18446744073709551616}"#).await);
    let other = begin("big", r#"{"amount":18446744073709551617}"#).await;
    assert_eq!(other.code(), "fingerprint_mismatch");
    let lease_small = lease_of(&begin("tenth", r#"{"amount":0.1}"#).await);
    let other = begin("tenth", r#"{"amount":0.10000000000000000001}"#).await;
    assert_eq!(other.code(), "fingerprint_mismatch");
    // Spellings of one value are one request.
    assert_eq!(
        begin("tenth", r#"{"amount":1e-1}"#).await.code(),
        "in_progress"
    );

    let twice = begin("dup", r#"{"amount":100,"amount":999}"#).await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(twice.code(), "malformed_json");
    let nested = begin("dup", r#"[{"to":"bob","to":"eve"}]"#).await;
    assert_eq!(nested.code(), "malformed_json");

    let stored = r#"{"paid":18446744073709551616,"z":1,"a":[0.10000000000000000001]}"#;
    let c = api
        .post_raw(
            "/v1/records/complete",
            None,
            "application/json",
            format!(r#"{{"namespace":"pay","key":"big","lease":"{lease}","response":{stored}}}"#),
        )
        .await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);
    let replay = begin("big", r#"{"amount":18446744073709551616}"#).await;
    assert_eq!(replay.body["outcome"], "replay");
    assert!(
        replay.text.contains(&format!(r#""response":{stored}"#)),
        "{}",
        replay.text
    );
    let record = api.get("/v1/records/pay/big", None).await;
    assert!(record.text.contains(stored), "{}", record.text);
    api.complete(None, "tenth", &lease_small, json!(1)).await;
}

#[tokio::test]
async fn fingerprint_string_mode() {
    let api = Api::new();
    let begin = |fp: &'static str| {
        let api = &api;
        async move {
            api.post(
                "/v1/records/begin",
                None,
                &json!({"namespace": "pay", "key": "s", "fingerprint": fp}),
            )
            .await
        }
    };
    let lease = lease_of(&begin("sha256:abc").await);
    api.complete(None, "s", &lease, json!(null)).await;
    assert_eq!(begin("sha256:abc").await.body["outcome"], "replay");
    assert_eq!(begin("sha256:abd").await.code(), "fingerprint_mismatch");
}

fn keys() -> Auth {
    Auth::parse_keys(&format!("shop {KEY_A}\nbank {KEY_B}\n"), "test").unwrap()
}

#[tokio::test]
async fn callers_never_see_each_others_records() {
    let api = Api::with(Arc::new(MemoryStore::new()), keys());
    let a = lease_of(&api.begin(Some(KEY_A), "shared", json!({"a": 1})).await);
    api.complete(Some(KEY_A), "shared", &a, json!("A's answer"))
        .await;

    // B with A's key and A's request: not a replay of A's answer, a fresh record.
    let b = api.begin(Some(KEY_B), "shared", json!({"a": 1})).await;
    assert_eq!(b.body["outcome"], "acquired");
    let rec = api.get("/v1/records/pay/shared", Some(KEY_B)).await;
    assert_eq!(rec.body["status"], "in_progress");
    assert!(rec.body.get("response").is_none());
    // B cannot use A's lease on B's record either.
    let r = api
        .complete(Some(KEY_B), "shared", &a, json!("forged"))
        .await;
    assert_eq!(r.code(), "stale_lease");
    // and A still gets its own answer
    let replay = api.begin(Some(KEY_A), "shared", json!({"a": 1})).await;
    assert_eq!(replay.body["response"], "A's answer");
}

#[tokio::test]
async fn unknown_or_missing_api_keys_are_unauthorized() {
    let api = Api::with(Arc::new(MemoryStore::new()), keys());
    for auth in [None, Some("not-a-known-key-000000")] {
        let r = api.begin(auth, "k", json!(1)).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
        assert_eq!(r.code(), "unauthorized");
        let r = api.get("/v1/records/pay/k", auth).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    let raw = Request::post("/v1/records/begin")
        .header(header::AUTHORIZATION, "Basic Zm9vOmJhcg==")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(api.send(raw).await.code(), "unauthorized");
    // the scheme name is case-insensitive (RFC 9110 §11.1)
    let shouting = Request::post("/v1/records/begin")
        .header(header::AUTHORIZATION, format!("BEARER {KEY_A}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"namespace":"pay","key":"k","request":1}"#))
        .unwrap();
    assert_eq!(api.send(shouting).await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_failing_store_fails_closed_with_503() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let api = Api::with(Arc::new(faulty.clone()), Auth::anonymous());
    let lease = lease_of(&api.begin(None, "k", json!(1)).await);
    faulty.set_down(true);
    let r = api.begin(None, "k2", json!(1)).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
    );
    let r = api.complete(None, "k", &lease, json!(1)).await;
    assert_eq!(r.code(), "store_unavailable");
    let r = api.get("/healthz", None).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    faulty.set_down(false);
    assert_eq!(api.get("/healthz", None).await.status, StatusCode::OK);
    // the work never ran for k2: it is still absent
    assert_eq!(
        api.get("/v1/records/pay/k2", None).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn the_purge_loop_deletes_expired_records() {
    let store = MemoryStore::new();
    let api = Api::with(Arc::new(store.clone()), Auth::anonymous());
    for key in ["p1", "p2"] {
        let lease = lease_of(
            &api.post(
                "/v1/records/begin",
                None,
                &json!({"namespace": "pay", "key": key, "fingerprint": "f", "ttl_ms": 1000}),
            )
            .await,
        );
        api.complete(None, key, &lease, json!(1)).await;
    }
    assert_eq!(store.len(), 2);
    api.clock.advance(Duration::from_secs(2));
    let purger = tokio::spawn(idem_server::purge_loop(
        Arc::new(store.clone()),
        Arc::new(api.clock.clone()),
        Duration::from_millis(10),
    ));
    for _ in 0..200 {
        if store.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    purger.abort();
    assert!(store.is_empty(), "expired records were not purged");
}

#[tokio::test]
async fn records_kept_beyond_year_9999_are_still_shown() {
    use idem_core::{BeginRequest, Fingerprint, Key, Store, Timestamp};
    let store = MemoryStore::new();
    let api = Api::with(Arc::new(store.clone()), Auth::anonymous());
    let req = BeginRequest::new(
        Key::parse("default", "pay", "forever").unwrap(),
        Fingerprint::of_bytes(b"f"),
    )
    .with_lease(Duration::MAX)
    .with_ttl(Duration::MAX);
    store.begin(&req, Timestamp::now()).await.unwrap();
    let r = api.get("/v1/records/pay/forever", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["expires_at"], "9999-12-31T23:59:59.999Z");
}

/// A client that hangs up after the store took its key does not leave the key held for the
/// whole lease: the key is given back, and the next begin takes it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_its_key_is_taken_leaves_the_key_free() {
    let store = FaultyStore::new(MemoryStore::new());
    let api = Api::with(Arc::new(store.clone()), Auth::anonymous());
    // The begin is sent and waits at the store, then takes effect whatever the client does.
    let taken = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(taken.clone()));
    // Tells when the key is given back.
    let given_back = Stall::new();
    given_back.release();
    store.fail_next(Op::Release, Fault::Stall(given_back.clone()));
    let begin = json!({"namespace": "pay", "key": "k", "request": 1, "lease_ms": 600_000});
    let req = Request::post("/v1/records/begin")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(begin.to_string()))
        .unwrap();
    let app = api.app.clone();
    taken.abandon(async move { app.oneshot(req).await }).await;
    taken.release();
    within("the key to be taken", taken.landed()).await;
    within("the key to be given back", given_back.landed()).await;
    // The test clock never moves: a key still held would answer `in_progress`.
    let r = api.post("/v1/records/begin", None, &begin).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["outcome"], "acquired");
}

/// Every answer carries a request id: the caller's when it is sound, a new one otherwise,
/// problems included.
#[tokio::test]
async fn every_answer_carries_a_request_id() {
    let api = Api::new();
    let given = Request::get("/healthz")
        .header("x-request-id", "req-9")
        .body(Body::empty())
        .unwrap();
    assert_eq!(api.send(given).await.headers["x-request-id"], "req-9");
    let unfit = Request::get("/healthz")
        .header("x-request-id", "two words")
        .body(Body::empty())
        .unwrap();
    let made = api.send(unfit).await.headers["x-request-id"].clone();
    assert_eq!(made.len(), 32);
    let problem = api.get("/v1/no-such-endpoint", None).await;
    assert_eq!(problem.status, StatusCode::NOT_FOUND);
    assert_eq!(problem.headers["x-request-id"].len(), 32);
}
