//! A Kafka-protocol broker of the test's own, on a free loopback port: Tansu, a broker written
//! in Rust that installs from crates.io (Apache Kafka's own distribution is not reachable
//! everywhere tests run).
//!
//! The binary is `$IDEM_TANSU`, else `tansu` on the `PATH`, else
//! `~/.cache/idem/tansu/bin/tansu` (where `.ci/run` installs it:
//! `cargo install tansu --locked --features dynostore --root ~/.cache/idem/tansu`). Without it a
//! suite is skipped with a note, or fails under `CI=true`.
//!
//! Records live in the broker's memory (it cannot be restarted with them). Tansu cannot serve a fetch that
//! starts inside a stored batch, so tests produce one record per batch (`linger.ms` 0, one
//! send at a time, or `batch.size` 1), as [`Tansu::producer_config`] says.

use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::services::{Supervised, cannot_run, free_port, on_path, wait_for};

/// A Tansu broker of the test's own.
pub struct Tansu {
    port: u16,
    dir: tempfile::TempDir,
    command: Vec<String>,
    running: Option<Supervised>,
}

/// Where the broker's binary is, if anywhere.
fn binary() -> std::io::Result<PathBuf> {
    if let Some(path) = std::env::var_os("IDEM_TANSU") {
        return Ok(PathBuf::from(path));
    }
    if let Some(path) = on_path("tansu") {
        return Ok(path);
    }
    let cached = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default()
        .join(".cache/idem/tansu/bin/tansu");
    if cached.is_file() {
        return Ok(cached);
    }
    Err(std::io::Error::other(
        "no tansu binary (cargo install tansu --locked --features dynostore --root \
         ~/.cache/idem/tansu, or set IDEM_TANSU)",
    ))
}

impl Tansu {
    /// A broker, or `None` (with a note; a panic under `CI=true`) if Tansu cannot be run here.
    pub fn start() -> Option<Self> {
        let program = match binary() {
            Ok(p) => p,
            Err(e) => {
                cannot_run("Kafka-protocol broker (Tansu)", &e);
                return None;
            }
        };
        let dir = tempfile::tempdir().expect("a temporary directory");
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let command: Vec<String> = [
            program.display().to_string().as_str(),
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            "memory://tansu/",
        ]
        .map(String::from)
        .into();
        let mut broker = Self {
            port,
            dir,
            command,
            running: None,
        };
        if let Err(e) = broker.spawn() {
            cannot_run("Kafka-protocol broker (Tansu)", &e);
            return None;
        }
        Some(broker)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let running = Supervised::spawn(&self.command, self.dir.path(), None)?;
        let port = self.port;
        let result = wait_for("tansu", Some(&running), self.dir.path(), || {
            TcpStream::connect_timeout(
                &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_millis(200),
            )
            .is_ok()
        });
        self.running = Some(running);
        result
    }

    /// The bootstrap address: `127.0.0.1:P`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// What a producer needs here, as librdkafka properties: one record per batch (the broker
    /// cannot resume a fetch inside a batch), and no idempotent producer.
    pub fn producer_config() -> [(&'static str, &'static str); 3] {
        [
            ("linger.ms", "0"),
            ("batch.num.messages", "1"),
            ("enable.idempotence", "false"),
        ]
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.kill();
        }
    }
}
