//! Real `idem gateway` processes on one store, clients retrying keys through any of them, a
//! fenced ledger upstream, and a nemesis that stops gateways past their lease (SIGSTOP), kills
//! and restarts them (SIGKILL), and restarts one with its wall clock stepped past the lease
//! (libfaketime). Every operation goes to a history; the checker reads it
//! with the ledger and reports, per key, the violations of the stated guarantees (see
//! docs/guarantees.md).
//!
//! `IDEM_FAULTS_SECS` sets how long the run lasts (default 20), `IDEM_FAULTS_STORE` the store
//! (default a SQLite file), `IDEM_FAULTS_HISTORY` a file to keep the history in.

#![allow(clippy::unwrap_used)]

mod check;
mod cluster;
mod ledger;
mod relay;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use check::{Event, History, check};
use cluster::Cluster;
use ledger::Ledger;

/// How long a client waits for an answer before it gives up and retries elsewhere.
const CLIENT_TIMEOUT: Duration = Duration::from_millis(1500);

/// One POST through gateway `addr`: the status, whether it was a replay, and the body; `None`
/// when the gateway did not answer in time.
fn post(addr: &str, key: &str) -> Option<(u16, bool, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).ok()?;
    s.set_write_timeout(Some(CLIENT_TIMEOUT)).ok()?;
    let body = format!("{{\"pay\":\"{key}\"}}");
    let req = format!(
        "POST /pay HTTP/1.1\r\nHost: x\r\nConnection: close\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.get(9..12)?.parse().ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    let replayed = head
        .to_ascii_lowercase()
        .contains("idempotent-replayed: true");
    Some((status, replayed, body.to_owned()))
}

/// A small generator for choices (xorshift), seeded per thread.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    fn pick(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).unwrap()
    }
}

fn seconds() -> u64 {
    std::env::var("IDEM_FAULTS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
}

#[test]
fn gateways_stopped_killed_and_restarted_keep_every_guarantee() {
    let ledger = Ledger::start();
    let cluster = Arc::new(Mutex::new(Cluster::start(3, &ledger.addr)));
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    // New keys all the time (so that faults find first attempts in flight), and retries of
    // the last few.
    let keys = Arc::new(AtomicU64::new(1));
    let started = Instant::now();
    // Keys of this run's own: a shared store may still hold an earlier run's answers.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();

    let clients: Vec<_> = (0..6u64)
        .map(|n| {
            let (cluster, history, stop) = (cluster.clone(), history.clone(), stop.clone());
            let keys = keys.clone();
            std::thread::spawn(move || {
                let mut dice = Dice(0x9e37_79b9_7f4a_7c15 ^ (n + 1));
                while !stop.load(Ordering::Relaxed) {
                    let key = if dice.below(4) == 0 {
                        keys.fetch_add(1, Ordering::Relaxed)
                    } else {
                        let last = keys.load(Ordering::Relaxed);
                        last.saturating_sub(1 + dice.below(12)).max(1)
                    };
                    let key = format!("r{run}-k{key}");
                    let addrs = cluster.lock().unwrap().addrs();
                    let gw = dice.pick(addrs.len());
                    history.push(Event::Invoke {
                        key: key.clone(),
                        gateway: gw,
                    });
                    let answer = post(&addrs[gw], &key);
                    history.push(Event::Complete { key, answer });
                    std::thread::sleep(Duration::from_millis(dice.below(30)));
                }
            })
        })
        .collect();

    // The nemesis: a fault every second or so, each kind in turn.
    let kinds: &[&str] = if cluster::can_step_clocks() {
        &["pause", "kill", "clock"]
    } else {
        let note = "libfaketime is not installed (Debian's faketime): no clock steps";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{note}");
        println!("{note}");
        &["pause", "kill"]
    };
    let mut dice = Dice(7);
    let mut kind = 0;
    while started.elapsed() < Duration::from_secs(seconds()) {
        std::thread::sleep(Duration::from_millis(500 + dice.below(1000)));
        let victim = dice.pick(3);
        let fault = kinds[kind % kinds.len()];
        history.push(Event::Fault {
            fault: fault.to_owned(),
            gateway: victim,
        });
        match fault {
            // Past the lease (2 s): another gateway takes the keys it held over.
            "pause" => {
                let pid = cluster.lock().unwrap().pid(victim);
                cluster::signal("-STOP", pid);
                std::thread::sleep(cluster::LEASE + Duration::from_millis(800));
                cluster::signal("-CONT", pid);
            }
            // Restarted with its wall clock a lease and a half ahead: it takes over leases
            // the others still hold, until a kill restarts it on the true time.
            "clock" => {
                let ahead = cluster::LEASE + Duration::from_secs(1);
                cluster
                    .lock()
                    .unwrap()
                    .kill_and_restart(victim, Some(ahead));
            }
            _ => cluster.lock().unwrap().kill_and_restart(victim, None),
        }
        kind += 1;
    }
    // Quiet: every key settles, then each is asked once more through every gateway.
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    std::thread::sleep(cluster::LEASE * 2);
    let addrs = cluster.lock().unwrap().addrs();
    for k in 1..keys.load(Ordering::Relaxed) {
        for (gw, addr) in addrs.iter().enumerate() {
            let key = format!("r{run}-k{k}");
            history.push(Event::Invoke {
                key: key.clone(),
                gateway: gw,
            });
            let answer = post(addr, &key);
            history.push(Event::Complete { key, answer });
        }
    }
    if let Ok(path) = std::env::var("IDEM_FAULTS_HISTORY") {
        history.save(&path);
    }
    let report = check(&history, &ledger.entries());
    println!("{report}");
    assert!(report.faults >= 2, "the nemesis ran: {report}");
    assert!(report.violations.is_empty(), "{report}");
}
