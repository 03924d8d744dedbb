//! The `idem` binary as a user runs it: start-up errors, and a real server on a real socket.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn idem() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.env_remove("IDEM_STORE")
        .env_remove("IDEM_LISTEN")
        .env_remove("IDEM_API_KEYS_FILE")
        .env_remove("IDEM_UPSTREAM")
        .env_remove("IDEM_GATEWAY_CONFIG");
    cmd
}

fn fails_with(args: &[&str], expected: &str) {
    let out = idem().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(stderr.contains(expected), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
}

#[test]
fn bad_flags_and_stores_get_readable_errors() {
    let dir = tempfile::tempdir().unwrap();
    let not_db = dir.path().join("not.db");
    std::fs::write(&not_db, vec![b'x'; 4096]).unwrap();
    let not_db = format!("sqlite://{}", not_db.display());
    fails_with(&["serve", "--store", "mongodb://x"], "unknown store scheme");
    fails_with(
        &["migrate", "--store", "mongodb://x"],
        "unknown store scheme",
    );
    fails_with(&["migrate", "--store", &not_db], "not a SQLite database");
    fails_with(&["serve", "--store", "idem.db"], "has no scheme");
    fails_with(
        &["serve", "--store", "sqlite:///nonexistent-dir/x/idem.db"],
        "cannot open the file",
    );
    fails_with(&["serve", "--store", &not_db], "not a SQLite database");
    fails_with(&["serve", "--listen", "everywhere"], "invalid value");
    fails_with(&["serve", "--ttl", "soon"], "invalid value");
    fails_with(&["serve", "--lease", "1000y"], "at most");
    fails_with(
        &["serve", "--listen", "0.0.0.0:0", "--store", "memory://"],
        "refusing to serve",
    );
    fails_with(
        &["serve", "--api-keys", "/nonexistent/keys"],
        "cannot read API keys file",
    );
    fails_with(&["frobnicate"], "unrecognized subcommand");
    fails_with(&["gateway", "--store", "memory://"], "no upstream");
    fails_with(
        &["gateway", "--upstream", "https://api.example"],
        "must be an http:// URL",
    );
    fails_with(
        &[
            "gateway",
            "--upstream",
            "http://127.0.0.1:1",
            "--config",
            "/nonexistent.toml",
        ],
        "cannot read /nonexistent.toml",
    );
    let config = dir.path().join("gateway.toml");
    let token = dir.path().join("token");
    std::fs::write(&token, "short\n").unwrap();
    let short_token = format!("admin_token_file = {:?}", token.display());
    for (text, expected) in [
        (
            "upstream_timeout = \"60s\"\n[defaults]\nlease = \"30s\"",
            "longer than upstream_timeout",
        ),
        ("[[route]]\npath = \"orders\"", "must start with /"),
        (
            "[[route]]\npath = \"/a\"\nkey = \"sometimes\"",
            "route]] #1",
        ),
        ("upstream = 5", "invalid type"),
        ("admin_prefix = \"/\"", "admin prefix"),
        ("[defaults]\npath = \"/a\"", "[defaults] takes no path"),
        ("[[route]]\nkey = \"required\"", "needs a path"),
        ("scope_header = \"bad header\"", "not a header name"),
        ("upstream_timeout = \"300000000000y\"", "upstream_timeout"),
        ("upstream_timeout = \"2h\"", "at most"),
        ("purge_interval = \"often\"", "purge_interval"),
        (
            "admin_token_file = \"/nonexistent-token\"",
            "cannot read admin token file",
        ),
        (&short_token, "at least 16 characters"),
    ] {
        std::fs::write(&config, text).unwrap();
        let config = config.to_str().unwrap();
        fails_with(
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                "memory://",
                "--config",
                config,
            ],
            expected,
        );
    }
}

#[test]
fn help_explains_each_command() {
    let out = idem().arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("serve"), "{text}");
    let out = idem().args(["serve", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--store",
        "--listen",
        "--api-keys",
        "IDEM_STORE",
        "sqlite://idem.db",
        "127.0.0.1:7070",
    ] {
        assert!(text.contains(flag), "serve --help lacks {flag}");
    }
}

#[test]
fn migrate_creates_the_schema_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let out = idem()
        .args(["migrate", "--store", &format!("sqlite://{}", db.display())])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("up to date"));
    let conn = rusqlite::Connection::open(&db).unwrap();
    let tables: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE name = 'idem_records'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tables, 1);
}

#[test]
fn id_prints_ids_one_per_line() {
    let out = idem().args(["id", "--count", "3"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let ids: Vec<&str> = text.lines().collect();
    assert_eq!(ids.len(), 3);
    assert!(
        ids.iter()
            .all(|u| u.len() == 36 && u.as_bytes()[14] == b'7')
    );
    assert!(ids.windows(2).all(|w| w[0] < w[1]));

    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("ids.db").display());
    let out = idem()
        .args([
            "id",
            "--kind",
            "snowflake",
            "--count",
            "1000",
            "--store",
            &store,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u64> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 1000);
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    // Two runs of one segment sequence continue it.
    let segment = |n: &str| {
        let out = idem()
            .args([
                "id", "--kind", "segment", "--tag", "orders", "--count", n, "--store", &store,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse::<u64>().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(segment("3"), [1, 2, 3]);
    assert_eq!(segment("2"), [4, 5]);
    fails_with(&["id", "--kind", "segment"], "--tag");
    fails_with(&["id", "--count", "0"], "invalid value");
    fails_with(&["id", "--kind", "ulid"], "invalid value");
}

/// Four processes sharing one SQLite store issue a million Snowflake ids each: no id twice,
/// and each process under a worker id of its own.
#[test]
fn four_processes_on_one_store_never_issue_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("ids.db").display());
    let children: Vec<_> = (0..4)
        .map(|_| {
            idem()
                .args([
                    "id",
                    "--kind",
                    "snowflake",
                    "--count",
                    "1000000",
                    "--store",
                    &store,
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let layout = idem_id::Layout::default();
    let mut all = std::collections::HashSet::with_capacity(4_000_000);
    let mut workers = std::collections::HashSet::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut worker = None;
        let mut count = 0;
        for line in text.lines() {
            let id: u64 = line.parse().unwrap();
            assert!(all.insert(id), "id {id} issued twice");
            let w = layout.decode(id).worker;
            assert_eq!(*worker.get_or_insert(w), w, "one process, two worker ids");
            count += 1;
        }
        assert_eq!(count, 1_000_000);
        assert!(
            workers.insert(worker.unwrap()),
            "two processes shared a worker id"
        );
    }
    assert_eq!(all.len(), 4_000_000);
}

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Server {
    start_command("serve", args)
}

fn start_command(command: &str, args: &[&str]) -> Server {
    let mut cmd = idem();
    cmd.args([command, "--listen", "127.0.0.1:0"]).args(args);
    start_child(cmd)
}

/// Runs `cmd` (a server listening on port 0) and waits for the address it prints.
fn start_child(mut cmd: Command) -> Server {
    let mut child = cmd
        .env("IDEM_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines.next().expect("server printed its address").unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    // keep draining stderr so the server never blocks on a full pipe
    std::thread::spawn(move || for _ in lines {});
    Server { child, addr }
}

/// One HTTP/1.1 exchange on a fresh connection; returns (status, body).
fn http(addr: &str, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

fn post_json(addr: &str, path: &str, body: &str) -> (u16, String) {
    http(
        addr,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

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

/// A one-thread HTTP upstream that counts requests; the first one takes 800 ms.
fn counting_upstream() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let counter = counter.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 1 {
                    std::thread::sleep(Duration::from_millis(800));
                }
                let out = format!("{{\"run\":{n}}}");
                let _ = write!(
                    stream,
                    "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{out}",
                    out.len()
                );
            });
        }
    });
    (addr, runs)
}

fn order(addr: &str) -> (u16, String) {
    http(
        addr,
        "POST /orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer t\r\nIdempotency-Key: order-7\r\nContent-Length: 6\r\n\r\npay 10",
    )
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

/// Reads what the server sends until it closes the connection, writing `trickle` one byte at
/// a time first (a pause between bytes); `None` if it is still open after 30 s.
fn read_until_closed(s: &mut TcpStream, trickle: &[u8]) -> Option<String> {
    let started = std::time::Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut trickle = trickle.iter();
    let mut out = Vec::new();
    let mut buf = [0; 4096];
    while started.elapsed() < Duration::from_secs(30) {
        if let Some(b) = trickle.next()
            && s.write_all(&[*b]).is_err()
        {
            return Some(String::from_utf8_lossy(&out).into_owned());
        }
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&out).into_owned()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(String::from_utf8_lossy(&out).into_owned()),
        }
    }
    None
}

/// `n` connections that send nothing.
fn crowd(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect()
}

fn get(addr: &str, path: &str) -> (u16, String) {
    http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
}

#[test]
fn connection_limits_are_checked_on_the_command_line() {
    fails_with(&["serve", "--header-timeout", "0s"], "longer than zero");
    fails_with(&["serve", "--header-timeout", "1h"], "at most 5m");
    fails_with(&["serve", "--idle-timeout", "2h"], "at most 1h");
    fails_with(&["gateway", "--body-timeout", "soon"], "--body-timeout");
    fails_with(&["serve", "--max-connections", "0"], "from 1 to 1000000");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        "upstream = \"http://127.0.0.1:1\"\nheader_timeout = \"0s\"\n",
    )
    .unwrap();
    fails_with(
        &["gateway", "--config", config.to_str().unwrap()],
        "header_timeout = \"0s\"",
    );
}

#[test]
fn a_request_head_sent_one_byte_at_a_time_is_cut_off() {
    let server = start(&["--store", "memory://", "--header-timeout", "1s"]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
    // 300 header bytes at 100 ms each: 30 s, far past the 1 s the head may take
    let slow = [b'X'; 300];
    let answer = read_until_closed(&mut s, &slow).expect("closed before the head was complete");
    assert!(answer.is_empty(), "{answer}");
}

#[test]
fn an_idle_keep_alive_connection_is_closed() {
    let server = start(&["--store", "memory://", "--idle-timeout", "1s"]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = read_until_closed(&mut s, b"").expect("the idle connection was closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[test]
fn a_trickling_body_is_answered_408() {
    let server = start(&["--store", "memory://", "--body-timeout", "2s"]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(
        b"POST /v1/records/begin HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n",
    )
    .unwrap();
    // three of the fifty bytes, then nothing
    let answer = read_until_closed(&mut s, b"{\"k").expect("the slow body was cut off");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(answer.contains("\"code\":\"body_timeout\""), "{answer}");
}

#[test]
fn at_the_connection_cap_health_still_answers_and_the_rest_is_refused() {
    let server = start(&[
        "--store",
        "memory://",
        "--max-connections",
        "4",
        "--header-timeout",
        "5m",
    ]);
    let idle = crowd(&server.addr, 10);
    // accepted in order, so these two come after the ten idle ones
    let (status, body) = get(&server.addr, "/healthz");
    assert_eq!(status, 200, "{body}");
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(b"GET /v1/ids/uuid7 HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = read_until_closed(&mut s, b"").expect("closed after the 503");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(answer.contains("\"code\":\"overloaded\""), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{answer}"
    );
    drop(idle);
}

#[test]
fn a_gateway_at_its_connection_cap_answers_health_and_counts_refusals() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        "max_connections = 2\nheader_timeout = \"5m\"\nidle_timeout = \"5m\"\n",
    )
    .unwrap();
    let (upstream, runs) = counting_upstream();
    let gateway = start_command(
        "gateway",
        &[
            "--upstream",
            &format!("http://{upstream}"),
            "--store",
            "memory://",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let idle = crowd(&gateway.addr, 5);
    let (status, body) = get(&gateway.addr, "/_idem/health");
    assert_eq!(status, 200, "{body}");
    let (status, body) = order(&gateway.addr);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"code\":\"overloaded\""), "{body}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "refused requests reach no upstream"
    );
    drop(idle);
    // Once the server has seen the idle connections go, the metrics page is served again.
    let started = std::time::Instant::now();
    let metrics = loop {
        let (status, body) = get(&gateway.addr, "/_idem/metrics");
        if status == 200 {
            break body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{status} {body}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        metrics.contains("idem_server_connections_refused_total{reason=\"at_capacity\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("# HELP idem_server_connections "),
        "{metrics}"
    );
}

#[test]
fn a_flood_of_silent_connections_past_the_descriptor_limit_leaves_health_answerable() {
    // A process with 256 descriptors, sent 400 connections that say nothing: the cap (three
    // quarters of the limit) and the overflow close the oldest to let the health check in.
    let mut sh = Command::new("sh");
    sh.args([
        "-c",
        "ulimit -n 256 && exec \"$0\" serve --listen 127.0.0.1:0 --store memory://",
    ])
    .arg(env!("CARGO_BIN_EXE_idem"));
    let server = start_child(sh);
    let idle = crowd(&server.addr, 400);
    let (status, body) = get(&server.addr, "/healthz");
    assert_eq!(status, 200, "{body}");
    drop(idle);
}
