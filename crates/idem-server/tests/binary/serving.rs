//! `idem serve` and `idem gateway` as processes: records across restarts, shutdown, a
//! gateway killed mid-request, metrics.

use super::*;

#[test]
fn serves_the_record_api_on_sqlite_and_keeps_records_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let begin = r#"{"namespace":"transfer","key":"order-42","request":{"amount":100}}"#;

    let server = start(&["--store", &store]);
    let (status, body) = get(&server.addr, "/healthz");
    assert_eq!(status, 200);
    assert!(body.contains(r#""store":"sqlite""#), "{body}");
    let (status, body) = post_json(&server.addr, "/v1/records/begin", begin);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let lease = v["lease"]["id"].as_str().unwrap();
    let complete = format!(
        r#"{{"namespace":"transfer","key":"order-42","lease":"{lease}","response":{{"ok":true}}}}"#
    );
    assert_eq!(
        post_json(&server.addr, "/v1/records/complete", &complete).0,
        200
    );
    drop(server);

    // a new process on the same file replays the stored answer
    let server = start(&["--store", &store]);
    let (status, body) = post_json(&server.addr, "/v1/records/begin", begin);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(r#""outcome":"replay""#) && body.contains(r#""ok":true"#),
        "{body}"
    );
}

#[test]
fn chunked_bodies_over_the_limit_are_refused() {
    let server = start(&["--store", "memory://", "--max-body", "1000"]);
    let chunk = format!("{:x}\r\n{}\r\n", 600, " ".repeat(600));
    let req = format!(
        "POST /v1/records/begin HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{chunk}{chunk}0\r\n\r\n"
    );
    let (status, body) = http(&server.addr, &req);
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("body_too_large"), "{body}");
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let mut server = start(&["--store", "memory://"]);
    let (status, _) = get(&server.addr, "/healthz");
    assert_eq!(status, 200);
    let killed = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // Without a handler SIGTERM would end the process by signal, not with status 0.
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn a_gateway_killed_mid_request_neither_runs_it_twice_at_once_nor_loses_the_answer() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        "upstream_timeout = \"1s\"\n[defaults]\nlease = \"2s\"\n",
    )
    .unwrap();
    let (upstream, runs) = counting_upstream();
    let upstream = format!("http://{upstream}");
    let args = [
        "--upstream",
        upstream.as_str(),
        "--store",
        store.as_str(),
        "--config",
        config.to_str().unwrap(),
    ];

    // The first attempt reaches the upstream; the gateway dies before it answers.
    let mut gateway = start_command("gateway", &args);
    let addr = gateway.addr.clone();
    let first = std::thread::spawn(move || {
        let mut s = TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(b"POST /orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nIdempotency-Key: order-7\r\nContent-Length: 6\r\n\r\npay 10");
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
    });
    let waiting = std::time::Instant::now();
    while runs.load(Ordering::SeqCst) == 0 {
        assert!(
            waiting.elapsed() < Duration::from_secs(30),
            "the request never reached the upstream"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    gateway.child.kill().unwrap(); // SIGKILL: no clean-up of any kind
    gateway.child.wait().unwrap();
    first.join().unwrap();

    // Restarted on the same file: while the first attempt's lease lasts, a retry is told to
    // wait rather than run the order a second time alongside the first.
    let gateway = start_command("gateway", &args);
    let (status, body) = order(&gateway.addr);
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("request_in_progress"), "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // After the lease, the retry takes the key over and runs (the gateway never learned the
    // first outcome), and from then on every retry gets that answer, across restarts too.
    std::thread::sleep(Duration::from_millis(2100));
    let (status, body) = order(&gateway.addr);
    assert_eq!((status, body.as_str()), (201, "{\"run\":2}"));
    drop(gateway);
    let gateway = start_command("gateway", &args);
    let (status, body) = order(&gateway.addr);
    assert_eq!((status, body.as_str()), (201, "{\"run\":2}"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[test]
fn a_fresh_gateway_process_describes_its_metrics() {
    // A process of its own: the recorder is installed by this gateway, not by an earlier test.
    let gateway = start_command(
        "gateway",
        &["--upstream", "http://127.0.0.1:1", "--store", "memory://"],
    );
    // one guarded request, to an upstream that is not there: a metric of each family
    let (status, _) = order(&gateway.addr);
    assert_eq!(status, 502);
    let (status, body) = get(&gateway.addr, "/_idem/metrics");
    assert_eq!(status, 200);
    for help in [
        "# HELP idem_http_requests_total ",
        "# HELP idem_gateway_upstream_total ",
    ] {
        assert!(body.contains(help), "no {help:?} in\n{body}");
    }
}

#[test]
fn a_gateway_on_memory_publishes_the_stores_size_and_bounds() {
    let (upstream, _runs) = counting_upstream();
    let gateway = start_command(
        "gateway",
        &[
            "--upstream",
            &format!("http://{upstream}"),
            "--store",
            "memory://?max_records=50&max_bytes=1000000",
        ],
    );
    let (status, body) = order(&gateway.addr);
    assert_eq!(status, 201, "{body}");
    // The gauges are refreshed every few seconds: wait for the stored record to show.
    let started = std::time::Instant::now();
    loop {
        let (status, body) = get(&gateway.addr, "/_idem/metrics");
        assert_eq!(status, 200, "{body}");
        if body.lines().any(|l| l == "idem_store_memory_records 1") {
            assert!(
                body.lines()
                    .any(|l| l == "idem_store_memory_max_records 50"),
                "{body}"
            );
            assert!(
                body.lines()
                    .any(|l| l == "idem_store_memory_max_bytes 1000000"),
                "{body}"
            );
            assert!(body.contains("# HELP idem_store_memory_bytes "), "{body}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no record counted in\n{body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// With an admin token, `idem serve` and `idem gateway` serve the admin page and the record
/// tools on a listener of their own (`--admin-listen`): the API's, or the upstream's, origin
/// answers 404 there, so no script of theirs can reach the page or the token it keeps.
#[test]
fn the_admin_page_is_served_on_a_listener_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "operator-token-0123456789\n").unwrap();
    let token = token.display().to_string();
    fails_with(
        &[
            "serve",
            "--store",
            "memory://",
            "--listen",
            "127.0.0.1:7999",
            "--admin-listen",
            "127.0.0.1:7999",
            "--admin-token-file",
            &token,
        ],
        "needs an address of its own",
    );
    for command in [
        &["serve"][..],
        &["gateway", "--upstream", "http://127.0.0.1:1"],
    ] {
        let mut child = idem()
            .args(command)
            .args(["--store", "memory://", "--listen", "127.0.0.1:0"])
            .args([
                "--admin-listen",
                "127.0.0.1:0",
                "--admin-token-file",
                &token,
            ])
            .env("IDEM_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let after = |line: &str, marker: &str| {
            line.split(marker)
                .nth(1)
                .map(|rest| rest.split(['/', ' ']).next().unwrap().to_owned())
        };
        let (mut api, mut admin) = (None, None);
        while api.is_none() || admin.is_none() {
            let line = lines
                .next()
                .expect("the server printed its addresses")
                .unwrap();
            api = api.or_else(|| after(&line, "listening on http://"));
            admin = admin.or_else(|| after(&line, "admin page on http://"));
        }
        std::thread::spawn(move || for _ in lines {});
        let server = Server {
            child,
            addr: api.unwrap(),
        };
        let admin = admin.unwrap();
        assert_ne!(server.addr, admin, "{command:?}");

        let (status, body) = get(&admin, "/_idem");
        assert_eq!(status, 200, "{command:?}: {body}");
        assert!(
            body.contains(r#"<script src="/_idem/assets/app.js""#),
            "{body}"
        );
        let (status, _) = get(&admin, "/_idem/health");
        assert_eq!(status, 200, "{command:?}");
        for path in ["/_idem", "/_idem/records", "/_idem/assets/app.js"] {
            let (status, body) = get(&server.addr, path);
            assert_eq!(status, 404, "{command:?} {path}: {body}");
            assert!(
                body.contains("--admin-listen"),
                "{command:?} {path}: {body}"
            );
        }
        let (status, _) = get(&server.addr, "/_idem/health");
        assert_eq!(status, 200, "{command:?}");
    }
}
