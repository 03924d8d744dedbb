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
        .env_remove("IDEM_API_KEYS_FILE");
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
    let mut child = idem()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
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
    let (status, body) = http(
        &server.addr,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
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
    let (status, _) = http(
        &server.addr,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
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
