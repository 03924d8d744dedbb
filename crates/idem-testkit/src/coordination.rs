//! Coordination servers of a test's own, on free loopback ports: ZooKeeper and etcd, one
//! server or three whose members can be killed and started again.
//!
//! ZooKeeper runs from Debian's `zookeeper` package (`java` with the jars in
//! `/usr/share/java`; `IDEM_ZOOKEEPER_CLASSPATH` points elsewhere), etcd from `etcd-server`
//! (`etcd` on the `PATH`). Without them a suite is skipped with a note, or fails under
//! `CI=true`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::services::{Supervised, cannot_run, free_port, wait_for, which};

/// One member of an ensemble.
struct Member {
    dir: PathBuf,
    client_port: u16,
    command: Vec<String>,
    running: Option<Supervised>,
}

impl Member {
    fn spawn(&mut self, what: &str, ready: impl FnMut() -> bool) -> std::io::Result<()> {
        let running = Supervised::spawn(&self.command, &self.dir, None)?;
        let result = wait_for(what, Some(&running), &self.dir, ready);
        self.running = Some(running);
        result
    }

    fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            running.kill();
        }
    }

    fn signal(&self, signal: &str) {
        if let Some(running) = &self.running {
            running.signal(signal);
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A ZooKeeper server, or an ensemble of three, of the test's own.
pub struct ZooKeeper {
    members: Vec<Member>,
    _dir: tempfile::TempDir,
}

/// The four-letter command `cmd` sent to `port`, and what came back.
fn four_letters(port: u16, cmd: &str) -> String {
    let Ok(mut stream) = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    ) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.write_all(cmd.as_bytes());
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out
}

impl ZooKeeper {
    /// One server (standalone), or `None` (with a note; a panic under `CI=true`) if ZooKeeper
    /// cannot be run here.
    pub fn start() -> Option<Self> {
        Self::launch(1)
    }

    /// An ensemble of three servers, or `None` as [`start`](Self::start).
    pub fn start_ensemble() -> Option<Self> {
        Self::launch(3)
    }

    fn classpath() -> String {
        std::env::var("IDEM_ZOOKEEPER_CLASSPATH")
            .unwrap_or_else(|_| "/usr/share/java/*:/etc/zookeeper/conf".to_owned())
    }

    fn launch(size: usize) -> Option<Self> {
        let installed = Path::new("/usr/share/java/zookeeper.jar").is_file()
            || std::env::var_os("IDEM_ZOOKEEPER_CLASSPATH").is_some();
        let found = which("java").and_then(|()| {
            if installed {
                Ok(())
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "there is no /usr/share/java/zookeeper.jar (apt-get install zookeeper, or set IDEM_ZOOKEEPER_CLASSPATH)",
                ))
            }
        });
        if let Err(e) = found {
            cannot_run("ZooKeeper", &e);
            return None;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let peers: Vec<(u16, u16, u16)> = (0..size)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let mut members = Vec::new();
        for (i, (client, _, _)) in peers.iter().enumerate() {
            let member_dir = dir.path().join(format!("zk{}", i + 1));
            std::fs::create_dir_all(member_dir.join("data")).expect("a member directory");
            // A short tick, so that sessions may be as short as 200 ms; the sessions asked
            // for are allowed up to a minute.
            let mut config = format!(
                "tickTime=100\nminSessionTimeout=200\nmaxSessionTimeout=60000\ninitLimit=100\n\
                 syncLimit=50\ndataDir={}\nclientPort={client}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr\n",
                member_dir.join("data").display()
            );
            if size > 1 {
                for (j, (_, q, e)) in peers.iter().enumerate() {
                    config.push_str(&format!("server.{}=127.0.0.1:{q}:{e}\n", j + 1));
                }
                std::fs::write(member_dir.join("data/myid"), format!("{}\n", i + 1)).expect("myid");
            }
            std::fs::write(member_dir.join("zoo.cfg"), config).expect("zoo.cfg");
            members.push(Member {
                command: [
                    "java",
                    "-Xmx256m",
                    // Empty lock nodes (containers) are reaped within 100 ms, not a minute.
                    "-Dznode.container.checkIntervalMs=100",
                    "-cp",
                    &Self::classpath(),
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                    "zoo.cfg",
                ]
                .map(String::from)
                .into(),
                dir: member_dir,
                client_port: *client,
                running: None,
            });
        }
        let mut zk = Self { members, _dir: dir };
        for i in 0..size {
            // Members of an ensemble are started together: one alone never serves.
            let member = &mut zk.members[i];
            match Supervised::spawn(&member.command, &member.dir, None) {
                Ok(running) => member.running = Some(running),
                Err(e) => {
                    cannot_run("ZooKeeper", &e);
                    return None;
                }
            }
        }
        for i in 0..size {
            if let Err(e) = zk.wait_serving(i) {
                cannot_run("ZooKeeper", &e);
                return None;
            }
        }
        Some(zk)
    }

    fn wait_serving(&self, i: usize) -> std::io::Result<()> {
        let member = &self.members[i];
        let port = member.client_port;
        wait_for("ZooKeeper", member.running.as_ref(), &member.dir, || {
            four_letters(port, "srvr").contains("Mode: ")
        })
    }

    /// The connection string of every member: `127.0.0.1:P1,127.0.0.1:P2,…`.
    pub fn hosts(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A `zk://` URL for every member, with `path` as its root (`/idem`, say).
    pub fn url(&self, path: &str) -> String {
        format!("zk://{}{path}", self.hosts())
    }

    /// The member that leads the ensemble now (`0` for a single server), if one does.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.running.is_some() && {
                let out = four_letters(m.client_port, "srvr");
                out.contains("Mode: leader") || out.contains("Mode: standalone")
            }
        })
    }

    /// Kills member `i` (SIGKILL), keeping its data.
    pub fn kill(&mut self, i: usize) {
        self.members[i].stop();
    }

    /// Stops member `i` (SIGSTOP): its connections stay open and nothing is answered, as
    /// with a member cut off by the network, until [`resume`](Self::resume).
    pub fn pause(&self, i: usize) {
        self.members[i].signal("STOP");
    }

    /// Lets member `i` run again after [`pause`](Self::pause).
    pub fn resume(&self, i: usize) {
        self.members[i].signal("CONT");
    }

    /// Starts member `i` again on its port with its data, and waits until it serves.
    pub fn restart(&mut self, i: usize) {
        self.members[i].stop();
        let port = self.members[i].client_port;
        self.members[i]
            .spawn("ZooKeeper", || {
                four_letters(port, "srvr").contains("Mode: ")
            })
            .expect("restart the ZooKeeper member");
    }
}

/// An HTTP request to etcd's JSON gateway at `port` (`GET path`, or `POST path` with `body`),
/// and the body that came back (empty if none).
fn etcd_http(port: u16, path: &str, body: Option<&str>) -> String {
    let Ok(mut stream) = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    ) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = match body {
        Some(body) => format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
        None => format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    };
    let _ = stream.write_all(request.as_bytes());
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

/// An etcd server, or a cluster of three, of the test's own: elections within about half a
/// second (heartbeats every 50 ms), so a test that kills the leader goes on quickly.
pub struct Etcd {
    members: Vec<Member>,
    _dir: tempfile::TempDir,
}

impl Etcd {
    /// One server, or `None` (with a note; a panic under `CI=true`) if etcd cannot be run
    /// here.
    pub fn start() -> Option<Self> {
        Self::launch(1)
    }

    /// A cluster of three members, or `None` as [`start`](Self::start).
    pub fn start_cluster() -> Option<Self> {
        Self::launch(3)
    }

    fn launch(size: usize) -> Option<Self> {
        if let Err(e) = which("etcd") {
            cannot_run("etcd", &e);
            return None;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ports: Vec<(u16, u16)> = (0..size).map(|_| (free_port(), free_port())).collect();
        let cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("e{}=http://127.0.0.1:{peer}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let member_dir = dir.path().join(format!("etcd{}", i + 1));
            std::fs::create_dir_all(&member_dir).expect("a member directory");
            let client_url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let command: Vec<String> = [
                "etcd",
                "--name",
                &format!("e{}", i + 1),
                "--data-dir",
                "data",
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &cluster,
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                "--logger",
                "zap",
            ]
            .map(String::from)
            .into();
            members.push(Member {
                command,
                dir: member_dir,
                client_port: *client,
                running: None,
            });
        }
        let mut etcd = Self { members, _dir: dir };
        for member in &mut etcd.members {
            // Members of a cluster are started together: one alone never serves.
            match Supervised::spawn(&member.command, &member.dir, None) {
                Ok(running) => member.running = Some(running),
                Err(e) => {
                    cannot_run("etcd", &e);
                    return None;
                }
            }
        }
        for i in 0..size {
            if let Err(e) = etcd.wait_serving(i) {
                cannot_run("etcd", &e);
                return None;
            }
        }
        Some(etcd)
    }

    fn wait_serving(&self, i: usize) -> std::io::Result<()> {
        let member = &self.members[i];
        let port = member.client_port;
        wait_for("etcd", member.running.as_ref(), &member.dir, || {
            etcd_http(port, "/health", None).contains("\"true\"")
        })
    }

    /// Every member's client address: `127.0.0.1:P1,127.0.0.1:P2,…`.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// An `etcd://` URL for every member, with `prefix` as its key prefix (`/idem`, say).
    pub fn url(&self, prefix: &str) -> String {
        format!("etcd://{}{prefix}", self.endpoints())
    }

    /// The member that leads the cluster now, if a running one says it does.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.running.is_some() && {
                let status = etcd_http(m.client_port, "/v3/maintenance/status", Some("{}"));
                let field = |name: &str| {
                    let at = status.find(&format!("\"{name}\":\""))? + name.len() + 4;
                    let rest = &status[at..];
                    Some(rest[..rest.find('"')?].to_owned())
                };
                matches!((field("member_id"), field("leader")), (Some(a), Some(b)) if a == b)
            }
        })
    }

    /// Revokes every lease the cluster has (as if every client's session had run out), and
    /// says how many there were.
    pub fn revoke_leases(&self) -> usize {
        let Some(port) = self
            .members
            .iter()
            .find(|m| m.running.is_some())
            .map(|m| m.client_port)
        else {
            return 0;
        };
        let leases = etcd_http(port, "/v3/lease/leases", Some("{}"));
        let ids: Vec<&str> = leases
            .split("\"ID\":\"")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .collect();
        for id in &ids {
            etcd_http(
                port,
                "/v3/lease/revoke",
                Some(&format!("{{\"ID\":\"{id}\"}}")),
            );
        }
        ids.len()
    }

    /// Kills member `i` (SIGKILL), keeping its data.
    pub fn kill(&mut self, i: usize) {
        self.members[i].stop();
    }

    /// Stops member `i` (SIGSTOP): its connections stay open and nothing is answered, as
    /// with a member cut off by the network, until [`resume`](Self::resume).
    pub fn pause(&self, i: usize) {
        self.members[i].signal("STOP");
    }

    /// Lets member `i` run again after [`pause`](Self::pause).
    pub fn resume(&self, i: usize) {
        self.members[i].signal("CONT");
    }

    /// Starts member `i` again on its ports with its data, and waits until it serves.
    pub fn restart(&mut self, i: usize) {
        self.members[i].stop();
        let port = self.members[i].client_port;
        self.members[i]
            .spawn("etcd", || {
                etcd_http(port, "/health", None).contains("\"true\"")
            })
            .expect("restart the etcd member");
    }
}
