//! The operator's record tools through the gateway: listing, reopening, access.

use super::*;

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
    let (gw, tools) = start_gateway_with_admin(up, memory(), &config).await;
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
        send(tools, Method::POST, path, &headers, &body).await
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
    let fence = r.json()["fence"].as_u64().expect("a fence");
    assert_eq!(
        idem_core::Lease::acquisition_of(fence),
        1,
        "the first attempt's fence"
    );
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
    assert_eq!(
        r.json(),
        serde_json::json!({"reopened": true, "fence": fence})
    );
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
    let (gw, tools) = start_gateway_with_admin(up, memory(), &config).await;
    for key in ["t1", "t2"] {
        let slow = [("idempotency-key", key), ("x-delay-ms", "1000")];
        let r = send(gw, Method::POST, "/v1/payments", &slow, "pay").await;
        assert_eq!(r.code(), "upstream_timeout");
    }
    let fine = [("idempotency-key", "ok")];
    send(gw, Method::POST, "/v1/payments", &fine, "pay").await;
    let bearer = [("authorization", "Bearer operator-token-0123456789")];

    let r = send(tools, Method::GET, "/_idem/records/counts", &bearer, "").await;
    assert_eq!(r.json()["unknown"], 2, "{}", r.body);
    assert_eq!(r.json()["completed"], 3);
    let r = send(
        tools,
        Method::GET,
        "/_idem/records?state=unknown",
        &bearer,
        "",
    )
    .await;
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
        tools,
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
    let r = send(
        tools,
        Method::POST,
        "/_idem/records/repair",
        &headers,
        &body,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.json(), serde_json::json!({"applied": 1, "skipped": 1}));
    let r = send(tools, Method::GET, "/_idem/records/counts", &bearer, "").await;
    assert_eq!(r.json()["unknown"], 0);
    // t1 ran again once (by its retry), t2 is free to; nothing else was forwarded.
    assert_eq!(seen.runs(), 4);
    let r = send(tools, Method::GET, "/_idem", &bearer, "").await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn the_record_tools_are_disabled_without_an_admin_token() {
    let (_, up) = start_upstream().await;
    let (_, tools) = start_gateway_with_admin(up, memory(), "").await;
    let body = serde_json::json!({"path": "/orders", "key": "t", "scope": "anonymous"});
    let headers = [
        ("authorization", "Bearer anything-at-all-here"),
        ("content-type", "application/json"),
    ];
    let r = send(
        tools,
        Method::POST,
        "/_idem/records/reopen",
        &headers,
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.code(), "admin_disabled");
}

/// The page names its assets under the configured prefix, whatever spelling of it was asked
/// for: `//evil.example/..//_idem` is the page too, and must not load its script from
/// `//evil.example/…`.
#[tokio::test]
async fn the_page_names_its_assets_from_the_prefix_not_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "operator-token-0123456789").unwrap();
    let (_, up) = start_upstream().await;
    let config = format!("admin_token_file = {:?}", token_file.display());
    let (_, tools) = start_gateway_with_admin(up, memory(), &config).await;
    for path in [
        "/_idem",
        "//evil.example/..//_idem",
        "/x/..//_idem/",
        "/%5Fidem",
    ] {
        let r = send(tools, Method::GET, path, &[], "").await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
        assert!(
            r.body.contains(r#"<script src="/_idem/assets/app.js""#)
                && r.body.contains(r#"href="/_idem/assets/app.css""#),
            "{path}: {}",
            r.body
        );
        assert!(!r.body.contains("evil"), "{path}: {}", r.body);
    }
}
