//! Paths, routes, headers and credentials: what reaches the upstream, and how.

use super::*;

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
async fn answers_lose_their_hop_by_hop_fields_and_metrics_are_named() {
    let (_, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    for replay in [false, true] {
        let r = post(gw, "/private", "p", "").await;
        assert!(r.headers.get("x-secret").is_none(), "{:?}", r.headers);
        // Only idem says an answer is a replay, and in its own spelling.
        assert_eq!(r.replayed(), replay, "{:?}", r.headers);
        assert!(r.headers.get("idempotent_replayed").is_none());
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
    // A standard method in other letter case is another method to the gateway, which no route
    // guards, and POST to some frameworks.
    for method in ["post", "Post", "pUT", "delete", "patch"] {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let r = send(gw, method.clone(), "/v1/payments/charge", &[], "pay").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{method}: {}", r.body);
        assert_eq!(r.code(), "ambiguous_method", "{method}");
        assert!(is_problem(&r), "{method}");
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

/// `store_timeout` is read from the file; zero, or more than ten minutes, is refused. (That it
/// reaches the routes is the fault harness's burst: a gateway that keeps nothing for a store
/// stalled past it fails.)
#[test]
fn the_store_timeout_is_read_and_bounded() {
    let url = UpstreamUrl::parse("http://127.0.0.1:1").unwrap();
    let configure = |toml: &str| {
        Gateway::new(url.clone(), memory()).configure(&FileConfig::parse(toml).unwrap())
    };
    let gateway = configure("").ok().unwrap();
    assert_eq!(gateway.store_timeout, idem_http::DEFAULT_STORE_TIMEOUT);
    let gateway = configure("store_timeout = \"250ms\"").ok().unwrap();
    assert_eq!(gateway.store_timeout, std::time::Duration::from_millis(250));
    for (toml, needle) in [
        ("store_timeout = \"0s\"", "longer than zero"),
        ("store_timeout = \"11m\"", "at most"),
        ("store_timeout = \"soon\"", "store_timeout"),
    ] {
        let err = configure(toml).err().unwrap();
        assert!(err.contains(needle), "{toml}: {err}");
    }
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

/// A route matched without regard to case folds ASCII letters only; one whose path has other
/// letters is refused at start, rather than missing requests its upstream folds (`Ä`, `ä`).
#[test]
fn a_case_insensitive_route_with_letters_past_ascii_is_refused() {
    let url = UpstreamUrl::parse("http://127.0.0.1:9").unwrap();
    let config = |case: &str| {
        FileConfig::parse(&format!(
            "[[route]]\npath = \"/v1/zahlung-%C3%A4/**\"\n{case}"
        ))
        .unwrap()
    };
    let err = Gateway::new(url.clone(), memory())
        .configure(&config("case_sensitive = false"))
        .err()
        .unwrap();
    assert!(err.contains("ASCII letters only"), "{err}");
    assert!(
        Gateway::new(url.clone(), memory())
            .configure(&config(""))
            .is_ok()
    );
    let ascii =
        FileConfig::parse("[[route]]\npath = \"/v1/pay/**\"\ncase_sensitive = false").unwrap();
    assert!(Gateway::new(url, memory()).configure(&ascii).is_ok());
}

#[tokio::test]
async fn nothing_under_the_reserved_prefix_is_ever_forwarded() {
    let (seen, up) = start_upstream().await;
    let (gw, tools) = start_gateway_with_admin(up, memory(), "").await;
    for method in [Method::GET, Method::POST, Method::DELETE] {
        // The prefix itself is the admin page, served on the admin listener only: off there
        // without an admin token, and GET only.
        for path in ["/_idem", "/_idem/", "/%5fidem/"] {
            let r = send(gw, method.clone(), path, &[("idempotency-key", "k")], "").await;
            assert_eq!(r.code(), "not_found", "{method} {path}: {}", r.body);
            assert!(r.body.contains("--admin-listen"), "{method} {path}");
            assert!(is_problem(&r), "{method} {path}");
            let r = send(tools, method.clone(), path, &[("idempotency-key", "k")], "").await;
            let code = if method == Method::GET {
                "admin_disabled"
            } else {
                "method_not_allowed"
            };
            assert_eq!(r.code(), code, "{method} {path}: {}", r.body);
            assert!(is_problem(&r), "{method} {path}");
        }
        // The admin listener serves nothing else, and forwards nothing; the record tools are
        // not on the gateway's own listener.
        for (addr, path) in [
            (tools, "/orders"),
            (tools, "/"),
            (tools, "/_idemx/health"),
            (gw, "/_idem/records"),
            (gw, "/_idem/records/reopen"),
            (gw, "/_idem/assets/app.js"),
        ] {
            let r = send(addr, method.clone(), path, &[("idempotency-key", "k")], "").await;
            assert_eq!(r.code(), "not_found", "{method} {path}: {}", r.body);
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
    for (addr, method, path, allow) in [
        (gw, Method::POST, "/_idem/health", "GET,HEAD"),
        (gw, Method::DELETE, "/_idem/metrics", "GET,HEAD"),
        (tools, Method::POST, "/_idem/health", "GET,HEAD"),
        (tools, Method::GET, "/_idem/records/reopen", "POST"),
        (tools, Method::PUT, "/_idem/records/inspect", "POST"),
    ] {
        let r = send(addr, method.clone(), path, &[], "").await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(r.code(), "method_not_allowed", "{method} {path}");
        assert!(is_problem(&r), "{method} {path}");
        assert_eq!(r.headers["allow"], allow, "{method} {path}");
    }
    assert_eq!(seen.runs(), 0);
}

/// A guarded request reaches the upstream with its attempt's fence in `Idem-Fence`, higher for
/// an attempt that takes the key again; a client's own `Idem-Fence` is never passed on, nor one
/// spelled `Idem_Fence` (which CGI and WSGI servers read as `Idem-Fence`).
#[tokio::test]
async fn the_upstream_is_told_each_attempt_s_fence_and_never_a_client_s() {
    let (seen, up) = start_upstream().await;
    let last_fence = || {
        let headers = seen.headers.lock().unwrap().last().cloned().unwrap();
        headers
            .get("idem-fence")
            .map(|v| v.to_str().unwrap().parse::<u64>().unwrap())
    };
    let spelled_otherwise = || {
        let headers = seen.headers.lock().unwrap().last().cloned().unwrap();
        headers
            .keys()
            .filter(|n| n.as_str().replace('_', "-") == "idem-fence" && n.as_str() != "idem-fence")
            .count()
    };
    let gw = start_gateway(up, memory(), "").await;
    let forged = ("idem-fence", "99999999999999999");
    let underscored = ("idem_fence", "99999999999999999");
    send(gw, Method::GET, "/orders", &[forged, underscored], "").await;
    assert_eq!(last_fence(), None, "an unguarded request carries none");
    assert_eq!(spelled_otherwise(), 0);
    send(
        gw,
        Method::POST,
        "/orders",
        &[("idempotency-key", "f"), forged, underscored],
        "a",
    )
    .await;
    assert_eq!(
        spelled_otherwise(),
        0,
        "no other spelling reaches the upstream"
    );
    let first = last_fence().expect("a guarded request carries its fence");
    assert_eq!(idem_core::Lease::acquisition_of(first), 1);
    // The upstream's 500 gives the key back; the retry is the next attempt.
    let failing = [("idempotency-key", "g"), ("x-status", "500")];
    send(gw, Method::POST, "/orders", &failing, "a").await;
    let failed = last_fence().unwrap();
    send(gw, Method::POST, "/orders", &failing, "a").await;
    assert_eq!(last_fence(), Some(failed + 1));
}

/// A JSON body that names a member twice is refused before it reaches the upstream; numbers
/// `f64` cannot tell apart are two requests; an answer replays byte for byte.
#[tokio::test]
async fn json_bodies_are_read_exactly() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let post = |key: &'static str, body: &'static str| {
        let headers = [
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ];
        async move { send(gw, Method::POST, "/orders", &headers, body).await }
    };
    let r = post("d", r#"{"amount":100,"amount":999}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "malformed_json");
    assert_eq!(seen.runs(), 0);
    let first = post("n", r#"{"n":18446744073709551616}"#).await;
    let other = post("n", r#"{"n":18446744073709551617}"#).await;
    assert_eq!(other.code(), "idempotency_key_mismatch");
    let again = post("n", r#"{"n":18446744073709551616}"#).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(seen.runs(), 1);
}
