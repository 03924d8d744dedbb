//! Real `idem gateway` and `idem serve` processes on one store, a fenced ledger, and a nemesis.
//! Three runs: clients retrying payments through any of three gateways in front of the ledger;
//! clients of three API servers claiming payments, writing to the ledger and storing the
//! answer; and clients taking four locks through the API servers and writing under their
//! fences. The nemesis, on a schedule it records:
//! - stops an instance past its lease (SIGSTOP, then SIGCONT);
//! - kills one and restarts it (SIGKILL);
//! - restarts one with its wall clock stepped past the lease (libfaketime);
//! - cuts one off from its store while its clients still reach it (a route in its network
//!   namespace);
//! - stalls one's store connections past the lease, delays and reorders them, or cuts them
//!   (a proxy between it and its store);
//! - crashes the store and restarts it (a server of the run's own);
//! - sends a gateway a burst of large answers and stalls its store past the store timeout.
//!
//! `relay.rs` puts `idem relay` under the same kinds of fault.
//!
//! Every operation goes to a history; the checker reads it with the ledger and reports, per
//! key, the violations of the stated guarantees (see docs/guarantees.md).
//!
//! `IDEM_FAULTS_SECS` sets how long the run lasts at least (default 20, and 60 for gateways and
//! API servers under `CI=true`; it lasts until every kind of fault has struck), `IDEM_FAULTS_STORE` the store (default a Redis of the run's own,
//! and for gateways, API servers, locks and the relays on RabbitMQ a Valkey 9 of the run's own
//! too; `own-postgres`, `own-mariadb` or `own-valkey` for one of those; `sqlite` for a file; or
//! any store URL, a server the run never restarts), `IDEM_FAULTS_HISTORY` a file to keep each
//! run's history in (suffixed with the run's name and store), `IDEM_FAULTS_SEED` the nemesis's
//! schedule (every run prints its seed), `IDEM_FAKETIME` the path of libfaketime.

#![allow(clippy::unwrap_used)]
// The run prints what it did and what it left out: its report is the point.
#![allow(clippy::print_stdout)]

mod check;
mod cluster;
mod ledger;
mod netns;
mod proxy;
mod relay;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use check::{Event, History, check};
use cluster::{Cluster, Role};
use ledger::Ledger;

/// How long a client waits for an answer before it gives up and retries elsewhere.
const CLIENT_TIMEOUT: Duration = Duration::from_millis(1500);

/// One POST of `body` to `path` at `addr` with the extra header lines `headers`: the status,
/// the head in lower case, and the body; `None` when no answer came in time.
fn http(addr: &str, path: &str, headers: &str, body: &str) -> Option<(u16, String, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).ok()?;
    s.set_write_timeout(Some(CLIENT_TIMEOUT)).ok()?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.get(9..12)?.parse().ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    Some((status, head.to_ascii_lowercase(), body.to_owned()))
}

/// One payment through gateway `addr`: the status, whether it was a replay, and the body;
/// `None` when the gateway did not answer in time. A burst's key (`r…-b…`) goes to `/big`,
/// whose large answer is kept as its length, a hash and its fence.
fn post(addr: &str, key: &str) -> Option<(u16, bool, String)> {
    let body = format!("{{\"pay\":\"{key}\"}}");
    let path = if key.contains("-b") { "/big" } else { "/pay" };
    let (status, head, mut body) = http(addr, path, &format!("Idempotency-Key: {key}\r\n"), &body)?;
    if body.len() > 1024 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(&body);
        let fence = check::fence_of(&body).map_or_else(|| "null".to_owned(), |f| f.to_string());
        body = format!(
            "{{\"big\":{},\"hash\":\"{hash:016x}\",\"fence\":{fence}}}",
            body.len()
        );
    }
    Some((status, head.contains("idempotent-replayed: true"), body))
}

/// How many large answers a burst asks a gateway for at once.
const BURST: usize = 24;

/// A burst of large answers at gateway `victim`, its store stalled once the requests reach
/// the ledger, past the store timeout and the lease: what the gateway keeps for the store is
/// read from its gauge, and its memory from /proc, every 50 ms. The answers go to `history`,
/// the keys to `burst_keys` (to be asked again at the end), what was read as `Event::Memory`.
/// How long after its store is back a gateway may still count answers kept for it: they are
/// offered every 100 ms doubling to 2 s.
const KEPT_LET_GO: Duration = Duration::from_secs(10);

fn burst(
    c: &Cluster,
    victim: usize,
    history: &Arc<History>,
    burst_keys: &Mutex<Vec<String>>,
    run: u128,
) {
    let (addr, pid) = (c.addrs()[victim].clone(), c.pid(victim));
    let rss_before = rss(pid);
    let first = burst_keys.lock().unwrap().len();
    let clients: Vec<_> = (0..BURST)
        .map(|n| {
            let key = format!("r{run}-b{}", first + n);
            burst_keys.lock().unwrap().push(key.clone());
            let (addr, history) = (addr.clone(), history.clone());
            std::thread::spawn(move || {
                history.push(Event::Invoke {
                    key: key.clone(),
                    gateway: victim,
                });
                let answer = post(&addr, &key);
                history.push(Event::Complete { key, answer });
            })
        })
        .collect();
    // The ledger answers 0–150 ms after it takes a write, so most answers are on their way.
    std::thread::sleep(Duration::from_millis(100));
    c.proxy(victim).set(proxy::Mode::Hold);
    let (mut rss_peak, mut kept_peak) = (rss_before, 0);
    let until = Instant::now() + cluster::LEASE + Duration::from_millis(800);
    while Instant::now() < until {
        rss_peak = rss_peak.max(rss(pid));
        kept_peak = kept_peak.max(kept_bytes(&addr));
        std::thread::sleep(Duration::from_millis(50));
    }
    c.proxy(victim).set(proxy::Mode::Pass);
    for client in clients {
        client.join().unwrap();
    }
    // The store is back: what was kept for it is stored (or marked unknown) and let go.
    let settled = Instant::now() + KEPT_LET_GO;
    let mut kept_after = kept_bytes(&addr);
    while kept_after > 0 && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(100));
        kept_after = kept_bytes(&addr);
    }
    history.push(Event::Memory {
        gateway: victim,
        asked: BURST * ledger::BIG,
        budget: cluster::UNSTORED_BUDGET,
        rss_before,
        rss_peak,
        kept_peak,
        kept_after,
    });
}

/// The resident memory of process `pid`, in bytes (0 once it is gone).
fn rss(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kib| kib << 10)
}

/// The gateway at `addr`'s gauge of answers kept for its store (`idem_http_unstored_kept_bytes`),
/// 0 when it says nothing.
fn kept_bytes(addr: &str) -> usize {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return 0;
    };
    let _ = s.set_read_timeout(Some(CLIENT_TIMEOUT));
    let req = "GET /_idem/metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let mut out = String::new();
    if s.write_all(req.as_bytes()).is_err() || s.read_to_string(&mut out).is_err() {
        return 0;
    }
    out.lines()
        .find_map(|l| l.strip_prefix("idem_http_unstored_kept_bytes "))
        // A gauge of whole bytes.
        .and_then(|v| v.trim().split('.').next()?.parse().ok())
        .unwrap_or(0)
}

/// The answer a client of the API hands on for `key`, as the ledger wrote it (`{"key","fence"}`).
fn answer_of(key: &str, fence: u64) -> String {
    format!("{{\"key\":\"{key}\",\"fence\":{fence}}}")
}

/// One payment by a client of `idem serve`: it claims the key from instance `first`, writes to the
/// ledger under its fence, and stores its answer through another; it sometimes stalls past its
/// lease before the write (a long pause of its own). What it hands on: the stored answer of a
/// replay, its own once stored, or nothing (no answer in time, or overtaken, which, as the
/// gateway does, it never hands on).
fn run_once(
    addrs: &[String],
    first: usize,
    ledger: &str,
    key: &str,
    dice: &mut Dice,
    stalls: bool,
) -> Option<(u16, bool, String)> {
    let begin = serde_json::json!({
        "namespace": "pay", "key": key, "request": {"pay": key},
        "lease_ms": cluster::LEASE.as_millis(),
    });
    let (status, _, body) = http(&addrs[first], "/v1/records/begin", "", &begin.to_string())?;
    let answer: serde_json::Value = serde_json::from_str(&body).ok()?;
    if status != 200 {
        return Some((status, false, body));
    }
    if answer["outcome"] == "replay" {
        let fence = answer["response"]["fence"].as_u64()?;
        return Some((200, true, answer_of(key, fence)));
    }
    let (fence, lease) = (
        answer["lease"]["fence"].as_u64()?,
        answer["lease"]["id"].as_str()?,
    );
    if stalls && dice.below(25) == 0 {
        std::thread::sleep(cluster::LEASE + Duration::from_millis(500));
    }
    let write = format!("Idempotency-Key: {key}\r\nIdem-Fence: {fence}\r\n");
    let (status, _, _) = http(ledger, "/pay", &write, "{}")?;
    if status != 201 {
        return None;
    }
    let complete = serde_json::json!({
        "namespace": "pay", "key": key, "lease": lease,
        "response": {"key": key, "fence": fence},
    });
    let at = &addrs[dice.pick(addrs.len())];
    let (status, _, _) = http(at, "/v1/records/complete", "", &complete.to_string())?;
    (status == 200).then(|| (201, false, answer_of(key, fence)))
}

/// One holding of lock `name` by a client of `idem serve`: it acquires the lock from instance
/// `first` (waiting up to a second for it), writes to the ledger under the holding's fence
/// (sometimes stalling past its lease first), and releases it through any instance. Nothing
/// is handed on: the ledger's writes are what the checker reads.
fn hold_lock(
    addrs: &[String],
    first: usize,
    ledger: &str,
    name: &str,
    dice: &mut Dice,
    stalls: bool,
) -> Option<(u16, bool, String)> {
    let acquire = serde_json::json!({"lease_ms": cluster::LEASE.as_millis(), "wait_ms": 1000});
    let path = format!("/v1/locks/{name}/acquire");
    let (status, _, body) = http(&addrs[first], &path, "", &acquire.to_string())?;
    if status != 200 {
        return Some((status, false, body));
    }
    let held: serde_json::Value = serde_json::from_str(&body).ok()?;
    let (fence, lock) = (held["fence"].as_u64()?, held["lock"].as_str()?);
    if stalls && dice.below(25) == 0 {
        std::thread::sleep(cluster::LEASE + Duration::from_millis(500));
    }
    let write = format!("Idempotency-Key: {name}\r\nIdem-Fence: {fence}\r\n");
    http(ledger, "/pay", &write, "{}")?;
    let release = serde_json::json!({ "lock": lock });
    let at = &addrs[dice.pick(addrs.len())];
    http(
        at,
        &format!("/v1/locks/{name}/release"),
        "",
        &release.to_string(),
    );
    None
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

/// The nemesis's schedule: the kinds of fault in rounds, each round in an order drawn from a
/// seed, so that the store crash comes early in one run and late in another, and more than
/// once in a long one. The seed is printed; `IDEM_FAULTS_SEED` replays a run's schedule (the
/// order of kinds, the victims and the pauses between faults; the clients' timing is the
/// machine's).
struct Schedule {
    kinds: Vec<&'static str>,
    round: Vec<&'static str>,
    dice: Dice,
    seed: u64,
    struck: usize,
}

impl Schedule {
    fn new(kinds: Vec<&'static str>) -> Self {
        let seed = std::env::var("IDEM_FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(rand::random::<u64>);
        Self {
            kinds,
            round: Vec::new(),
            // xorshift never leaves zero.
            dice: Dice(seed | 1),
            seed,
            struck: 0,
        }
    }

    /// The next kind to strike.
    fn next(&mut self) -> &'static str {
        self.struck += 1;
        if self.round.is_empty() {
            self.round.clone_from(&self.kinds);
            for i in (1..self.round.len()).rev() {
                let j = self.dice.pick(i + 1);
                self.round.swap(i, j);
            }
        }
        self.round.pop().unwrap()
    }

    /// Whether every round begun has struck whole (and one at least has).
    fn rounds_done(&self) -> bool {
        self.struck > 0 && self.round.is_empty()
    }
}

/// How long a run lasts at least: `IDEM_FAULTS_SECS`, else 20 s.
fn seconds() -> u64 {
    asked_seconds().unwrap_or(20)
}

fn asked_seconds() -> Option<u64> {
    std::env::var("IDEM_FAULTS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
}

/// How long a run of `work` lasts at least: `IDEM_FAULTS_SECS`, else, under `CI=true`, 60 s for
/// the gateways and API servers (every kind of fault strikes several times, in several orders),
/// else 20 s.
fn seconds_of(work: Work) -> u64 {
    let long = std::env::var("CI").as_deref() == Ok("true") && work != Work::Locks;
    asked_seconds().unwrap_or(if long { 60 } else { 20 })
}

/// The faults this machine and store allow, and a note for each kind that is left out:
/// `proxies` says whether the store is reached through the nemesis's proxies.
pub(crate) fn fault_kinds(
    proxies: bool,
    store: &cluster::Store,
) -> (Vec<&'static str>, Vec<String>) {
    let mut kinds = vec!["pause", "kill"];
    let mut left_out = Vec::new();
    if cluster::can_step_clocks() {
        kinds.push("clock");
    } else {
        left_out.push("libfaketime is not installed (Debian's faketime): no clock steps".into());
    }
    if proxies {
        kinds.extend(["stall", "jitter", "cut"]);
    } else {
        left_out.push("the store is a file: no delays, stalls or cuts".into());
    }
    if store.own() {
        kinds.push("store");
    } else {
        left_out.push("the store is not the run's own: it is never restarted".into());
    }
    (kinds, left_out)
}

/// One fault of kind `fault` at gateway `victim` (or at the store): what it reached on the
/// way to the store, for the kinds that strike there (chunks held or delayed, connections
/// cut); 0 for the others, whose effect the clients see.
fn strike(c: &mut Cluster, fault: &str, victim: usize) -> u64 {
    // Past the lease: another gateway takes the keys the victim held over.
    let past_lease = cluster::LEASE + Duration::from_millis(800);
    let slowed = |c: &Cluster| c.proxy(victim).slowed();
    match fault {
        "pause" => {
            let pid = c.pid(victim);
            cluster::signal("-STOP", pid);
            std::thread::sleep(past_lease);
            cluster::signal("-CONT", pid);
        }
        // Restarted with its wall clock a lease and a half ahead: it takes over leases the
        // others still hold, until a kill restarts it on the true time.
        "clock" => c.kill_and_restart(victim, Some(cluster::LEASE + Duration::from_secs(1))),
        "kill" => c.kill_and_restart(victim, None),
        "partition" => c.partition(victim, past_lease),
        "stall" => {
            let before = slowed(c);
            c.stall(victim, past_lease);
            return slowed(c) - before;
        }
        "jitter" => {
            let before = slowed(c);
            c.proxy(victim).set(proxy::Mode::Jitter(300));
            std::thread::sleep(Duration::from_secs(3));
            c.proxy(victim).set(proxy::Mode::Pass);
            return slowed(c) - before;
        }
        "cut" => return c.proxy(victim).cut(),
        "store" => assert!(c.store.crash_and_restart(Duration::from_millis(500))),
        other => unreachable!("no fault {other}"),
    }
    0
}

/// What the clients do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Payments through `idem gateway`.
    Gateway,
    /// Payments claimed and stored through `idem serve`'s record API.
    Records,
    /// Writes under four locks taken through `idem serve`'s lock API.
    Locks,
}

#[test]
fn gateways_under_the_nemesis_keep_every_guarantee() {
    run(Work::Gateway, &chosen_store());
}

#[test]
fn api_servers_and_their_clients_under_the_nemesis_keep_every_guarantee() {
    run(Work::Records, &chosen_store());
}

#[test]
fn locks_through_api_servers_under_the_nemesis_keep_their_fences() {
    run(Work::Locks, &chosen_store());
}

/// On a Valkey 9 the records a client claimed settle, and the locks it holds are released, by
/// plain `SET … IFEQ` commands rather than scripts, falling back to the script when the state
/// moved on (a takeover after a pause, a store crash): the same guarantees, on that path.
#[test]
fn gateways_on_valkey_under_the_nemesis_keep_every_guarantee() {
    on_valkey(Work::Gateway);
}

#[test]
fn api_servers_on_valkey_under_the_nemesis_keep_every_guarantee() {
    on_valkey(Work::Records);
}

#[test]
fn locks_on_valkey_under_the_nemesis_keep_their_fences() {
    on_valkey(Work::Locks);
}

/// The store `IDEM_FAULTS_STORE` names (see `cluster::Store::named`).
fn chosen_store() -> String {
    std::env::var("IDEM_FAULTS_STORE").unwrap_or_default()
}

/// On a SQLite file the records and locks are idem-core's own state machine, applied in a
/// transaction: the one run whose store is the code the model and the linearizability check
/// take as their specification. No network: pauses, kills and clock steps only.
#[test]
fn gateways_on_sqlite_under_the_nemesis_keep_every_guarantee() {
    on_store(Work::Gateway, "sqlite");
}

#[test]
fn api_servers_on_sqlite_under_the_nemesis_keep_every_guarantee() {
    on_store(Work::Records, "sqlite");
}

#[test]
fn locks_on_sqlite_under_the_nemesis_keep_their_fences() {
    on_store(Work::Locks, "sqlite");
}

/// Locks in a ZooKeeper of the run's own (`idem serve --locks zk://…`), reached through the
/// nemesis's proxies: waiters queue behind their predecessor, and pauses, kills, cuts,
/// partitions and the server's crash must not let two holdings share a fence at the ledger.
#[test]
fn locks_on_zookeeper_under_the_nemesis_keep_their_fences() {
    on_store(Work::Locks, "own-zookeeper");
}

/// Locks in an etcd of the run's own (`idem serve --locks etcd://…`), the same.
#[cfg(feature = "etcd")]
#[test]
fn locks_on_etcd_under_the_nemesis_keep_their_fences() {
    on_store(Work::Locks, "own-etcd");
}

/// `work` on a Valkey of the run's own, unless `IDEM_FAULTS_STORE` chose the run's store
/// (`scripts/faults own-valkey` runs every test there).
fn on_valkey(work: Work) {
    on_store(work, "own-valkey");
}

/// `work` on the store `chosen` names, unless `IDEM_FAULTS_STORE` chose the run's store.
fn on_store(work: Work, chosen: &str) {
    if std::env::var_os("IDEM_FAULTS_STORE").is_some() {
        println!("IDEM_FAULTS_STORE chose the store: the {chosen} runs are left to it");
        return;
    }
    run(work, chosen);
}

/// Three instances on the store `chosen` names, six clients doing `work`, the nemesis, then
/// the checker.
fn run(work: Work, chosen: &str) {
    let role = match work {
        Work::Gateway => Role::Gateway,
        Work::Records | Work::Locks => Role::Serve,
    };
    let ledger = Ledger::start();
    let mut cluster = Cluster::start(role, 3, &ledger, chosen);
    if work == Work::Locks {
        let probe = serde_json::json!({"lease_ms": 1000});
        let held = http(
            &cluster.addrs()[0],
            "/v1/locks/probe/acquire",
            "",
            &probe.to_string(),
        );
        if held.is_some_and(|(status, _, _)| status == 501) {
            println!("the {} store keeps no locks", cluster.store.describe());
            return;
        }
    }
    let (mut kinds, mut left_out) = fault_kinds(cluster.has_proxies(), &cluster.store);
    // A burst of large answers at a gateway whose store stalls: what it keeps stays within
    // its budget.
    if work == Work::Gateway && cluster.has_proxies() {
        kinds.push("burst");
    }
    match &cluster.no_netns {
        None => kinds.push("partition"),
        Some(why) => left_out.push(format!("{why}: no partitions")),
    }
    for note in &left_out {
        println!("{note}");
    }
    // Under CI every kind runs: the machine has what each needs (CI installs libfaketime and
    // runs as root), unless the run was pointed at a store of someone else's or at a file.
    if std::env::var("CI").as_deref() == Ok("true")
        && std::env::var_os("IDEM_FAULTS_STORE").is_none()
        && chosen != "sqlite"
    {
        assert!(left_out.is_empty(), "{left_out:?}");
    }
    let addrs = cluster.addrs();
    println!(
        "{} {role:?} instances for {work:?} on {}; faults: {}",
        addrs.len(),
        cluster.store.describe(),
        kinds.join(", ")
    );
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    // New keys all the time (so that faults find first attempts in flight), and retries of
    // the last few.
    let keys = Arc::new(AtomicU64::new(1));
    let burst_keys = Mutex::new(Vec::new());
    let started = Instant::now();
    // Keys of this run's own: a shared store may still hold an earlier run's answers.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();

    let call = {
        let (addrs, ledger) = (addrs.clone(), ledger.addr.clone());
        Arc::new(
            move |at: usize, key: &str, dice: &mut Dice, stalls: bool| match work {
                Work::Gateway => post(&addrs[at], key),
                Work::Records => run_once(&addrs, at, &ledger, key, dice, stalls),
                Work::Locks => hold_lock(&addrs, at, &ledger, key, dice, stalls),
            },
        )
    };
    let clients: Vec<_> = (0..6u64)
        .map(|n| {
            let (addrs, history, stop) = (addrs.clone(), history.clone(), stop.clone());
            let (keys, call) = (keys.clone(), call.clone());
            std::thread::spawn(move || {
                let mut dice = Dice(0x9e37_79b9_7f4a_7c15 ^ (n + 1));
                while !stop.load(Ordering::Relaxed) {
                    let key = if dice.below(4) == 0 {
                        keys.fetch_add(1, Ordering::Relaxed)
                    } else {
                        let last = keys.load(Ordering::Relaxed);
                        last.saturating_sub(1 + dice.below(12)).max(1)
                    };
                    let key = match work {
                        // Four locks, so that holders contend.
                        Work::Locks => format!("r{run}-lock{}", key % 4),
                        _ => format!("r{run}-k{key}"),
                    };
                    let gw = dice.pick(addrs.len());
                    history.push(Event::Invoke {
                        key: key.clone(),
                        gateway: gw,
                    });
                    let answer = call(gw, &key, &mut dice, true);
                    history.push(Event::Complete { key, answer });
                    std::thread::sleep(Duration::from_millis(dice.below(30)));
                }
            })
        })
        .collect();

    // The nemesis: a fault every second or so, in the schedule's order, until the time is up
    // and every round has struck whole.
    let mut schedule = Schedule::new(kinds.clone());
    println!(
        "nemesis seed {} (IDEM_FAULTS_SEED replays it)",
        schedule.seed
    );
    while started.elapsed() < Duration::from_secs(seconds_of(work)) || !schedule.rounds_done() {
        std::thread::sleep(Duration::from_millis(500 + schedule.dice.below(1000)));
        let victim = schedule.dice.pick(addrs.len());
        let fault = schedule.next();
        history.push(Event::Fault {
            fault: fault.to_owned(),
            gateway: victim,
        });
        let touched = if fault == "burst" {
            burst(&cluster, victim, &history, &burst_keys, run);
            0
        } else {
            strike(&mut cluster, fault, victim)
        };
        history.push(Event::Healed { touched });
    }
    // Quiet: every key settles, then each is asked once more through every instance.
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    std::thread::sleep(cluster::LEASE * 2);
    let mut dice = Dice(11);
    // Locks hand nothing on to ask again.
    let asked = if work == Work::Locks {
        1
    } else {
        keys.load(Ordering::Relaxed)
    };
    let again = (1..asked)
        .map(|k| format!("r{run}-k{k}"))
        .chain(burst_keys.into_inner().unwrap());
    for key in again {
        for gw in 0..addrs.len() {
            let key = key.clone();
            history.push(Event::Invoke {
                key: key.clone(),
                gateway: gw,
            });
            let answer = call(gw, &key, &mut dice, false);
            history.push(Event::Complete { key, answer });
        }
    }
    if let Ok(path) = std::env::var("IDEM_FAULTS_HISTORY") {
        history.save(&format!("{path}.{work:?}.{}", cluster.store.kind()));
    }
    let report = check(&history, &ledger.entries());
    println!("{work:?}: {report}");
    assert!(report.faults >= kinds.len(), "the nemesis ran: {report}");
    assert!(report.keys > 0, "the ledger took writes: {report}");
    // The faults reached the work: some attempt was overtaken after its lease, and its write
    // superseded or refused by fence.
    assert!(
        report.superseded + report.refused > 0,
        "no attempt was overtaken: {report}"
    );
    assert!(report.violations.is_empty(), "{report}");
}
