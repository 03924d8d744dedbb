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

/// A counting service: each POST's `Idempotency-Key` is counted (read as the gateway reads
/// it); each answer takes 20 ms, so that a kill often lands while a request is in flight.
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
                        if let Some((name, value)) = line.split_once(':') {
                            let value = value.trim();
                            match name.to_ascii_lowercase().as_str() {
                                "content-length" => length = value.parse().unwrap(),
                                "idempotency-key" => {
                                    key = idem_http::parse_key(value.as_bytes()).unwrap();
                                }
                                _ => {}
                            }
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

/// `idem gateway` in front of `upstream`, on a port of its own, with `extra` flags.
fn gateway(upstream: &str, dir: &std::path::Path, extra: &[&str]) -> (Proc, String) {
    let store = format!("sqlite://{}", dir.join("gateway.db").display());
    let upstream = format!("http://{upstream}");
    let flags = [
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &upstream,
        "--store",
        &store,
    ];
    let mut child = idem(&[&flags, extra].concat())
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

/// `idem relay` from RabbitMQ's `queue` to `to`, with its records in `dir`.
fn relay_queue(url: &str, queue: &str, to: &str, dir: &std::path::Path) -> Proc {
    let store = format!("sqlite://{}", dir.join("relay.db").display());
    relay(&[
        "--from",
        url,
        "--queue",
        queue,
        "--to",
        to,
        "--store",
        &store,
        "--header",
        "Authorization: Bearer relay",
    ])
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
        // Generous: a Kafka group hands a killed member's partitions on only once its session
        // ends (3 s in the Kafka test), four times over.
        assert!(
            started.elapsed() < PATIENCE * 3,
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
        let (gateway, gw) = gateway(&service, dir.path(), &[]);
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

/// Declares `queue` and its dead letter, as the relay would, and publishes a message with
/// each of `ids`.
async fn fill_queue(
    url: &str,
    queue: &str,
    ids: impl IntoIterator<Item = impl AsRef<str>>,
    body: &[u8],
) {
    AmqpSource::builder(url, queue)
        .connect()
        .await
        .unwrap()
        .shutdown()
        .await;
    let publisher = AmqpPublisher::connect(url).await.unwrap();
    for id in ids {
        publisher
            .publish_once("", queue, id.as_ref(), body, BasicProperties::default())
            .await
            .unwrap();
    }
    publisher.close().await;
}

#[test]
fn a_relay_killed_and_restarted_delivers_each_amqp_message_once_through_the_gateway() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let queue = format!("relay-{:08x}", rand::random::<u32>());
    let run = Setup::new(400);
    run.rt
        .block_on(fill_queue(&url, &queue, run.sent(), b"{\"paid\":true}"));

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
fn a_relay_killed_and_restarted_delivers_each_redis_stream_entry_once_through_the_gateway() {
    let Some(url) = idem_testkit::services::REDIS.url() else {
        return;
    };
    let name = format!("relay:{:08x}", rand::random::<u32>());
    let run = Setup::new(400);
    let mut conn = run.rt.block_on(async {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        for id in run.sent() {
            idem_mq::redis_streams::publish(&mut conn, &name, id, b"{}")
                .await
                .unwrap();
        }
        conn
    });

    run.relay_through_kills(&["--from", &url, "--stream", &name, "--group", "relay"]);
    run.rt.block_on(async {
        let _: () = redis::cmd("DEL")
            .arg(&name)
            .arg(format!("{name}:dead"))
            .query_async(&mut conn)
            .await
            .unwrap();
    });
}

#[cfg(feature = "kafka")]
#[test]
fn a_relay_killed_and_restarted_delivers_each_kafka_record_once_through_the_gateway() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::config::ClientConfig;
    let Some(broker) = idem_testkit::kafka::Tansu::start() else {
        return;
    };
    let topic = format!("relay-{:08x}", rand::random::<u32>());
    let run = Setup::new(400);
    run.rt.block_on(async {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", broker.brokers())
            .create()
            .unwrap();
        let dead = format!("{topic}.dead");
        let topics = [
            NewTopic::new(&topic, 4, TopicReplication::Fixed(1)),
            NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
        ];
        for made in admin
            .create_topics(&topics, &AdminOptions::new())
            .await
            .unwrap()
        {
            made.unwrap();
        }
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", broker.brokers());
        for (k, v) in idem_testkit::kafka::Tansu::producer_config() {
            config.set(k, v);
        }
        let producer = config.create().unwrap();
        for id in run.sent() {
            idem_mq::kafka::publish(&producer, &topic, id, b"{}", &[], Duration::from_secs(10))
                .await
                .unwrap();
        }
    });
    // A killed member's partitions go to the next one once its session ends: a short session.
    let from = format!("kafka://{}", broker.brokers());
    run.relay_through_kills(&[
        "--from",
        &from,
        "--topic",
        &topic,
        "--group",
        "relay",
        "--kafka-config",
        "session.timeout.ms=3000",
        "--kafka-config",
        "heartbeat.interval.ms=300",
    ]);
}

/// Two relays on one store whose streams and groups would join to one name
/// (`X.eu` with group `x`, `X` with group `eu.x`), carrying the same message ids and payloads:
/// each relay POSTs its own five. Records kept under a namespace that merged the names let
/// the second ack its five on the first's records, with no POST.
#[test]
fn relays_on_one_store_never_take_each_others_records() {
    let Some(url) = idem_testkit::services::REDIS.url() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (service, seen) = counting_service();
    let to = format!("http://{service}/events");
    let store = format!("sqlite://{}", dir.path().join("relay.db").display());
    let base = format!("relay:{:08x}:X", rand::random::<u32>());
    let pairs = [(format!("{base}.eu"), "x"), (base, "eu.x")];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut conn = rt.block_on(async {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        for (stream, _) in &pairs {
            for i in 0..5 {
                idem_mq::redis_streams::publish(&mut conn, stream, &format!("m-{i}"), b"{}")
                    .await
                    .unwrap();
            }
        }
        conn
    });
    for (round, (stream, group)) in pairs.iter().enumerate() {
        let relay = relay(&[
            "--from", &url, "--stream", stream, "--group", group, "--to", &to, "--store", &store,
        ]);
        let started = Instant::now();
        while (0..5).any(|i| seen.lock().unwrap().get(&format!("m-{i}")) != Some(&(round + 1))) {
            assert!(
                started.elapsed() < PATIENCE,
                "the relay on {stream} / {group} POSTed each of its messages: {:?}",
                seen.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(relay);
    }
    rt.block_on(async {
        for (stream, _) in &pairs {
            let _: () = redis::cmd("DEL")
                .arg(stream)
                .arg(format!("{stream}:dead"))
                .query_async(&mut conn)
                .await
                .unwrap();
        }
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
    rt.block_on(fill_queue(&url, &queue, ["m-1", "m-1", "m-2"], b"{}"));
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
        "mqtt://h",
        "--queue",
        "q",
        "--to",
        "http://127.0.0.1:1/",
    ])
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("amqp://") && err.contains("kafka://"), "{err}");
    for (flags, says) in [
        (&["--queue", "q"][..], "needs --topic"),
        (&["--topic", "t", "--kafka-config", "acks"][..], "KEY=VALUE"),
    ] {
        let out = idem(
            &[
                &["relay", "--from", "kafka://h:9092"],
                flags,
                &["--to", "http://127.0.0.1:1/"],
            ]
            .concat(),
        )
        .output()
        .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
    }
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
        "redis://127.0.0.1:1",
        "--queue",
        "q",
        "--to",
        "http://127.0.0.1:1/",
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs --stream"), "{err}");
    let err = relay_refuses(&["--header", "no colon"]);
    assert!(err.contains("Name: value"), "{err}");
    // Not a JSON pointer: refused at start, before the broker (which is not there) is tried.
    let err = relay_refuses(&["--key-json", "no-slash"]);
    assert!(
        err.contains("--key-json")
            && err.contains("is not a JSON pointer")
            && err.contains("/order/id"),
        "{err}"
    );
    assert!(
        !err.contains("broker") && !err.contains("panicked"),
        "{err}"
    );
}

/// What `idem relay` prints when it refuses to start with `extra` beside flags that would
/// do (to a broker and a target that are not there).
fn relay_refuses(extra: &[&str]) -> String {
    let base = [
        "relay",
        "--from",
        "amqp://127.0.0.1:1/%2f",
        "--queue",
        "q",
        "--to",
        "http://127.0.0.1:1/",
    ];
    let out = idem(&[&base, extra].concat()).output().unwrap();
    assert!(!out.status.success(), "{extra:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Message ids that are one key as bare header values (`"q"` and `q`), or two (`a,b`), reach
/// the service through the gateway as exactly themselves, each once: the relay writes them as
/// structured-field strings, which the gateway reads back.
#[test]
fn message_ids_reach_the_service_through_the_gateway_as_exactly_themselves() {
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let queue = format!("relay-k-{:08x}", rand::random::<u32>());
    let run = Setup::new(0);
    let ids = ["a,b", "\"q\"", "q", "back\\slash", "\"a\";x=1"];
    run.rt.block_on(fill_queue(&url, &queue, ids, b"{}"));
    let to = format!("http://{}/events", run.gw);
    let _relay = relay_queue(&url, &queue, &to, run.dir.path());
    let started = Instant::now();
    while run.seen.lock().unwrap().len() < ids.len() {
        assert!(
            started.elapsed() < PATIENCE,
            "{:?}",
            run.seen.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let seen = run.seen.lock().unwrap().clone();
    for id in ids {
        assert_eq!(seen.get(id), Some(&1), "{id}: {seen:?}");
    }
    run.rt.block_on(async {
        AmqpSource::delete_topology(&url, &queue).await.unwrap();
    });
}

/// A service that reads requests and never answers: the gateway in front of it times out.
fn silent_service() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    addr
}

/// The gateway times out on its upstream (504, the outcome recorded as unknown); the relay
/// retries and gets 409 `outcome_unknown`. The message goes to the dead letter with that
/// answer, and is not acked as delivered.
#[test]
fn an_unknown_outcome_at_the_gateway_goes_to_the_dead_letter_with_the_answer() {
    use idem_mq::amqp::{DETAIL_HEADER, REASON_HEADER};
    use idem_mq::bench::{get_one, header_text};
    let Some(url) = idem_testkit::services::RABBITMQ.url() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_gateway, gw) = gateway(&silent_service(), dir.path(), &["--upstream-timeout", "1s"]);
    let queue = format!("relay-u-{:08x}", rand::random::<u32>());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(fill_queue(&url, &queue, ["pay-1"], b"{\"amount\":10}"));
    let to = format!("http://{gw}/payments");
    let _relay = relay_queue(&url, &queue, &to, dir.path());
    let dead = rt.block_on(get_one(&url, &format!("{queue}.dead")));
    assert_eq!(dead.data, b"{\"amount\":10}");
    let props = &dead.delivery.properties;
    assert_eq!(
        header_text(props, REASON_HEADER).as_deref(),
        Some("refused")
    );
    let detail = header_text(props, DETAIL_HEADER).unwrap();
    assert!(
        detail.contains("409") && detail.contains("outcome_unknown"),
        "{detail}"
    );
    rt.block_on(async {
        AmqpSource::delete_topology(&url, &queue).await.unwrap();
    });
}
