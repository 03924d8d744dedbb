//! `idem relay` as a user runs it: the binary consumes a real RabbitMQ queue and a real
//! JetStream stream, POSTs through `idem gateway` to a counting service, is killed with SIGKILL
//! and restarted, and every message's request still runs once.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_mq::amqp::{AmqpPublisher, AmqpSource, BasicProperties};

const PATIENCE: Duration = Duration::from_secs(60);

/// A counting service: each POST's `Idempotency-Key` is counted; each answer takes 20 ms, so
/// that a kill often lands while a request is in flight.
fn counting_service() -> (String, Arc<Mutex<HashMap<String, usize>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let counts = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let counts = counts.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                loop {
                    let (mut length, mut key) = (0, String::new());
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap();
                        }
                        if let Some(v) = lower.strip_prefix("idempotency-key:") {
                            key = v.trim().to_owned();
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    *counts.lock().unwrap().entry(key).or_default() += 1;
                    std::thread::sleep(Duration::from_millis(20));
                    let _ = write!(
                        stream,
                        "HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
                    );
                }
            });
        }
    });
    (addr, seen)
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args).env("IDEM_LOG", "info");
    cmd
}

/// `idem gateway` in front of `upstream`, on a port of its own.
fn gateway(upstream: &str, dir: &std::path::Path) -> (Proc, String) {
    let store = format!("sqlite://{}", dir.join("gateway.db").display());
    let mut child = idem(&[
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &format!("http://{upstream}"),
        "--store",
        &store,
    ])
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the gateway printed its address")
            .unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (Proc(child), addr)
}

fn relay(args: &[&str]) -> Proc {
    Proc(
        idem(&[&["relay"], args].concat())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Runs the relay, killing it with SIGKILL each time the service has seen another fifth of
/// the `total` keys (so mid-stream, with requests in flight) and starting it again, until
/// the service has seen them all; then stops the last one with SIGTERM and checks it exits
/// cleanly. Answers how many times it killed the relay.
fn run_with_kills(args: &[&str], seen: &Arc<Mutex<HashMap<String, usize>>>, total: usize) -> usize {
    let started = Instant::now();
    let mut kills = 0;
    let mut current = relay(args);
    loop {
        let n = seen.lock().unwrap().len();
        if n == total {
            break;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "the relay did not finish in time: {n} of {total} keys seen"
        );
        if kills < 4 && n >= total * (kills + 1) / 5 {
            current.0.kill().unwrap();
            current.0.wait().unwrap();
            kills += 1;
            current = relay(args);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = current.0.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let waited = Instant::now();
    loop {
        if let Some(status) = current.0.try_wait().unwrap() {
            assert!(
                status.success(),
                "SIGTERM ends the relay cleanly: {status:?}"
            );
            break;
        }
        assert!(
            waited.elapsed() < PATIENCE,
            "the relay did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    kills
}

/// What a relay test runs against: a counting service behind a gateway, the ids of the
/// messages to send, and a runtime to send them on.
struct Setup {
    dir: tempfile::TempDir,
    seen: Arc<Mutex<HashMap<String, usize>>>,
    _gateway: Proc,
    gw: String,
    rt: tokio::runtime::Runtime,
    ids: Vec<String>,
}

impl Setup {
    fn new(messages: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (service, seen) = counting_service();
        let (gateway, gw) = gateway(&service, dir.path());
        Self {
            dir,
            seen,
            _gateway: gateway,
            gw,
            rt: tokio::runtime::Runtime::new().unwrap(),
            ids: (0..messages).map(|i| format!("evt-{i}")).collect(),
        }
    }

    /// Every id to publish, three in ten of them twice (redeliveries the relay must drop).
    fn sent(&self) -> impl Iterator<Item = &String> {
        self.ids.iter().enumerate().flat_map(|(i, id)| {
            let copies = if i % 10 < 3 { 2 } else { 1 };
            std::iter::repeat_n(id, copies)
        })
    }

    /// Runs the relay from `source` (its `--from` and queue or stream flags) to the gateway,
    /// killing it four times mid-stream, and checks that the service saw each id exactly
    /// once.
    fn relay_through_kills(&self, source: &[&str]) {
        let store = format!("sqlite://{}", self.dir.path().join("relay.db").display());
        let to = format!("http://{}/events", self.gw);
        let rest = [
            "--to",
            &to,
            "--store",
            &store,
            "--header",
            "Authorization: Bearer relay",
            "--prefetch",
            "8",
            "--lease",
            "2s",
            "--status-every",
            "1s",
        ];
        let kills = run_with_kills(&[source, &rest].concat(), &self.seen, self.ids.len());
        assert_eq!(kills, 4);
        let seen = self.seen.lock().unwrap().clone();
        for id in &self.ids {
            assert_eq!(seen.get(id), Some(&1), "{id} ran once (kills: {kills})");
        }
    }
}

#[test]
fn a_relay_killed_and_restarted_delivers_each_amqp_message_once_through_the_gateway() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let queue = format!("relay-{:08x}", rand::random::<u32>());
    let run = Setup::new(400);
    run.rt.block_on(async {
        // Declares the queue and its dead letter, as the relay would.
        AmqpSource::builder(url.clone(), queue.clone())
            .connect()
            .await
            .unwrap()
            .shutdown()
            .await;
        let publisher = AmqpPublisher::connect(&url).await.unwrap();
        for id in run.sent() {
            publisher
                .publish_once(
                    "",
                    &queue,
                    id,
                    b"{\"paid\":true}",
                    BasicProperties::default(),
                )
                .await
                .unwrap();
        }
        publisher.close().await;
    });

    run.relay_through_kills(&["--from", &url, "--queue", &queue]);
    run.rt.block_on(async {
        AmqpSource::delete_topology(&url, &queue).await.unwrap();
    });
}

#[test]
fn a_relay_killed_and_restarted_delivers_each_jetstream_message_once_through_the_gateway() {
    use async_nats::jetstream::{self, stream};
    let Some(url) = idem_testkit::services::NATS.url() else {
        return;
    };
    let name = format!("RELAY_{:08x}", rand::random::<u32>());
    let run = Setup::new(400);
    let js = run.rt.block_on(async {
        let js = jetstream::new(async_nats::connect(&url).await.unwrap());
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.in")],
            // No server-side duplicate window: the copies reach the relay, which must drop them.
            duplicate_window: Duration::from_millis(100),
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .unwrap();
        // The relay's durable consumer, with an ack wait short enough for the test: a
        // killed relay's messages come back after it.
        js.create_consumer_on_stream(
            jetstream::consumer::pull::Config {
                durable_name: Some("relay".into()),
                ack_wait: Duration::from_secs(2),
                ..Default::default()
            },
            name.as_str(),
        )
        .await
        .unwrap();
        // The dead letter's own stream, which the relay checks for at start.
        js.create_stream(stream::Config {
            name: format!("{name}_DL"),
            subjects: vec![format!("{name}.dead")],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .unwrap();
        for id in run.sent() {
            idem_mq::nats::publish_once(&js, format!("{name}.in"), id, "{}".into())
                .await
                .unwrap();
        }
        js
    });

    run.relay_through_kills(&["--from", &url, "--stream", &name, "--consumer", "relay"]);
    run.rt.block_on(async {
        js.delete_stream(&name).await.unwrap();
        js.delete_stream(format!("{name}_DL")).await.unwrap();
    });
}

#[test]
fn the_relay_serves_its_counts_as_metrics() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let queue = format!("relay-m-{:08x}", rand::random::<u32>());
    let (service, seen) = counting_service();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        AmqpSource::builder(url.clone(), queue.clone())
            .connect()
            .await
            .unwrap()
            .shutdown()
            .await;
        let publisher = AmqpPublisher::connect(&url).await.unwrap();
        for id in ["m-1", "m-1", "m-2"] {
            publisher
                .publish_once("", &queue, id, b"{}", BasicProperties::default())
                .await
                .unwrap();
        }
        publisher.close().await;
    });
    let store = format!("sqlite://{}", dir.path().join("relay.db").display());
    let to = format!("http://{service}/events");
    let mut child = idem(&[
        "relay",
        "--from",
        &url,
        "--queue",
        &queue,
        "--to",
        &to,
        "--store",
        &store,
        "--metrics-listen",
        "127.0.0.1:0",
        "--prefetch",
        "1",
    ])
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let metrics = loop {
        let line = lines
            .next()
            .expect("the relay printed its metrics address")
            .unwrap();
        if let Some(rest) = line.split("metrics on http://").nth(1) {
            break rest.split('/').next().unwrap().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let relay = Proc(child);
    let started = Instant::now();
    let text = loop {
        let text = http_get(&metrics);
        if text.contains("outcome=\"replayed\"") && seen.lock().unwrap().len() == 2 {
            break text;
        }
        assert!(started.elapsed() < PATIENCE, "no counts in time: {text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        text.contains("# TYPE idem_mq_messages_total counter"),
        "{text}"
    );
    assert!(text.contains("idem_relay_requests_total"), "{text}");
    drop(relay);
    rt.block_on(async {
        AmqpSource::delete_topology(&url, &queue).await.unwrap();
    });
}

/// The body of `GET /metrics` at `addr`.
fn http_get(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn relay_flags_are_checked_with_readable_errors() {
    let out = idem(&[
        "relay",
        "--from",
        "kafka://h",
        "--queue",
        "q",
        "--to",
        "http://127.0.0.1:1/",
    ])
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("amqp://"), "{err}");
    let out = idem(&[
        "relay",
        "--from",
        "amqp://127.0.0.1:1/%2f",
        "--to",
        "http://127.0.0.1:1/",
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--queue"), "{err}");
    let out = idem(&[
        "relay",
        "--from",
        "amqp://127.0.0.1:1/%2f",
        "--queue",
        "q",
        "--to",
        "http://127.0.0.1:1/",
        "--header",
        "no colon",
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Name: value"), "{err}");
}
