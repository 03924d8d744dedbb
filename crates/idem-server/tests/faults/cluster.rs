//! Gateway processes on one store, each on a port of its own that it keeps across restarts.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The lease of every guarded request (`lease` in the gateways' file).
pub(crate) const LEASE: Duration = Duration::from_secs(2);

/// libfaketime, which steps a process's wall clock (Debian's `faketime` package).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Whether a gateway's wall clock can be stepped here (libfaketime is installed).
pub(crate) fn can_step_clocks() -> bool {
    std::path::Path::new(FAKETIME).exists()
}

pub(crate) struct Cluster {
    gateways: Vec<(String, Child)>,
    args: Vec<String>,
    _dir: tempfile::TempDir,
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid`.
pub(crate) fn signal(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {signal} {pid}");
}

impl Cluster {
    /// `n` gateways in front of `upstream`, on the store `IDEM_FAULTS_STORE` names (a SQLite
    /// file of their own by default).
    pub(crate) fn start(n: usize, upstream: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = std::env::var("IDEM_FAULTS_STORE")
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("idem.db").display()));
        let config = dir.path().join("gateway.toml");
        std::fs::write(
            &config,
            format!(
                "upstream_timeout = \"1s\"\n[defaults]\nanonymous = \"shared\"\nlease = \"{}s\"\n",
                LEASE.as_secs()
            ),
        )
        .unwrap();
        let args = vec![
            "gateway".to_owned(),
            "--upstream".to_owned(),
            format!("http://{upstream}"),
            "--store".to_owned(),
            store,
            "--config".to_owned(),
            config.display().to_string(),
        ];
        let mut cluster = Self {
            gateways: Vec::new(),
            args,
            _dir: dir,
        };
        for _ in 0..n {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr = format!("127.0.0.1:{port}");
            let child = cluster.spawn(&addr, None);
            cluster.gateways.push((addr, child));
        }
        cluster
    }

    /// A gateway on `addr`, its wall clock `ahead` of the others' if given (its monotonic
    /// clock, which times its own waits, is left alone).
    fn spawn(&self, addr: &str, ahead: Option<Duration>) -> Child {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(&self.args)
            .args(["--listen", addr])
            .env_remove("IDEM_STORE")
            .env("IDEM_LOG", "info")
            .stderr(Stdio::piped());
        if let Some(ahead) = ahead {
            cmd.env("LD_PRELOAD", FAKETIME)
                .env("FAKETIME", format!("+{}s", ahead.as_secs()))
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("the gateway started").unwrap();
            if line.contains("listening on http://") {
                break;
            }
        }
        // Drained, so a gateway never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        child
    }

    pub(crate) fn addrs(&self) -> Vec<String> {
        self.gateways.iter().map(|(a, _)| a.clone()).collect()
    }

    pub(crate) fn pid(&self, i: usize) -> u32 {
        self.gateways[i].1.id()
    }

    /// SIGKILL, then the same gateway again on the same port, its wall clock `ahead` of the
    /// others' if given.
    pub(crate) fn kill_and_restart(&mut self, i: usize, ahead: Option<Duration>) {
        let (addr, child) = &mut self.gateways[i];
        child.kill().unwrap();
        child.wait().unwrap();
        let addr = addr.clone();
        self.gateways[i].1 = self.spawn(&addr, ahead);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.gateways {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
