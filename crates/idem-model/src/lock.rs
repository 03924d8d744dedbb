//! One distributed lock, the clients that acquire, renew, write under and release it, and the
//! faults around them.
//!
//! The lock's backend is idem-core's [`LockState`]: `acquire`, `renew` and `release` are the
//! transitions the memory store (`idem-store/src/memory.rs`, `impl LockStore for
//! MemoryStore`) and the SQLite store (`idem-store/src/sqlite/locks.rs`, `apply_lock`) apply
//! under their own clock, and that Redis's scripts and the SQL stores are tested against. A
//! client is a [`LockGuard`](https://docs.rs/idem) of `idem/src/locks.rs`: it believes it
//! holds the lock until its own deadline, counted from before it asked (`local_deadline`:
//! the lease less 1% and 2 ms), passes, or a renewal is refused. It may write to a fenced
//! resource at any time it holds a fence (a holder that checked its lease and then paused is
//! what fences are for), and it renews and releases by owner and fence, as `Locks::renew` and
//! `Locks::release` (the JSON API's calls) do, without looking at its own deadline first.
//!
//! Time runs in milliseconds, as the stores count it. The backend's clock may jump ahead of the
//! clients' (a wall clock stepped forward); the backend may lose its state (a Redis restarted
//! without persistence, or a lock's row purged after [`idem_core::lock::LOCK_STATE_RETENTION`]).

use std::hash::{Hash, Hasher};
use std::time::Duration;

use idem_core::{LockState, OwnerDigest, Timestamp};
use stateright::{Model, Property};

/// The lease every acquire and renewal asks for, in milliseconds.
pub const LOCK_LEASE_MS: u64 = 10;
/// How often a guard renews: a third of the lease (`renew_loop` in `idem/src/locks.rs`).
pub const RENEW_MS: u64 = LOCK_LEASE_MS / 3;
/// How far the backend's clock jumps ahead: more than the 2.1 ms a guard allows for.
pub const JUMP_MS: u64 = 3;
/// The model's clock when it starts, in milliseconds.
pub const LOCK_START_MS: u64 = 1_000;

/// How long after asking a guard believes a lease of [`LOCK_LEASE_MS`] ends, in microseconds:
/// `local_deadline` in `idem/src/locks.rs`, the lease less 1% and 2 ms.
pub const LOCAL_LEASE_US: u64 = LOCK_LEASE_MS * 1000 - LOCK_LEASE_MS * 10 - 2000;

/// How far the lock model is explored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LockBounds {
    /// Clients contending for the lock.
    pub clients: u8,
    /// Acquires granted to each client under a new owner id.
    pub acquires: u8,
    /// Steps of time: a renewal period, or on to the next lease end.
    pub time_steps: u8,
    /// Jumps of the backend's clock, [`JUMP_MS`] each.
    pub clock_jumps: u8,
    /// Times the backend loses the lock's state.
    pub forgets: u8,
}

impl LockBounds {
    /// What CI checks: two clients, every fault once.
    pub const SMALL: Self = Self {
        clients: 2,
        acquires: 2,
        time_steps: 2,
        clock_jumps: 1,
        forgets: 1,
    };
    /// The documented longer run: a third step of time (enough for a renewal and then a
    /// takeover).
    pub const LARGE: Self = Self {
        time_steps: 3,
        ..Self::SMALL
    };
}

/// A defect planted in the lock's rules, to show that the properties catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockBug {
    /// A new owner taking the lock over keeps the fence it found.
    TakeoverKeepsFence,
    /// `renew` extends any live lease, whoever asks.
    RenewWithoutOwnerCheck,
    /// `release` ends any lease, whoever asks.
    ReleaseWithoutOwnerCheck,
    /// The next fence is the previous one plus one, without the clock term: a lost state
    /// starts again at 1.
    FencesWithoutClockTerm,
}

/// The lock model: its bounds, and a planted bug or none.
#[derive(Debug, Clone, Copy)]
pub struct LockModel {
    /// How far to explore.
    pub bounds: LockBounds,
    /// A defect to plant, or none: the lock as it ships.
    pub bug: Option<LockBug>,
}

/// A holding a client believes it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holding {
    /// Which of the client's owner ids it holds under.
    pub owner: u8,
    /// Its fence.
    pub fence: u64,
    /// When the guard believes the lease ends, in microseconds of the model's time.
    pub deadline_us: u64,
    /// A renewal was refused: the guard knows it lost the lock.
    pub lost: bool,
    /// Which acquisition of the lock this is, counted by the model.
    pub seq: u32,
    /// Whether it wrote to the fenced resource yet.
    pub wrote: bool,
}

impl Holding {
    /// Whether the guard believes it holds the lock at `now` (milliseconds).
    pub fn believed(&self, now: u64) -> bool {
        !self.lost && now * 1000 < self.deadline_us
    }
}

/// One client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LockClient {
    /// Acquires granted so far under a new owner id.
    pub acquired: u8,
    /// The holding it believes it has.
    pub holding: Option<Holding>,
}

/// What the model remembers about the history, to state the properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LockGhost {
    /// Acquisitions so far.
    pub acquisitions: u32,
    /// The acquisition the backend's state belongs to, if any.
    pub current: Option<u32>,
    /// The latest acquisition whose write the resource accepted, and the highest fence it saw.
    pub resource: Option<(u32, u64)>,
    /// A write of an earlier acquisition was accepted after one of a later acquisition.
    pub stale_write: bool,
    /// A renew by a holder overtaken or run out, or a release by one overtaken, succeeded.
    pub stale_call: bool,
    /// Reached: a takeover, a stale write refused, a stale renew or release refused, a renewal.
    pub seen: [bool; 4],
}

/// The lock model's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockModelState {
    /// The clients' clock, in milliseconds.
    pub now: u64,
    /// How far the backend's clock runs ahead of the clients'.
    pub skew: u64,
    /// The backend's state for the lock.
    pub lock: Option<LockState>,
    /// The clients.
    pub clients: Vec<LockClient>,
    /// Faults used: time steps, clock jumps, forgets.
    pub used: [u8; 3],
    /// The history, as far as the properties need it.
    pub ghost: LockGhost,
}

impl Hash for LockModelState {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (self.now, self.skew).hash(h);
        if let Some(s) = &self.lock {
            (s.owner, s.fence, s.expires_at).hash(h);
        }
        self.clients.hash(h);
        self.used.hash(h);
        self.ghost.hash(h);
    }
}

/// A step of the lock model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockAction {
    /// Client `c` acquires under a new owner id (`Locks::acquire`); refused while held.
    Acquire(u8),
    /// Client `c` repeats the acquire of its holding's owner id (`Locks::acquire_as` after a
    /// lost answer).
    Reacquire(u8),
    /// Client `c` renews by owner and fence.
    Renew(u8),
    /// Client `c` releases by owner and fence, and forgets its holding.
    Release(u8),
    /// Client `c` writes to the fenced resource with its fence.
    Write(u8),
    /// Client `c` crashes and forgets its holding.
    Crash(u8),
    /// Time moves on by a renewal period.
    Tick,
    /// Time moves on to the end of the backend's lease (past the holder's own deadline, which
    /// ends earlier).
    Wait,
    /// The backend's clock jumps [`JUMP_MS`] ahead.
    JumpClock,
    /// The backend loses the lock's state after its lease ended (purged after
    /// [`idem_core::lock::LOCK_STATE_RETENTION`], or a restart without persistence); it answers
    /// again a millisecond later.
    Forget,
}

/// The owner id of client `c`'s `n`-th acquire (each acquire draws a random one).
fn owner(c: u8, n: u8) -> OwnerDigest {
    let mut d = [0; 32];
    (d[0], d[1], d[31]) = (c, n, 1);
    OwnerDigest(d)
}

fn lease() -> Duration {
    Duration::from_millis(LOCK_LEASE_MS)
}

const TIME: usize = 0;
const JUMPS: usize = 1;
const FORGETS: usize = 2;

impl LockModel {
    /// The model of the lock as it ships.
    pub fn new(bounds: LockBounds) -> Self {
        Self { bounds, bug: None }
    }

    /// The same model with `bug` planted.
    pub fn with_bug(self, bug: LockBug) -> Self {
        Self {
            bug: Some(bug),
            ..self
        }
    }

    /// The first state: nobody holds the lock.
    pub fn start(&self) -> LockModelState {
        LockModelState {
            now: LOCK_START_MS,
            skew: 0,
            lock: None,
            clients: vec![LockClient::default(); usize::from(self.bounds.clients)],
            used: [0; 3],
            ghost: LockGhost::default(),
        }
    }

    fn spend(&self, s: &mut LockModelState, i: usize) -> Option<()> {
        let b = &self.bounds;
        let most = [b.time_steps, b.clock_jumps, b.forgets][i];
        (s.used[i] < most).then(|| s.used[i] += 1)
    }

    /// Takes `action` from `last`: the next state, or `None` if the action is not possible.
    pub fn apply(&self, last: &LockModelState, action: LockAction) -> Option<LockModelState> {
        let mut s = last.clone();
        let backend_now = Timestamp::from_millis(s.now + s.skew);
        match action {
            LockAction::Acquire(c) => {
                let client = s.clients[usize::from(c)];
                if client.holding.is_some() || client.acquired >= self.bounds.acquires {
                    return None;
                }
                let n = client.acquired;
                self.acquire(&mut s, c, n, backend_now)?;
                s.clients[usize::from(c)].acquired += 1;
            }
            LockAction::Reacquire(c) => {
                let n = s.clients[usize::from(c)].holding?.owner;
                if self.acquire(&mut s, c, n, backend_now).is_none() {
                    // Busy: the caller gives up on a holding it never learnt of.
                    s.clients[usize::from(c)].holding = None;
                }
            }
            LockAction::Renew(c) => self.renew(&mut s, c, backend_now)?,
            LockAction::Release(c) => self.release(&mut s, c, backend_now)?,
            LockAction::Write(c) => write(&mut s, c)?,
            LockAction::Crash(c) => {
                s.clients[usize::from(c)].holding.take()?;
            }
            LockAction::Tick => {
                self.spend(&mut s, TIME)?;
                s.now += RENEW_MS;
            }
            LockAction::Wait => {
                let end = s
                    .lock
                    .map(|l| l.expires_at.as_millis().saturating_sub(s.skew))
                    .filter(|&end| end > s.now)?;
                self.spend(&mut s, TIME)?;
                s.now = end;
            }
            LockAction::JumpClock => {
                self.spend(&mut s, JUMPS)?;
                s.skew += JUMP_MS;
            }
            LockAction::Forget => {
                // Only a lease that has ended: a backend that loses a live lease (a Redis
                // failover that lost its last writes) is outside what a lock promises.
                s.lock.filter(|l| l.expires_at <= backend_now)?;
                s.lock = None;
                self.spend(&mut s, FORGETS)?;
                s.now += 1;
                s.ghost.current = None;
            }
        }
        Some(s)
    }

    /// An acquire by client `c` under its `n`-th owner id: `None` if the lock is busy.
    fn acquire(&self, s: &mut LockModelState, c: u8, n: u8, now: Timestamp) -> Option<()> {
        let who = owner(c, n);
        let current = s.lock;
        let same = current.is_some_and(|l| l.expires_at > now && l.owner == who);
        let mut next = LockState::acquire(current.as_ref(), who, lease(), now).ok()?;
        if !same {
            match (self.bug, current) {
                (Some(LockBug::TakeoverKeepsFence), Some(old)) => next.fence = old.fence,
                (Some(LockBug::FencesWithoutClockTerm), old) => {
                    next.fence = old.map_or(1, |o| o.fence + 1);
                }
                _ => {}
            }
        }
        s.lock = Some(next);
        let g = &mut s.ghost;
        let seq = match (same, s.clients[usize::from(c)].holding) {
            (true, Some(h)) => h.seq,
            _ => {
                g.seen[0] |= current.is_some() && !same;
                g.acquisitions += 1;
                g.acquisitions
            }
        };
        g.current = Some(seq);
        let wrote = same && s.clients[usize::from(c)].holding.is_some_and(|h| h.wrote);
        s.clients[usize::from(c)].holding = Some(Holding {
            owner: n,
            fence: next.fence,
            deadline_us: s.now * 1000 + LOCAL_LEASE_US,
            lost: false,
            seq,
            wrote,
        });
        Some(())
    }

    fn renew(&self, s: &mut LockModelState, c: u8, now: Timestamp) -> Option<()> {
        let h = s.clients[usize::from(c)].holding?;
        let who = owner(c, h.owner);
        let stale = s.ghost.current != Some(h.seq) || s.lock.is_none_or(|l| l.expires_at <= now);
        let renewed = match (s.lock.as_mut(), self.bug) {
            (Some(l), Some(LockBug::RenewWithoutOwnerCheck)) if l.expires_at > now => {
                l.expires_at = now.saturating_add(lease());
                true
            }
            (Some(l), _) => l.renew(who, h.fence, lease(), now).is_ok(),
            (None, _) => false,
        };
        let g = &mut s.ghost;
        g.stale_call |= renewed && stale;
        g.seen[2] |= !renewed && stale;
        g.seen[3] |= renewed;
        let now_ms = s.now;
        let held = s.clients[usize::from(c)].holding.as_mut()?;
        // The guard's rule: a renewal extends only a lease it still believes in; once lost,
        // always lost.
        if renewed && held.believed(now_ms) {
            held.deadline_us = now_ms * 1000 + LOCAL_LEASE_US;
        } else {
            held.lost = true;
        }
        Some(())
    }

    fn release(&self, s: &mut LockModelState, c: u8, now: Timestamp) -> Option<()> {
        let h = s.clients[usize::from(c)].holding.take()?;
        let who = owner(c, h.owner);
        let stale = s.ghost.current != Some(h.seq);
        let released = match (s.lock.as_mut(), self.bug) {
            (Some(l), Some(LockBug::ReleaseWithoutOwnerCheck)) => {
                l.expires_at = l.expires_at.min(now);
                true
            }
            (Some(l), _) => l.release(who, h.fence, now).is_ok(),
            (None, _) => false,
        };
        let g = &mut s.ghost;
        g.stale_call |= released && stale;
        g.seen[2] |= !released && stale;
        Some(())
    }
}

/// A write to the fenced resource (`idem_store::fenced`): accepted when its fence is at least the
/// highest seen.
fn write(s: &mut LockModelState, c: u8) -> Option<()> {
    let h = s.clients[usize::from(c)].holding.as_mut()?;
    if h.wrote {
        return None;
    }
    h.wrote = true;
    let (seq, fence) = (h.seq, h.fence);
    let g = &mut s.ghost;
    match g.resource {
        Some((_, highest)) if fence < highest => g.seen[1] = true,
        Some((last, highest)) => {
            g.stale_write |= seq < last;
            g.resource = Some((seq.max(last), highest.max(fence)));
        }
        None => g.resource = Some((seq, fence)),
    }
    Some(())
}

/// No two clients hold the lock with one fence.
pub const ONE_FENCE: &str = "no two holders hold the lock with one fence";
/// A holder overtaken (or whose lease ran out, for a renewal) never renews or releases.
pub const STALE_CALL: &str = "a stale holder never renews or releases";
/// The fenced resource takes holders' writes in the order they acquired.
pub const ORDERED: &str =
    "a fenced resource never takes an older holding's write after a newer one's";
/// At most one client believes it holds the lock at a time.
pub const EXCLUSION: &str = "at most one client believes it holds the lock";

impl Model for LockModel {
    type State = LockModelState;
    type Action = LockAction;

    fn init_states(&self) -> Vec<LockModelState> {
        vec![self.start()]
    }

    fn actions(&self, _: &LockModelState, actions: &mut Vec<LockAction>) {
        for c in 0..self.bounds.clients {
            actions.extend([
                LockAction::Acquire(c),
                LockAction::Reacquire(c),
                LockAction::Renew(c),
                LockAction::Release(c),
                LockAction::Write(c),
                LockAction::Crash(c),
            ]);
        }
        actions.extend([
            LockAction::Tick,
            LockAction::Wait,
            LockAction::JumpClock,
            LockAction::Forget,
        ]);
    }

    fn next_state(&self, last: &LockModelState, action: LockAction) -> Option<LockModelState> {
        self.apply(last, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_FENCE, |_, s: &LockModelState| {
                let mut fences: Vec<u64> = s
                    .clients
                    .iter()
                    .filter_map(|c| c.holding)
                    .map(|h| h.fence)
                    .collect();
                fences.sort_unstable();
                fences.windows(2).all(|w| w[0] != w[1])
            }),
            Property::always(STALE_CALL, |_, s: &LockModelState| !s.ghost.stale_call),
            Property::always(ORDERED, |_, s: &LockModelState| !s.ghost.stale_write),
            Property::always(EXCLUSION, |_, s: &LockModelState| {
                let believers = s
                    .clients
                    .iter()
                    .filter_map(|c| c.holding)
                    .filter(|h| h.believed(s.now))
                    .count();
                believers <= 1
            }),
            Property::sometimes("a lock is taken over", |_, s: &LockModelState| {
                s.ghost.seen[0]
            }),
            Property::sometimes(
                "a stale holder's write is refused",
                |_, s: &LockModelState| s.ghost.seen[1],
            ),
            Property::sometimes(
                "a stale holder's renew or release is refused",
                |_, s: &LockModelState| s.ghost.seen[2],
            ),
            Property::sometimes("a holder renews its lease", |_, s: &LockModelState| {
                s.ghost.seen[3]
            }),
        ]
    }
}
