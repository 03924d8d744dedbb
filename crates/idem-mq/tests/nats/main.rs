//! The NATS JetStream adapter against a real server: each test on its own streams, deleted at
//! the end. Skipped (with a note) when no NATS answers; a failure under `CI=true`.

#![cfg(feature = "nats")]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use idem_mq::nats::{
    DELIVERIES_HEADER, DETAIL_HEADER, DeadLetterTarget, MSG_ID_HEADER, NatsDelivery, NatsSource,
    REASON_HEADER, SEQUENCE_HEADER, STREAM_HEADER, SUBJECT_HEADER, publish_once,
};
use idem_mq::{
    Consumer, DeadLetter, Delivery, Disposition, Failure, Horizon, Message, MqError, Reason, Source,
};
use idem_testkit::{PATIENCE, within};

fn nats_url() -> Option<String> {
    idem_testkit::services::NATS.url()
}

/// A stream `name` on `<name>.in`, and its dead-letter stream `<name>_DL` on `<name>.dead`;
/// both deleted when dropped.
struct Streams {
    url: String,
    name: String,
    js: jetstream::Context,
}

/// Creates a stream, trying again a few times: a 2.9 server that deletes an account's last
/// stream while another is created can fail the creation (its storage directory is removed
/// under it), and the tests create and delete streams in parallel.
async fn create_stream(js: &jetstream::Context, config: stream::Config) {
    let mut tries = 0;
    loop {
        match js.create_stream(config.clone()).await {
            Ok(_) => return,
            Err(e) if tries < 5 => {
                tries += 1;
                eprintln!("creating stream {} failed, trying again: {e}", config.name);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("create stream {}: {e}", config.name),
        }
    }
}

impl Streams {
    /// Publishes `body` on the stream's subject, once under `id`.
    async fn publish(&self, id: &str, body: Bytes) {
        publish_once(&self.js, self.subject(), id, body)
            .await
            .expect("publish");
    }

    /// Waits (a minute at most) until the durable consumer `durable` has nothing pending
    /// and nothing unacknowledged.
    async fn wait_settled(&self, durable: &str) {
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let info = self
                    .js
                    .get_stream(&self.name)
                    .await
                    .expect("stream")
                    .consumer_info(durable)
                    .await
                    .expect("info");
                if info.num_pending == 0 && info.num_ack_pending == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("every message settled");
    }

    async fn new(url: &str, configure: impl FnOnce(&mut stream::Config)) -> Self {
        let name = format!("IDEMT_{:016x}", rand::random::<u64>());
        let client = async_nats::connect(url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        let mut config = stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.in")],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        };
        configure(&mut config);
        create_stream(&js, config).await;
        create_stream(
            &js,
            stream::Config {
                name: format!("{name}_DL"),
                subjects: vec![format!("{name}.dead")],
                max_age: Duration::from_secs(3600),
                ..Default::default()
            },
        )
        .await;
        Self {
            url: url.to_owned(),
            name,
            js,
        }
    }

    fn subject(&self) -> String {
        format!("{}.in", self.name)
    }

    /// The dead-lettered copies stored so far, in order.
    async fn dead_letters(&self) -> Vec<jetstream::message::StreamMessage> {
        let dl = self
            .js
            .get_stream(format!("{}_DL", self.name))
            .await
            .expect("the dead-letter stream");
        let last = dl.get_info().await.expect("info").state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = dl.get_raw_message(seq).await {
                out.push(m);
            }
        }
        out
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        let url = self.url.clone();
        let names = [self.name.clone(), format!("{}_DL", self.name)];
        // Drop cannot await; a thread with its own runtime deletes the streams, even after a
        // failed assertion.
        idem_testkit::on_a_thread_of_its_own(async move {
            if let Ok(client) = async_nats::connect(url).await {
                let js = jetstream::new(client);
                for name in names {
                    let _ = js.delete_stream(name).await;
                }
            }
        });
    }
}

fn header<'a>(m: &'a jetstream::message::StreamMessage, name: &str) -> Option<&'a str> {
    m.headers.get(name).map(|v| v.as_str())
}

/// A `nats-server` of the test's own, on a free port, killed when dropped.
struct OwnServer {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
    /// Its `server_name`, which its greeting carries: a probe that reaches anything else on
    /// the port (a server another test started there, or the probe's own socket connected to
    /// itself, which Linux allows on a port of the ephemeral range) is not taken for it.
    name: String,
}

impl OwnServer {
    const BINARY: &'static str = "/usr/sbin/nats-server";

    fn start() -> Option<Self> {
        if !std::path::Path::new(Self::BINARY).exists() {
            eprintln!("server restart test skipped: no {}", Self::BINARY);
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let name = format!("idem-test-{:016x}", rand::random::<u64>());
        // A free port may be taken again before the server binds it; then it exits, and the
        // next try takes another.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .expect("a free port")
                .local_addr()
                .expect("addr")
                .port();
            let mut child = Self::spawn(port, dir.path(), &name);
            if Self::wait_up(&mut child, port, &name) {
                return Some(Self {
                    child,
                    port,
                    dir,
                    name,
                });
            }
        }
        panic!("nats-server did not start on any of five free ports");
    }

    fn spawn(port: u16, dir: &std::path::Path, name: &str) -> std::process::Child {
        std::process::Command::new(Self::BINARY)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-n",
                name,
                "-sd",
            ])
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server")
    }

    /// Waits until `child` greets a connection to `port` as the server `name`: true, or false
    /// when it exited (its port was taken). Past [`PATIENCE`] it is killed and the test fails.
    fn wait_up(child: &mut std::process::Child, port: u16, name: &str) -> bool {
        let deadline = std::time::Instant::now() + PATIENCE;
        while !Self::greets(port, name) {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if std::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("nats-server did not start");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }

    /// Whether a connection to `port` is greeted by the server `name`: its first line is that
    /// server's `INFO`.
    fn greets(port: u16, name: &str) -> bool {
        use std::io::BufRead;
        let Ok(stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let mut line = String::new();
        let read = std::io::BufReader::new(stream).read_line(&mut line);
        read.is_ok()
            && line.starts_with("INFO ")
            && line.contains(&format!("\"server_name\":\"{name}\""))
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::spawn(self.port, self.dir.path(), &self.name);
        assert!(
            Self::wait_up(&mut self.child, self.port, &self.name),
            "nats-server did not start again on its port"
        );
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Everything settled: nothing left for the consumer `name`, nothing waiting for an ack.
async fn assert_all_settled(streams: &Streams, name: &str) {
    let info = streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .consumer_info(name)
        .await
        .expect("consumer info");
    assert_eq!(info.num_pending, 0, "messages left unread");
    assert_eq!(info.num_ack_pending, 0, "messages left unsettled");
}

#[path = "../common/runs.rs"]
mod runs;
use runs::*;

mod adapter;
mod consumer;
#[cfg(feature = "postgres")]
#[path = "../common/killed.rs"]
mod harness;
#[cfg(feature = "postgres")]
mod killed;
