//! One key's record, the clients that retry one request against it, and the faults around them.

use std::hash::{Hash, Hasher};
use std::time::Duration;

use idem_core::step::{Step, StepName};
use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, LeaseId, Record, Status, Timestamp,
};
use stateright::{Model, Property};

/// The lease every `begin` asks for, in milliseconds.
pub const LEASE_MS: u64 = 10;
/// How long a record is kept after it settles, in milliseconds.
pub const TTL_MS: u64 = 100;
/// The model's clock when it starts, in milliseconds.
pub const START_MS: u64 = 1_000;

/// How far the model is explored: how many clients, and how many of each event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Clients retrying the same request.
    pub clients: u8,
    /// `begin`s per client (a client that crashed or gave the key back begins again).
    pub begins: u8,
    /// Times the clock runs to the end of the lease the record holds.
    pub expiries: u8,
    /// Clients whose clock jumps a whole lease ahead of the others.
    pub clock_jumps: u8,
    /// Operator deletes of the record, in whatever state it is.
    pub deletes: u8,
    /// Operator reopens of a completed record.
    pub reopens: u8,
    /// Purges after the record's retention ended.
    pub purges: u8,
    /// How long a delete takes, in milliseconds: the time between the record's last
    /// acquisition and its re-creation is at least this. Fences after a delete rise only if it
    /// is longer than the clients' clocks disagree (a clock jump is a whole lease): the
    /// documented assumption, which a shorter gap shows to be needed.
    pub delete_gap: u64,
}

impl Bounds {
    /// What CI checks: two clients, every fault once.
    pub const SMALL: Self = Self {
        clients: 2,
        begins: 2,
        expiries: 2,
        clock_jumps: 1,
        deletes: 1,
        reopens: 1,
        purges: 1,
        delete_gap: LEASE_MS + 1,
    };
    /// The documented longer run: a third begin per client and a third lease expiry (a
    /// search of some minutes and some GiB; a third client needs more than 24 GiB).
    pub const LARGE: Self = Self {
        begins: 3,
        expiries: 3,
        ..Self::SMALL
    };
}

/// A defect planted in the store's rules, to show that the properties catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bug {
    /// A takeover keeps the fence it found instead of raising it.
    TakeoverKeepsFence,
    /// `complete` takes any lease while the record is in progress (no lease or fence check).
    CompleteWithoutLeaseCheck,
    /// A record created again starts from fence 1, as fences did before they had a clock term.
    FencesRestartAtOne,
}

/// The model: its bounds, and a planted bug or none.
#[derive(Debug, Clone, Copy)]
pub struct RecordModel {
    /// How far to explore.
    pub bounds: Bounds,
    /// A defect to plant, or none: the store as it ships.
    pub bug: Option<Bug>,
}

/// A lease a client believes it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Held {
    /// The lease's id.
    pub id: LeaseId,
    /// Its fence.
    pub fence: u64,
    /// Its end, in milliseconds.
    pub expires_ms: u64,
    /// Which acquisition of the key this was, counted by the model across records.
    pub seq: u32,
    /// Whether this attempt wrote to the fenced resource yet.
    pub wrote: bool,
    /// Whether it recorded its step yet.
    pub stepped: bool,
}

impl Held {
    /// The lease as the store handed it out.
    pub fn lease(&self) -> Lease {
        Lease {
            id: self.id,
            fence: self.fence,
            expires_at: Timestamp::from_millis(self.expires_ms),
        }
    }
}

/// One client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Client {
    /// `begin`s so far.
    pub begun: u8,
    /// How far ahead its clock runs, in milliseconds.
    pub skew: u64,
    /// The lease it believes it holds.
    pub held: Option<Held>,
    /// Whether it has its answer (it completed, or was given a replay).
    pub done: bool,
}

/// What the model remembers about the history, to state the properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Ghost {
    /// Acquisitions so far.
    pub acquisitions: u32,
    /// The acquisition whose lease the record holds now, if any.
    pub holder: Option<u32>,
    /// The answer stored since the record was last created, reopened or deleted.
    pub answer: Option<u8>,
    /// The latest acquisition whose write the resource accepted, and the highest fence it saw.
    pub resource: Option<(u32, u64)>,
    /// A write of an earlier acquisition was accepted after one of a later acquisition.
    pub stale_write: bool,
    /// A complete, release or step succeeded for a lease that was not the record's.
    pub stale_settle: bool,
    /// A stored answer changed without a reopen, or a replay answered something else.
    pub answer_changed: bool,
    /// Reached: a takeover, a replay, a refused stale write, a record created after a delete.
    pub seen: [bool; 4],
}

/// The model's state.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// The clock, in milliseconds.
    pub now: u64,
    /// The record in the store.
    pub record: Option<Record>,
    /// The clients.
    pub clients: Vec<Client>,
    /// Faults used: expiries, clock jumps, deletes, reopens, purges.
    pub used: [u8; 5],
    /// The history, as far as the properties need it.
    pub ghost: Ghost,
}

impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.now.hash(h);
        hash_record(self.record.as_ref(), h);
        self.clients.hash(h);
        self.used.hash(h);
        self.ghost.hash(h);
    }
}

/// Hashes what of a record the models' states tell apart by (`Record` itself does not hash:
/// its fingerprint and steps need not).
pub(crate) fn hash_record<H: Hasher>(record: Option<&Record>, h: &mut H) {
    if let Some(r) = record {
        (r.status, r.fence, r.lease_id).hash(h);
        (r.lease_expires_at.as_millis(), r.expires_at.as_millis()).hash(h);
        r.response.as_deref().hash(h);
        r.steps.len().hash(h);
    }
}

/// A step of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Client `c` calls `begin`.
    Begin(u8),
    /// Client `c` writes to the fenced resource under its lease.
    Write(u8),
    /// Client `c` records its step under its lease.
    Step(u8),
    /// Client `c` completes the record with its own answer.
    Complete(u8),
    /// Client `c` gives the key back.
    Release(u8),
    /// Client `c` crashes and forgets its lease.
    Crash(u8),
    /// Time runs to the end of the record's lease.
    Expire,
    /// Client `c`'s clock jumps a lease ahead.
    JumpClock(u8),
    /// An operator deletes the record; time moves on by [`Bounds::delete_gap`].
    Delete,
    /// An operator reopens the completed record.
    Reopen,
    /// The record's retention ends and it is purged.
    Purge,
}

/// What an action answered, as a client or operator sees it: what the real stores must answer
/// too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `begin` acquired the key with this fence.
    Acquired(u64),
    /// `begin` replayed this response, stored under this fence.
    Replay(Bytes, u64),
    /// `begin`: another attempt holds the key.
    InProgress,
    /// `begin`: the key was used with another request.
    Mismatch,
    /// A settle or step was taken (`true`) or refused as stale (`false`); a reopen or delete
    /// changed the record or not.
    Done(bool),
    /// Nothing the store answers (time, a crash, the resource).
    Nothing,
}

/// The key every client uses.
pub fn key() -> Key {
    Key::parse("model", "transfer", "order-1").expect("a valid key")
}

/// The request every client retries.
pub fn request() -> BeginRequest {
    BeginRequest::new(key(), Fingerprint::of_bytes(b"transfer 100 to bob"))
        .with_lease(Duration::from_millis(LEASE_MS))
        .with_ttl(Duration::from_millis(TTL_MS))
}

/// The step every attempt records.
pub fn step(client: u8) -> Step {
    Step::done(StepName::new("debit").expect("a valid name"), vec![client]).expect("small")
}

/// The lease id of client `c`'s `n`-th begin (the model draws them, as stores draw random ones).
fn lease_id(c: u8, n: u8) -> LeaseId {
    let mut b = [0; 16];
    (b[0], b[1], b[15]) = (c, n, 1);
    LeaseId::from_bytes(b)
}

const EXPIRIES: usize = 0;
const JUMPS: usize = 1;
const DELETES: usize = 2;
const REOPENS: usize = 3;
const PURGES: usize = 4;

impl RecordModel {
    /// The model of the store as it ships.
    pub fn new(bounds: Bounds) -> Self {
        Self { bounds, bug: None }
    }

    /// The same model with `bug` planted.
    pub fn with_bug(self, bug: Bug) -> Self {
        Self {
            bug: Some(bug),
            ..self
        }
    }

    /// The first state: no record, idle clients.
    pub fn start(&self) -> State {
        State {
            now: START_MS,
            record: None,
            clients: vec![Client::default(); usize::from(self.bounds.clients)],
            used: [0; 5],
            ghost: Ghost::default(),
        }
    }

    /// Takes `action` from `last`: the next state and what was answered, or `None` if the
    /// action is not possible there.
    pub fn apply(&self, last: &State, action: Action) -> Option<(State, Answer)> {
        let mut s = last.clone();
        let answer = match action {
            Action::Begin(c) => self.begin(&mut s, c)?,
            Action::Write(c) => write(&mut s, c)?,
            Action::Step(c) => settle(&mut s, c, Settle::Step)?,
            Action::Complete(c) => {
                let bug = self.bug == Some(Bug::CompleteWithoutLeaseCheck);
                settle(&mut s, c, Settle::Complete { bug })?
            }
            Action::Release(c) => settle(&mut s, c, Settle::Release)?,
            Action::Crash(c) => {
                s.clients[usize::from(c)].held.take()?;
                Answer::Nothing
            }
            Action::Expire => {
                let end = s
                    .record
                    .as_ref()
                    .filter(|r| r.status == Status::InProgress)
                    .map(|r| r.lease_expires_at.as_millis())
                    .filter(|&end| end > s.now)?;
                self.spend(&mut s, EXPIRIES)?;
                s.now = end;
                Answer::Nothing
            }
            Action::JumpClock(c) => {
                let client = &mut s.clients[usize::from(c)];
                if client.skew != 0 {
                    return None;
                }
                client.skew = LEASE_MS;
                self.spend(&mut s, JUMPS)?;
                Answer::Nothing
            }
            Action::Delete => {
                s.record.take()?;
                self.spend(&mut s, DELETES)?;
                s.now += self.bounds.delete_gap;
                (s.ghost.holder, s.ghost.answer) = (None, None);
                Answer::Done(true)
            }
            Action::Reopen => {
                let now = Timestamp::from_millis(s.now);
                let r = s.record.as_mut()?;
                if !(r.status == Status::Completed && r.is_live(now)) {
                    return None;
                }
                let fence = r.fence;
                let reopened = r.reopen_in_place(fence, now);
                self.spend(&mut s, REOPENS)?;
                s.ghost.answer = None;
                Answer::Done(reopened)
            }
            Action::Purge => {
                let end = s.record.take()?.expires_at.as_millis();
                self.spend(&mut s, PURGES)?;
                s.now = s.now.max(end);
                (s.ghost.holder, s.ghost.answer) = (None, None);
                Answer::Nothing
            }
        };
        Some((s, answer))
    }

    /// Counts one more fault of kind `i`, if the bounds allow it.
    fn spend(&self, s: &mut State, i: usize) -> Option<()> {
        let b = &self.bounds;
        let most = [b.expiries, b.clock_jumps, b.deletes, b.reopens, b.purges][i];
        (s.used[i] < most).then(|| s.used[i] += 1)
    }

    fn begin(&self, s: &mut State, c: u8) -> Option<Answer> {
        let client = s.clients[usize::from(c)];
        if client.done || client.held.is_some() || client.begun >= self.bounds.begins {
            return None;
        }
        let now = Timestamp::from_millis(s.now + client.skew);
        let existing = s.record.as_ref();
        let live = existing.is_some_and(|r| r.is_live(now));
        let (took_over, created_again) = (
            existing_was_held(existing),
            existing.is_none() && s.used[DELETES] > 0,
        );
        let mut step = Record::begin(existing, &request(), now, lease_id(c, client.begun));
        if let (BeginOutcome::Acquired(lease), Some(write)) = (&mut step.outcome, &mut step.write) {
            match (self.bug, existing) {
                (Some(Bug::TakeoverKeepsFence), Some(old)) => lease.fence = old.fence,
                (Some(Bug::FencesRestartAtOne), None) => lease.fence = 1,
                _ => {}
            }
            write.fence = lease.fence;
        }
        s.clients[usize::from(c)].begun += 1;
        if let Some(write) = step.write {
            s.record = Some(write);
        }
        Some(match step.outcome {
            BeginOutcome::Acquired(lease) => {
                let g = &mut s.ghost;
                g.acquisitions += 1;
                g.holder = Some(g.acquisitions);
                g.seen[0] |= took_over;
                g.seen[3] |= created_again;
                if !live {
                    g.answer = None;
                }
                s.clients[usize::from(c)].held = Some(Held {
                    id: lease.id,
                    fence: lease.fence,
                    expires_ms: lease.expires_at.as_millis(),
                    seq: g.acquisitions,
                    wrote: false,
                    stepped: false,
                });
                Answer::Acquired(lease.fence)
            }
            BeginOutcome::Replay(replay) => {
                let g = &mut s.ghost;
                g.seen[1] = true;
                g.answer_changed |= g.answer != replay.response.first().copied();
                s.clients[usize::from(c)].done = true;
                Answer::Replay(replay.response, replay.fence)
            }
            BeginOutcome::InProgress { .. } => Answer::InProgress,
            // One request, one fingerprint: the model never sees a mismatch.
            _ => Answer::Mismatch,
        })
    }
}

/// Whether a record found by `begin` had been held by an attempt (a takeover, not a creation).
fn existing_was_held(existing: Option<&Record>) -> bool {
    existing.is_some_and(|r| r.status != Status::Completed)
}

/// A write to the fenced resource: accepted when its fence is at least the highest seen.
fn write(s: &mut State, c: u8) -> Option<Answer> {
    let held = s.clients[usize::from(c)].held.as_mut()?;
    if held.wrote {
        return None;
    }
    held.wrote = true;
    let (seq, fence) = (held.seq, held.fence);
    let g = &mut s.ghost;
    match g.resource {
        Some((_, highest)) if fence < highest => g.seen[2] = true,
        Some((last, highest)) => {
            g.stale_write |= seq < last;
            g.resource = Some((seq.max(last), highest.max(fence)));
        }
        None => g.resource = Some((seq, fence)),
    }
    Some(Answer::Nothing)
}

#[derive(Clone, Copy)]
enum Settle {
    Step,
    Complete { bug: bool },
    Release,
}

/// A step, complete or release by client `c` under the lease it holds.
fn settle(s: &mut State, c: u8, how: Settle) -> Option<Answer> {
    let client = s.clients[usize::from(c)];
    let held = client.held?;
    if matches!(how, Settle::Step) && held.stepped {
        return None;
    }
    let now = Timestamp::from_millis(s.now + client.skew);
    let mut lease = held.lease();
    let taken = match how {
        Settle::Step => {
            s.clients[usize::from(c)].held = Some(Held {
                stepped: true,
                ..held
            });
            match s.record.as_mut() {
                Some(r) => r.record_step_in_place(&lease, &step(c), now).is_ok(),
                None => false,
            }
        }
        Settle::Complete { bug } => {
            if let Some(r) = s
                .record
                .as_ref()
                .filter(|r| bug && r.status == Status::InProgress)
            {
                (lease.id, lease.fence) = (r.lease_id, r.fence);
            }
            let response = Bytes::from(vec![c]);
            let done = Record::complete(s.record.as_ref(), &lease, response, now);
            s.clients[usize::from(c)].held = None;
            match done {
                Ok(write) => {
                    let g = &mut s.ghost;
                    if let Some(write) = write {
                        g.answer_changed |= g.answer.is_some_and(|a| a != c);
                        g.answer = Some(c);
                        s.record = Some(write);
                    }
                    s.clients[usize::from(c)].done = true;
                    true
                }
                Err(_) => false,
            }
        }
        Settle::Release => {
            let done = Record::release(s.record.as_ref(), &lease, now);
            s.clients[usize::from(c)].held = None;
            match done {
                Ok(write) => {
                    if let Some(write) = write {
                        s.record = Some(write);
                    }
                    true
                }
                Err(_) => false,
            }
        }
    };
    let g = &mut s.ghost;
    if taken {
        g.stale_settle |= g.holder != Some(held.seq);
        if !matches!(how, Settle::Step) {
            g.holder = None;
        }
    }
    Some(Answer::Done(taken))
}

impl Model for RecordModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.start()]
    }

    fn actions(&self, _: &State, actions: &mut Vec<Action>) {
        for c in 0..self.bounds.clients {
            actions.extend([
                Action::Begin(c),
                Action::Write(c),
                Action::Step(c),
                Action::Complete(c),
                Action::Release(c),
                Action::Crash(c),
                Action::JumpClock(c),
            ]);
        }
        actions.extend([
            Action::Expire,
            Action::Delete,
            Action::Reopen,
            Action::Purge,
        ]);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        self.apply(last, action).map(|(s, _)| s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "no two attempts hold the key with one fence",
                |_, s: &State| {
                    let mut fences: Vec<u64> = s
                        .clients
                        .iter()
                        .filter_map(|c| c.held)
                        .map(|h| h.fence)
                        .collect();
                    fences.sort_unstable();
                    fences.windows(2).all(|w| w[0] != w[1])
                },
            ),
            Property::always(
                "a stale lease never completes, releases or steps",
                |_, s: &State| !s.ghost.stale_settle,
            ),
            Property::always(
                "a stored answer never changes but by a reopen",
                |_, s: &State| !s.ghost.answer_changed,
            ),
            Property::always(
                "a fenced resource never takes an older attempt's write after a newer one's",
                |_, s: &State| !s.ghost.stale_write,
            ),
            Property::sometimes("a lease is taken over", |_, s: &State| s.ghost.seen[0]),
            Property::sometimes("a retry is given the stored answer", |_, s: &State| {
                s.ghost.seen[1]
            }),
            Property::sometimes("a stale attempt's write is refused", |_, s: &State| {
                s.ghost.seen[2]
            }),
            Property::sometimes("a deleted record is created again", |_, s: &State| {
                s.ghost.seen[3]
            }),
        ]
    }
}
