//! `idem gateway` or `idem serve` processes on one store, each on an address of its own that
//! it keeps across restarts; where the store is reached over the network, each through a proxy
//! of its own (delays, stalls, cuts) and, where the machine allows, from a network namespace of
//! its own (partitions).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idem_testkit::coordination::{Etcd, ZooKeeper};
use idem_testkit::services::{RedisServer, SqlKind, SqlServer};

use crate::ledger::Ledger;
use crate::netns::Netns;
use crate::proxy::{Mode, Proxy};

/// The lease of every guarded request (`lease` in the gateways' file, `lease_ms` in the API
/// clients' begins).
pub(crate) const LEASE: Duration = Duration::from_secs(2);

/// The gateways' budget for answers their store has not taken (`--unstored-answers-bytes`):
/// the least there is, so that a burst of large answers overflows it.
pub(crate) const UNSTORED_BUDGET: usize = 1 << 20;

/// libfaketime, which steps a process's wall clock: `IDEM_FAKETIME`, or where Debian's
/// `faketime` package puts it.
fn faketime() -> String {
    std::env::var("IDEM_FAKETIME")
        .unwrap_or_else(|_| "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1".to_owned())
}

/// Whether an instance's wall clock can be stepped here (libfaketime is installed).
pub(crate) fn can_step_clocks() -> bool {
    std::path::Path::new(&faketime()).exists()
}

/// Makes the process `cmd` starts see its wall clock `ahead` of the others' (libfaketime);
/// its monotonic clock, which times its own waits, is left alone.
pub(crate) fn step_clock(cmd: &mut Command, ahead: Duration) {
    cmd.env("LD_PRELOAD", faketime())
        .env("FAKETIME", format!("+{}s", ahead.as_secs()))
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid`.
pub(crate) fn signal(signal: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {signal} {pid}");
}

/// The store the instances share.
pub(crate) enum Store {
    /// A SQLite file: no network between the instances and their store.
    File(String),
    /// A Redis (or, named `valkey`, a Valkey 9, whose records settle by plain `SET … IFEQ`)
    /// of the run's own, which the nemesis may crash and restart.
    OwnRedis(RedisServer, &'static str),
    /// A PostgreSQL or MariaDB of the run's own, the same.
    OwnSql(SqlServer),
    /// A ZooKeeper of the run's own for the locks (`--locks`), the records in each
    /// instance's memory; the nemesis may crash and restart it.
    OwnZooKeeper(ZooKeeper),
    /// An etcd of the run's own for the locks, the same.
    OwnEtcd(Etcd),
    /// A server shared with others (`IDEM_FAULTS_STORE`): never restarted.
    Shared(String),
}

impl Store {
    /// `sqlite` for a file in `dir`; `own-postgres`, `own-mariadb`, `own-valkey` or
    /// `own-zookeeper` or `own-etcd` (locks only) for a server of the run's own; a URL for a server of someone else's; or (empty) a durable
    /// Redis of the run's own if `redis-server` runs here, else a file. A server that cannot
    /// be run here is a note, and a failure under `CI=true`.
    pub(crate) fn named(chosen: &str, dir: &std::path::Path) -> Self {
        let file = || Self::File(format!("sqlite://{}", dir.join("idem.db").display()));
        let sql = |kind| SqlServer::start(kind).map_or_else(file, Self::OwnSql);
        let redis = |server: Option<RedisServer>, name| {
            server.map_or_else(file, |server| Self::OwnRedis(server, name))
        };
        match chosen {
            "" => redis(RedisServer::start_durable(), "redis"),
            "own-valkey" => redis(RedisServer::start_valkey_durable(), "valkey"),
            "sqlite" => file(),
            "own-postgres" => sql(SqlKind::Postgres),
            "own-mariadb" => sql(SqlKind::MariaDb),
            "own-zookeeper" => ZooKeeper::start().map_or_else(file, Self::OwnZooKeeper),
            "own-etcd" => Etcd::start().map_or_else(file, Self::OwnEtcd),
            url => Self::Shared(url.to_owned()),
        }
    }

    /// Whether the store is the run's own, which the nemesis may restart.
    pub(crate) fn own(&self) -> bool {
        matches!(
            self,
            Self::OwnRedis(..) | Self::OwnSql(_) | Self::OwnZooKeeper(_) | Self::OwnEtcd(_)
        )
    }

    pub(crate) fn url(&self) -> String {
        match self {
            Self::File(url) | Self::Shared(url) => url.clone(),
            Self::OwnRedis(server, _) => server.url(),
            Self::OwnSql(server) => server.url(),
            Self::OwnZooKeeper(zk) => zk.url("/idem-faults"),
            Self::OwnEtcd(etcd) => etcd.url("/idem-faults"),
        }
    }

    /// What kind of store it is: `redis`, `valkey`, or the URL's scheme.
    pub(crate) fn kind(&self) -> String {
        match self {
            Self::OwnRedis(_, name) => (*name).to_owned(),
            _ => self
                .url()
                .split("://")
                .next()
                .unwrap_or_default()
                .to_owned(),
        }
    }

    pub(crate) fn describe(&self) -> String {
        let scheme = self.kind();
        if self.own() {
            format!("{scheme} of the run's own")
        } else {
            scheme
        }
    }

    /// Crashes the store (SIGKILL) and starts it again after `down`; false if it is not the
    /// run's own.
    pub(crate) fn crash_and_restart(&mut self, down: Duration) -> bool {
        match self {
            Self::OwnRedis(server, _) => {
                server.stop();
                std::thread::sleep(down);
                server.restart();
            }
            Self::OwnSql(server) => {
                server.stop();
                std::thread::sleep(down);
                server.restart();
            }
            Self::OwnZooKeeper(zk) => {
                zk.kill(0);
                std::thread::sleep(down);
                zk.restart(0);
            }
            Self::OwnEtcd(etcd) => {
                etcd.kill(0);
                std::thread::sleep(down);
                etcd.restart(0);
            }
            _ => return false,
        }
        true
    }
}

/// The `host:port` a store URL names (its default port if it names none), and the URL with
/// them replaced by `to`; `None` for a store reached without a network.
fn reroute(url: &str, to: impl FnOnce(&str) -> String) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let default = match scheme {
        "redis" => 6379,
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        "zk" => 2181,
        "etcd" => 2379,
        _ => return None,
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, host) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let target = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{default}")
    };
    Some(format!("{scheme}://{userinfo}{}{tail}", to(&target)))
}

/// `url` reached through a proxy of its own on loopback, which the nemesis controls; `url`
/// itself, and no proxy, for a store reached without a network.
pub(crate) fn behind_proxy(url: &str) -> (String, Option<Proxy>) {
    let mut proxy = None;
    let rerouted = reroute(url, |target| {
        let p = Proxy::start("127.0.0.1", target);
        let addr = p.addr.clone();
        proxy = Some(p);
        addr
    });
    (rerouted.unwrap_or_else(|| url.to_owned()), proxy)
}

/// What the instances are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// `idem gateway` in front of the ledger: the clients send it their payments.
    Gateway,
    /// `idem serve`: the clients claim keys from it, write to the ledger themselves and store
    /// the answer.
    Serve,
}

/// One instance: where it listens, and what stands between it and its store.
struct Instance {
    addr: String,
    store: String,
    upstream: String,
    proxy: Option<Proxy>,
    netns: Option<Netns>,
    child: Option<Child>,
}

pub(crate) struct Cluster {
    role: Role,
    instances: Vec<Instance>,
    config: String,
    pub(crate) store: Store,
    /// Why the instances run without namespaces, if they do.
    pub(crate) no_netns: Option<String>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// `n` instances (gateways in front of `ledger`, or API servers), on the store `chosen`
    /// names (see [`Store::named`]).
    pub(crate) fn start(role: Role, n: usize, ledger: &Ledger, chosen: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::named(chosen, dir.path());
        let config = dir.path().join("gateway.toml");
        std::fs::write(
            &config,
            format!(
                "upstream_timeout = \"1s\"\nstore_timeout = \"1s\"\n[defaults]\n\
                 anonymous = \"shared\"\nlease = \"{}s\"\n",
                LEASE.as_secs()
            ),
        )
        .unwrap();
        let url = store.url();
        let networked = reroute(&url, str::to_owned).is_some();
        let mut no_netns = (!networked).then(|| "the store is a file".to_owned());
        let mut instances = Vec::new();
        for _ in 0..n {
            let netns = if no_netns.is_none() {
                Netns::create()
                    .map_err(|e| no_netns = Some(format!("no network namespace here ({e})")))
                    .ok()
            } else {
                None
            };
            let (outside, inside) = netns.as_ref().map_or(("127.0.0.1", "127.0.0.1"), |ns| {
                (ns.store.as_str(), ns.inside.as_str())
            });
            let mut proxy = None;
            let store = reroute(&url, |target| {
                let p = Proxy::start(outside, target);
                let addr = p.addr.clone();
                proxy = Some(p);
                addr
            })
            .unwrap_or_else(|| url.clone());
            // Nothing else listens in a namespace of the run's own.
            let port = if netns.is_some() {
                8080
            } else {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            };
            let upstream = ledger.listen(netns.as_ref().map_or("127.0.0.1", |ns| &ns.outside));
            instances.push(Instance {
                addr: format!("{inside}:{port}"),
                store,
                upstream,
                proxy,
                netns,
                child: None,
            });
        }
        let mut cluster = Self {
            role,
            instances,
            config: config.display().to_string(),
            store,
            no_netns,
            _dir: dir,
        };
        for i in 0..n {
            cluster.spawn(i, None);
        }
        cluster
    }

    /// Instance `i`, its wall clock `ahead` of the others' if given (its monotonic clock, which
    /// times its own waits, is left alone).
    fn spawn(&mut self, i: usize, ahead: Option<Duration>) {
        let g = &self.instances[i];
        let program = env!("CARGO_BIN_EXE_idem");
        let mut cmd = g
            .netns
            .as_ref()
            .map_or_else(|| Command::new(program), |ns| ns.command(program));
        match self.role {
            Role::Gateway => cmd
                .args(["gateway", "--upstream", &format!("http://{}", g.upstream)])
                .args(["--config", &self.config])
                .args(["--unstored-answers-bytes", &UNSTORED_BUDGET.to_string()]),
            // Its clients give the lease in every begin; every caller shares one scope.
            Role::Serve => cmd.args(["serve", "--allow-anonymous"]),
        };
        // A lock store (ZooKeeper, etcd) holds no records: each instance keeps its own in
        // memory.
        if g.store.starts_with("zk://") || g.store.starts_with("etcd://") {
            cmd.args(["--store", "memory://", "--locks", &g.store]);
        } else {
            cmd.args(["--store", &g.store]);
        }
        cmd.args(["--listen", &g.addr])
            .env_remove("IDEM_STORE")
            .env("IDEM_LOG", "info")
            .stderr(Stdio::piped());
        if let Some(ahead) = ahead {
            step_clock(&mut cmd, ahead);
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("the instance started").unwrap();
            if line.contains("listening on http://") {
                break;
            }
        }
        // Drained, so an instance never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        self.instances[i].child = Some(child);
    }

    pub(crate) fn addrs(&self) -> Vec<String> {
        self.instances.iter().map(|g| g.addr.clone()).collect()
    }

    pub(crate) fn pid(&self, i: usize) -> u32 {
        self.instances[i].child.as_ref().unwrap().id()
    }

    /// Whether the nemesis can come between the instances and their store: the proxies.
    pub(crate) fn has_proxies(&self) -> bool {
        self.instances.iter().all(|g| g.proxy.is_some())
    }

    pub(crate) fn proxy(&self, i: usize) -> &Proxy {
        self.instances[i].proxy.as_ref().unwrap()
    }

    /// Cuts instance `i` off from its store for `how_long`, its clients still reaching it.
    pub(crate) fn partition(&self, i: usize, how_long: Duration) {
        let ns = self.instances[i].netns.as_ref().unwrap();
        ns.partition();
        std::thread::sleep(how_long);
        ns.heal();
    }

    /// The store holds every byte of instance `i` for `how_long`.
    pub(crate) fn stall(&self, i: usize, how_long: Duration) {
        self.proxy(i).set(Mode::Hold);
        std::thread::sleep(how_long);
        self.proxy(i).set(Mode::Pass);
    }

    /// SIGKILL, then the same instance again on the same address, its wall clock `ahead` of
    /// the others' if given.
    pub(crate) fn kill_and_restart(&mut self, i: usize, ahead: Option<Duration>) {
        if let Some(mut child) = self.instances[i].child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        self.spawn(i, ahead);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for g in &mut self.instances {
            if let Some(mut child) = g.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}
