//! Kafka's offset rule: one partition's records read by a consumer group whose members fetch,
//! claim, run, settle and commit them, while the group moves the partition between members
//! and members crash.
//!
//! Each member's bookkeeping is the Kafka source's own, [`idem_mq::offsets::Book`]: what it
//! holds, what it may hand out, and how far it commits. The model calls it as
//! `idem-mq/src/kafka/source.rs` does: `push` for a fetched record, `take` to hand one out,
//! `settle` when a delivery ends, `to_commit` on the commit timer, `revoke` (then a commit)
//! when the group takes the partition away, and `assign` when it gives it. A wrong rule in the
//! book that ships breaks the properties here.
//!
//! Around it: the claim on each record's key (`begin` finds it free, held or done), a run that
//! stores its result, a member that crashes (its holdings stay until their lease runs out),
//! and a rebalance at any point, also while a record runs. The partition's third record
//! repeats the first one's key (a producer that retried).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use idem_mq::offsets::{Book, Order, Settled, Take, Tp};
use stateright::{Model, Property};

/// Every record below the group's committed offset has its result stored.
pub const COMMITTED_DONE: &str = "every record below the committed offset is done";
/// No key's effect happens twice.
pub const ONE_RUN: &str = "each key runs once";
/// Once nothing more can happen, every record is done and the group committed past them all.
pub const ALL_COMMITTED: &str = "every record ends done and committed";

/// The partition's records: each one's key, by offset (`N` of them).
const KEYS: [u8; 3] = [0, 1, 0];
const N: i64 = 3;

/// How far the model is explored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KafkaBounds {
    /// Members of the group.
    pub members: u8,
    /// Member crashes, in all.
    pub crashes: u8,
    /// Times the group moves the partition (to another member or the same one).
    pub rebalances: u8,
    /// Times one member hands one record out (a retry hands it out again; the book counts).
    pub handouts: u32,
}

impl KafkaBounds {
    /// What CI checks.
    pub const SMALL: Self = Self {
        members: 2,
        crashes: 1,
        rebalances: 2,
        handouts: 2,
    };
}

/// A key's claim in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Claim {
    /// Nobody holds it.
    Free,
    /// A run of this member holds it.
    Held(u8),
    /// Its result is stored.
    Done,
}

/// A record a member handed out.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Running {
    offset: i64,
    generation: u64,
    key: u8,
    claimed: bool,
}

/// One member of the group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Member {
    alive: bool,
    book: Book<u8>,
    fetch_at: i64,
    running: Vec<Running>,
}

/// The group, its members and the store.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KafkaState {
    committed: i64,
    owner: Option<u8>,
    members: Vec<Member>,
    claims: Vec<Claim>,
    /// Runs per key that stored an effect (the ledger).
    effects: Vec<u8>,
    crashes: u8,
    rebalances: u8,
    /// A run settled after its partition had moved; a record acked from its stored result.
    seen: [bool; 2],
    /// A record was handed out more times than the bounds allow: the path ends here,
    /// unexplored, and nothing is asked of it.
    cut: bool,
}

/// What can happen next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KafkaAction {
    /// The member fetches the next record.
    Fetch(u8),
    /// The member hands a record out.
    Take(u8),
    /// The member's `i`-th running record claims its key.
    Claim(u8, usize),
    /// The member's `i`-th running record's run stores its result and is acked.
    Finish(u8, usize),
    /// The member's commit timer fires.
    Commit(u8),
    /// The member crashes.
    Crash(u8),
    /// A holding of key `k` whose run is gone (its member crashed) runs out.
    Expire(u8),
    /// A crashed member starts again.
    Restart(u8),
    /// The group gives the unowned partition to the member.
    Assign(u8),
    /// The group moves the partition from its owner to the member.
    Rebalance(u8),
}

/// The model: members under an [`Order`], explored within its bounds.
#[derive(Debug, Clone, Copy)]
pub struct KafkaModel {
    /// Which records may run at once.
    pub order: Order,
    /// How far to explore.
    pub bounds: KafkaBounds,
}

fn tp() -> Tp {
    static TP: OnceLock<Tp> = OnceLock::new();
    TP.get_or_init(|| (std::sync::Arc::from("t"), 0)).clone()
}

/// The model's instants: retries fall due at the start, and the book is always asked later.
fn start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

fn later() -> Instant {
    start() + Duration::from_secs(3600)
}

fn fresh_book(order: Order) -> Book<u8> {
    Book::new(order, usize::from(u8::MAX))
}

impl KafkaModel {
    /// A model of members reading one partition under `order`.
    pub fn new(order: Order, bounds: KafkaBounds) -> Self {
        Self { order, bounds }
    }
}

impl Model for KafkaModel {
    type State = KafkaState;
    type Action = KafkaAction;

    fn init_states(&self) -> Vec<KafkaState> {
        let member = Member {
            alive: true,
            book: fresh_book(self.order),
            fetch_at: 0,
            running: Vec::new(),
        };
        vec![KafkaState {
            committed: 0,
            owner: None,
            members: vec![member; usize::from(self.bounds.members)],
            claims: vec![Claim::Free; 2],
            effects: vec![0; 2],
            crashes: 0,
            rebalances: 0,
            seen: [false; 2],
            cut: false,
        }]
    }

    fn actions(&self, s: &KafkaState, out: &mut Vec<KafkaAction>) {
        if s.cut {
            return;
        }
        for (i, m) in s.members.iter().enumerate() {
            let id = u8::try_from(i).expect("few members");
            if !m.alive {
                out.push(KafkaAction::Restart(id));
                continue;
            }
            let owns = s.owner == Some(id);
            if owns && m.fetch_at < N {
                out.push(KafkaAction::Fetch(id));
            }
            if matches!(m.book.clone().take(later()), Take::Ready(_)) {
                out.push(KafkaAction::Take(id));
            }
            for (r, run) in m.running.iter().enumerate() {
                out.push(if run.claimed {
                    KafkaAction::Finish(id, r)
                } else {
                    KafkaAction::Claim(id, r)
                });
            }
            if owns && !m.book.clone().to_commit().is_empty() {
                out.push(KafkaAction::Commit(id));
            }
            if s.crashes < self.bounds.crashes {
                out.push(KafkaAction::Crash(id));
            }
            match s.owner {
                None => out.push(KafkaAction::Assign(id)),
                Some(_) if s.rebalances < self.bounds.rebalances => {
                    out.push(KafkaAction::Rebalance(id));
                }
                Some(_) => {}
            }
        }
        for (k, claim) in s.claims.iter().enumerate() {
            let k = u8::try_from(k).expect("two keys");
            // A holding whose run is gone (its member crashed) runs out with its lease.
            let held_by_a_run = s
                .members
                .iter()
                .any(|m| m.running.iter().any(|r| r.claimed && r.key == k));
            if matches!(claim, Claim::Held(_)) && !held_by_a_run {
                out.push(KafkaAction::Expire(k));
            }
        }
    }

    fn next_state(&self, s: &KafkaState, action: KafkaAction) -> Option<KafkaState> {
        let mut s = s.clone();
        match action {
            KafkaAction::Fetch(m) => {
                let m = &mut s.members[usize::from(m)];
                let offset = m.fetch_at;
                let key = KEYS[usize::try_from(offset).expect("an offset")];
                m.book.push(&tp(), offset, Some(vec![key].into()), key);
                m.fetch_at += 1;
            }
            KafkaAction::Take(m) => {
                let m = &mut s.members[usize::from(m)];
                let Take::Ready(h) = m.book.take(later()) else {
                    return None;
                };
                if h.handed > self.bounds.handouts {
                    s.cut = true;
                    return Some(s);
                }
                m.running.push(Running {
                    offset: h.offset,
                    generation: h.generation,
                    key: h.record,
                    claimed: false,
                });
            }
            KafkaAction::Claim(id, r) => {
                let key = usize::from(s.members[usize::from(id)].running[r].key);
                match s.claims[key] {
                    Claim::Free => {
                        s.claims[key] = Claim::Held(id);
                        s.members[usize::from(id)].running[r].claimed = true;
                    }
                    Claim::Done => {
                        // Acked from the stored result, without running.
                        s.seen[1] = true;
                        settle(&mut s.members[usize::from(id)], r, None);
                    }
                    Claim::Held(_) => {
                        // Held by a run elsewhere: requeued to this member.
                        let record = s.members[usize::from(id)].running[r].key;
                        settle(&mut s.members[usize::from(id)], r, Some(record));
                    }
                }
            }
            KafkaAction::Finish(id, r) => {
                let key = usize::from(s.members[usize::from(id)].running[r].key);
                s.effects[key] += 1;
                s.claims[key] = Claim::Done;
                if !settle(&mut s.members[usize::from(id)], r, None) {
                    s.seen[0] = true;
                }
            }
            KafkaAction::Commit(id) => {
                for (_, at) in s.members[usize::from(id)].book.to_commit() {
                    s.committed = at;
                }
            }
            KafkaAction::Crash(id) => {
                let m = &mut s.members[usize::from(id)];
                m.alive = false;
                m.book = fresh_book(self.order);
                m.running.clear();
                if s.owner == Some(id) {
                    s.owner = None;
                }
                s.crashes += 1;
            }
            KafkaAction::Expire(k) => s.claims[usize::from(k)] = Claim::Free,
            KafkaAction::Restart(id) => s.members[usize::from(id)].alive = true,
            KafkaAction::Assign(id) => {
                s.owner = Some(id);
                let m = &mut s.members[usize::from(id)];
                m.book.assign(tp());
                m.fetch_at = s.committed;
            }
            KafkaAction::Rebalance(id) => {
                let from = usize::from(s.owner?);
                // The revoked member commits what it got to before the partition goes.
                if let Some(at) = s.members[from].book.revoke(&tp()) {
                    s.committed = at;
                }
                s.owner = Some(id);
                s.rebalances += 1;
                let m = &mut s.members[usize::from(id)];
                m.book.assign(tp());
                m.fetch_at = s.committed;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(COMMITTED_DONE, |_, s: &KafkaState| {
                (0..s.committed).all(|o| {
                    let key = KEYS[usize::try_from(o).expect("an offset")];
                    s.claims[usize::from(key)] == Claim::Done
                })
            }),
            Property::always(ONE_RUN, |_, s: &KafkaState| {
                s.effects.iter().all(|&e| e <= 1)
            }),
            Property::eventually(ALL_COMMITTED, |_, s: &KafkaState| {
                s.cut || (s.committed == N && s.claims.iter().all(|c| *c == Claim::Done))
            }),
            Property::sometimes(
                "a run ends after its partition moved",
                |_, s: &KafkaState| s.seen[0],
            ),
            Property::sometimes(
                "a record is acked from its stored result",
                |_, s: &KafkaState| s.seen[1],
            ),
        ]
    }
}

/// Settles member `m`'s `r`-th running record: done (`None`), or back to be retried. Returns
/// whether the book took it (false: the partition moved since it was handed out).
fn settle(m: &mut Member, r: usize, retry: Option<u8>) -> bool {
    let run = m.running.remove(r);
    let how = match retry {
        None => Settled::Done,
        Some(record) => Settled::Retry {
            record,
            due: start(),
        },
    };
    m.book.settle(&tp(), run.generation, run.offset, how)
}
