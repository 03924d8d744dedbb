//! A network namespace of the run's own for one gateway, joined to the harness by a veth pair,
//! so that the gateway can be cut off from its store while its clients still reach it.
//!
//! Inside, the gateway has `10.N.I.2`; outside, the clients and the ledger are reached at
//! `10.N.I.1` and the gateway's store proxy at `10.N.I.3`. A partition is a route inside the
//! namespace that makes `10.N.I.3` unreachable: packets of open connections go nowhere (the
//! store falls silent) and new connections are refused at once, as behind a router that lost
//! its way; the clients' and the upstream's traffic is untouched. Removing the route heals it,
//! and TCP sends again what was held. Needs root (`ip netns`); the namespace and the veth pair
//! go when this is dropped.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) struct Netns {
    name: String,
    route: String,
    /// The gateway's address, inside.
    pub(crate) inside: String,
    /// The clients' and the ledger's side.
    pub(crate) outside: String,
    /// Where the gateway's store proxy listens.
    pub(crate) store: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// A namespace of this process's own, or why it cannot be made here.
    pub(crate) fn create() -> Result<Self, String> {
        // Numbered across the process: the tests of one run make theirs at the same time.
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let i = MADE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // A second octet of this process's own, so that two runs at once do not share routes.
        let net = format!("10.{}.{i}", 100 + pid % 150);
        let (name, veth) = (format!("idemf{pid}g{i}"), format!("idf{pid}g{i}"));
        let ns = Self {
            route: format!("{net}.3/32"),
            inside: format!("{net}.2"),
            outside: format!("{net}.1"),
            store: format!("{net}.3"),
            name,
        };
        ip(&["netns", "add", &ns.name])?;
        let peer = format!("{veth}p");
        let made = ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer])
            .and_then(|()| ip(&["link", "set", &peer, "netns", &ns.name]))
            .and_then(|()| ip(&["addr", "add", &format!("{}/24", ns.outside), "dev", &veth]))
            .and_then(|()| ip(&["addr", "add", &format!("{}/24", ns.store), "dev", &veth]))
            .and_then(|()| ip(&["link", "set", &veth, "up"]))
            .and_then(|()| ns.exec(&["addr", "add", &format!("{}/24", ns.inside), "dev", &peer]))
            .and_then(|()| ns.exec(&["link", "set", &peer, "up"]))
            .and_then(|()| ns.exec(&["link", "set", "lo", "up"]));
        made.map(|()| ns)
    }

    fn exec(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["netns", "exec", &self.name, "ip"];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// `program` run inside the namespace (`ip netns exec` keeps the process's id).
    pub(crate) fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// Cuts the gateway off from its store.
    pub(crate) fn partition(&self) {
        self.exec(&["route", "add", "unreachable", &self.route])
            .unwrap();
    }

    pub(crate) fn heal(&self) {
        self.exec(&["route", "del", "unreachable", &self.route])
            .unwrap();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // The veth pair goes with the namespace its peer is in.
        let _ = ip(&["netns", "del", &self.name]);
    }
}
