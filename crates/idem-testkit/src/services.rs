//! The real servers backend suites run against, and what to do when one is missing.
//!
//! Each service has a loopback default and an environment variable to point elsewhere
//! (`IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL`). When the server
//! cannot be reached, a suite is skipped with a note on standard error saying why, unless
//! `CI=true`: there a missing service fails the test.

use std::collections::HashSet;
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

/// A server the tests use.
#[derive(Debug, Clone, Copy)]
pub struct Service {
    /// Its name in messages.
    pub name: &'static str,
    /// The variable that overrides its URL.
    pub env: &'static str,
    /// Its URL on the project's machines.
    pub default_url: &'static str,
}

/// PostgreSQL, database `test`.
pub const POSTGRES: Service = Service {
    name: "PostgreSQL",
    env: "IDEM_TEST_POSTGRES_URL",
    default_url: "postgres://postgres@127.0.0.1:5432/test",
};

/// MariaDB or MySQL, database `test`.
pub const MYSQL: Service = Service {
    name: "MySQL/MariaDB",
    env: "IDEM_TEST_MYSQL_URL",
    default_url: "mysql://root@127.0.0.1:3306/test",
};

/// Redis.
pub const REDIS: Service = Service {
    name: "Redis",
    env: "IDEM_TEST_REDIS_URL",
    default_url: "redis://127.0.0.1:6379",
};

impl Service {
    /// The URL to test against, or `None` (with a note on standard error, once per process)
    /// if nothing answers there. Panics under `CI=true` if nothing answers.
    pub fn url(&self) -> Option<String> {
        let url = std::env::var(self.env).unwrap_or_else(|_| self.default_url.to_owned());
        let addr = authority(&url);
        let reachable = addr.to_socket_addrs().ok().and_then(|mut addrs| {
            addrs.find(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).is_ok())
        });
        if reachable.is_some() {
            return Some(url);
        }
        let why = format!(
            "{} tests skipped: nothing answers at {addr} (start the server, or set {} to its URL)",
            self.name, self.env
        );
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{why}; under CI=true a missing service is a failure");
        }
        note_once(&why);
        None
    }
}

/// `host:port` of a URL such as `postgres://user:pw@host:5432/db?x=y`.
fn authority(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let rest = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = rest.rsplit_once('@').map_or(rest, |(_, hp)| hp);
    if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        return host_port.to_owned();
    }
    let port = match scheme {
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        _ => 6379,
    };
    format!("{host_port}:{port}")
}

/// Writes `note` to standard error once per process, past the test harness's capture (which
/// only takes `print!`/`eprint!`), so a skipped suite is visible in a normal `cargo test`.
fn note_once(note: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen
        .get_or_insert_with(HashSet::new)
        .insert(note.to_owned())
    {
        let _ = writeln!(std::io::stderr(), "note: {note}");
    }
}

/// A `redis-server` of the test's own on a free loopback port, for tests that stop and start
/// their server or need cluster mode. It stops when dropped, and also when the test process
/// ends in any way (a watchdog shell kills it once the process's end of a pipe closes), so a
/// panicking test or a shared server in a `static` leaves nothing running.
pub struct RedisServer {
    port: u16,
    cluster: bool,
    dir: tempfile::TempDir,
    running: Option<Running>,
}

struct Running {
    watchdog: std::process::Child,
    pid: String,
}

impl RedisServer {
    /// A plain server, or `None` (with a note; a panic under `CI=true`) if `redis-server`
    /// cannot be run.
    pub fn start() -> Option<Self> {
        Self::launch(false)
    }

    /// A single-node Redis Cluster owning all 16384 slots.
    pub fn start_cluster() -> Option<Self> {
        Self::launch(true)
    }

    /// One single-node Cluster shared by every test of the process (a cluster takes a couple
    /// of seconds to come up).
    pub fn shared_cluster() -> Option<&'static Self> {
        static CLUSTER: std::sync::OnceLock<Option<RedisServer>> = std::sync::OnceLock::new();
        CLUSTER.get_or_init(Self::start_cluster).as_ref()
    }

    fn launch(cluster: bool) -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let mut server = Self {
            port,
            cluster,
            dir: tempfile::tempdir().expect("a temporary directory"),
            running: None,
        };
        if let Err(e) = server.spawn() {
            let why = format!(
                "Redis tests that run their own server skipped: cannot run redis-server ({e})"
            );
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{why}; under CI=true a missing service is a failure");
            }
            note_once(&why);
            return None;
        }
        Some(server)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        which("redis-server")?;
        let mut args = vec![
            "--bind".to_owned(),
            "127.0.0.1".into(),
            "--port".into(),
            self.port.to_string(),
            "--save".into(),
            String::new(),
            "--appendonly".into(),
            "no".into(),
        ];
        if self.cluster {
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ]
                .map(String::from),
            );
        }
        // The shell starts the server, prints its pid, and kills it when our end of its
        // standard input closes: when this process ends, however it ends.
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg("redis-server \"$@\" >/dev/null 2>&1 & echo $!; read _; kill -9 $! 2>/dev/null")
            .arg("sh")
            .args(&args)
            .current_dir(self.dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut pid = String::new();
        if let Some(out) = watchdog.stdout.take() {
            std::io::BufReader::new(out).read_line(&mut pid)?;
        }
        self.running = Some(Running {
            watchdog,
            pid: pid.trim().to_owned(),
        });
        self.wait_until("PONG", &["PING"]);
        if self.cluster {
            self.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
            self.wait_until("cluster_state:ok", &["CLUSTER", "INFO"]);
        }
        Ok(())
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the server as a crash would (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut running) = self.running.take() {
            let _ = std::process::Command::new("kill")
                .args(["-9", &running.pid])
                .status();
            drop(running.watchdog.stdin.take());
            let _ = running.watchdog.wait();
        }
    }

    /// Starts it again on the same port, empty (it keeps nothing on disk).
    pub fn restart(&mut self) {
        self.stop();
        // A cluster node must forget its old configuration to take the slots again.
        let _ = std::fs::remove_file(self.dir.path().join("nodes.conf"));
        self.spawn().expect("restart redis-server");
    }

    fn cli(&self, args: &[&str]) -> String {
        std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    fn wait_until(&self, expected: &str, args: &[&str]) {
        for _ in 0..400 {
            if self.cli(args).contains(expected) {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "redis-server on port {} never answered {expected}",
            self.port
        );
    }
}

/// Whether `program` is on the `PATH`.
fn which(program: &str) -> std::io::Result<()> {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()));
    if found {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{program} is not on the PATH"),
        ))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        assert_eq!(authority("postgres://u:p@db:6000/x?y=1"), "db:6000");
        assert_eq!(
            authority("postgres://postgres@127.0.0.1/test"),
            "127.0.0.1:5432"
        );
        assert_eq!(authority("mysql://root@localhost/test"), "localhost:3306");
        assert_eq!(authority("redis://127.0.0.1"), "127.0.0.1:6379");
    }
}
