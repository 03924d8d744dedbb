//! Connection limits: slow and idle clients, the connection cap, a flood of sockets.

use super::*;

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
