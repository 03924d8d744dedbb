//! One message, the broker that delivers it until it is acked, and the consumers that claim,
//! handle, record and ack it: `idem-mq`'s consumer and `idem relay`.
//!
//! The order is `decide` in `idem-mq/src/consumer/decide.rs` over `Once::run` in
//! `idem/src/run.rs`, settled by `process_in` in `idem-mq/src/consumer/run.rs`:
//!
//! 1. **Claim**: `begin` the message's key. A stored result is acked without running; a key
//!    held by another attempt is requeued; an acquisition runs the handler.
//! 2. **Handle**. In plain mode the handler's effect is outside the store: `idem relay`'s POST
//!    (`idem-gateway/src/relay/mod.rs`) carries the attempt's fence in `Idem-Fence`, and the
//!    model's downstream is a ledger that keeps the effect with the highest fence and refuses a
//!    lower one. In inbox mode (`idem-mq/src/inbox.rs`) the handler writes in a transaction
//!    that also completes the record (`complete_in`) and commits both at once, or neither.
//! 3. **Record**: `complete` with the result (in inbox mode it is already there, and `run`'s
//!    own `complete` changes nothing). Refused as stale, the delivery is requeued; a retryable
//!    failure releases the key and requeues.
//! 4. **Ack** (or requeue).
//!
//! Whether a delivery is acked or requeued is not written again here: the model asks the
//! consumer's own table, [`idem_mq::verdict`], with the way the run ended ([`RunEnd`]), so a
//! wrong entry in the table that ships, for any end the model reaches (all but a mismatch and
//! an undecodable result: one message, one payload), breaks the model's properties.
//!
//! The record is idem-core's state machine ([`Record::begin`], `complete`, `release`). Around
//! them: a consumer crashes at any point (the broker takes its delivery back), the store fails
//! to take a result (`complete`, or in inbox mode the transaction's commit), a lease runs
//! out while a consumer is paused, the broker's redelivery timer gives a delivery to another
//! consumer while the first still works on it, and the publisher sends the message twice.
//! The keep-alive that renews a running handler's lease is not modelled: a paused consumer does
//! not renew, and the model lets a lease run out at any point.

use std::hash::{Hash, Hasher};

use idem_core::{BeginOutcome, Bytes, Lease, LeaseId, Record, Status, Timestamp};
use idem_mq::RunEnd;
use stateright::{Model, Property};

use crate::record::{START_MS, hash_record, request};

/// How the handler's effect is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The effect is outside the store, at a resource that refuses a lower fence
    /// (`idem relay`, a plain `Consumer`).
    Plain,
    /// The effect commits with the record, in one transaction (`idem_mq::inbox`).
    Inbox,
}

/// How far the delivery model is explored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeliveryBounds {
    /// Consumers sharing the queue.
    pub consumers: u8,
    /// Claims (`begin`s) per consumer.
    pub begins: u8,
    /// Consumer crashes, in all.
    pub crashes: u8,
    /// Times the clock runs to the end of the record's lease.
    pub expiries: u8,
    /// Times the broker's redelivery timer fires for a delivery still being worked on.
    pub timers: u8,
    /// Extra copies of the message the publisher sends.
    pub duplicates: u8,
    /// Times the store fails to take a handled message's result.
    pub store_failures: u8,
}

impl DeliveryBounds {
    /// What CI checks: two consumers, two crashes and two lease expiries, every other fault
    /// once.
    pub const SMALL: Self = Self {
        consumers: 2,
        begins: 2,
        crashes: 2,
        expiries: 2,
        timers: 1,
        duplicates: 1,
        store_failures: 1,
    };
    /// The documented longer run: a third consumer, with one lease expiry (with two, the
    /// search needs more than 3.5 GiB).
    pub const LARGE: Self = Self {
        consumers: 3,
        expiries: 1,
        ..Self::SMALL
    };
}

/// A defect planted in the consumer, to show that the properties catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeliveryBug {
    /// The delivery is acked once the handler has run, before its result is recorded (in inbox
    /// mode: before the transaction commits).
    AckBeforeRecord,
    /// A delivery that finds its key held by another attempt is acked instead of requeued.
    AckWhileInProgress,
    /// Inbox mode: the handler's writes commit on their own, before the record is completed.
    CommitApart,
    /// Plain mode: the handler's request carries no fence, so the resource takes every write.
    PostWithoutFence,
    /// The consumer's table acks a delivery whose result the store did not take
    /// (`RunEnd::NotRecorded`), as if planted in `idem_mq::verdict`.
    AckNotRecorded,
}

/// The delivery model: mode, bounds, and a planted bug or none.
#[derive(Debug, Clone, Copy)]
pub struct DeliveryModel {
    /// Plain or inbox.
    pub mode: Mode,
    /// How far to explore.
    pub bounds: DeliveryBounds,
    /// A defect to plant, or none: the consumer as it ships.
    pub bug: Option<DeliveryBug>,
}

/// A lease a consumer holds for the message's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claimed {
    /// The lease.
    pub id: LeaseId,
    /// Its fence.
    pub fence: u64,
    /// Its end, in milliseconds.
    pub expires_ms: u64,
    /// Which acquisition of the key this is, counted by the model.
    pub seq: u32,
}

impl Claimed {
    fn lease(&self) -> Lease {
        Lease {
            id: self.id,
            fence: self.fence,
            expires_at: Timestamp::from_millis(self.expires_ms),
        }
    }
}

/// Where a consumer is with its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Phase {
    /// No delivery.
    #[default]
    Idle,
    /// A delivery received, its key not yet claimed.
    Received,
    /// The key claimed; the handler runs.
    Running(Claimed),
    /// The handler's effect is done (plain mode, or inbox with its writes committed apart);
    /// the result is not yet recorded.
    Handled(Claimed),
    /// Decided: ack (`true`) or requeue (`false`); not yet told to the broker.
    Settling(bool),
}

/// One consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Consumer {
    /// Where it is.
    pub phase: Phase,
    /// Which copy of the message it works on (meaningful unless idle).
    pub copy: u8,
    /// Claims so far.
    pub begun: u8,
}

/// A copy of the message in the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Copy {
    /// Waiting to be delivered.
    Ready,
    /// Delivered to this consumer, not yet settled.
    With(u8),
    /// Acked: the broker has forgotten it.
    Acked,
}

/// What the model remembers about the history, to state the properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeliveryGhost {
    /// Acquisitions of the key so far.
    pub acquisitions: u32,
    /// Handler runs whose effect happened (plain) or committed (inbox).
    pub effects: u32,
    /// The acquisition whose effect the resource counts, and the highest fence it took.
    pub counted: Option<(u32, u64)>,
    /// The acquisition whose result the record stores.
    pub recorded: Option<u32>,
    /// A second effect was counted (committed twice, in inbox mode).
    pub double: bool,
    /// A copy was acked without the result recorded and an effect done.
    pub acked_unrecorded: bool,
    /// Reached: a takeover, a redelivery acked without running, a stale attempt's effect
    /// refused, every copy acked, a result the store did not take.
    pub seen: [bool; 5],
}

/// The delivery model's state.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryState {
    /// The clock, in milliseconds.
    pub now: u64,
    /// The message's record.
    pub record: Option<Record>,
    /// The copies of the message in the broker.
    pub copies: Vec<Copy>,
    /// The consumers.
    pub consumers: Vec<Consumer>,
    /// Faults used: crashes, expiries, timers, duplicates, store failures.
    pub used: [u8; 5],
    /// The history, as far as the properties need it.
    pub ghost: DeliveryGhost,
}

impl Hash for DeliveryState {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.now.hash(h);
        hash_record(self.record.as_ref(), h);
        self.copies.hash(h);
        self.consumers.hash(h);
        self.used.hash(h);
        self.ghost.hash(h);
    }
}

/// A step of the delivery model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeliveryAction {
    /// Consumer `c` receives a ready copy.
    Receive(u8),
    /// Consumer `c` claims the message's key.
    Claim(u8),
    /// Consumer `c`'s handler does its effect (in inbox mode: writes, completes the record in
    /// the transaction, and commits).
    Handle(u8),
    /// Consumer `c`'s handler fails in a retryable way before any effect: the key is released.
    Fail(u8),
    /// Consumer `c` records the result (`complete`).
    Complete(u8),
    /// The store fails to take consumer `c`'s result: its `complete` (plain mode), or its
    /// transaction's commit (inbox mode: the handler's writes roll back with it). The record
    /// stays in progress.
    StoreFails(u8),
    /// With [`DeliveryBug::AckBeforeRecord`]: consumer `c` acks before recording.
    AckEarly(u8),
    /// Consumer `c` acks or requeues its delivery, as decided.
    Settle(u8),
    /// Consumer `c` crashes: the broker takes its delivery back.
    Crash(u8),
    /// Time runs to the end of the record's lease.
    Expire,
    /// The broker's redelivery timer takes copy `i` back from the consumer that has it.
    Redeliver(u8),
    /// The publisher sends the message again.
    Publish,
}

/// The lease id of consumer `c`'s `n`-th claim.
fn lease_id(c: u8, n: u8) -> LeaseId {
    let mut b = [0; 16];
    (b[0], b[1], b[15]) = (c, n, 2);
    LeaseId::from_bytes(b)
}

const CRASHES: usize = 0;
const EXPIRIES: usize = 1;
const TIMERS: usize = 2;
const DUPLICATES: usize = 3;
const STORE_FAILURES: usize = 4;

/// Every acked message has its effect done and its result recorded.
pub const ACKED_RECORDED: &str = "an acked message has its effect done and its result recorded";
/// Effects are counted at most once, and the one counted is the one recorded.
pub const ONE_EFFECT: &str = "one effect counts, and it is the recorded one";

impl DeliveryModel {
    /// The consumer as it ships, in `mode`.
    pub fn new(mode: Mode, bounds: DeliveryBounds) -> Self {
        Self {
            mode,
            bounds,
            bug: None,
        }
    }

    /// The same model with `bug` planted.
    pub fn with_bug(self, bug: DeliveryBug) -> Self {
        Self {
            bug: Some(bug),
            ..self
        }
    }

    /// The first state: one copy of the message ready, no record.
    pub fn start(&self) -> DeliveryState {
        DeliveryState {
            now: START_MS,
            record: None,
            copies: vec![Copy::Ready],
            consumers: vec![Consumer::default(); usize::from(self.bounds.consumers)],
            used: [0; 5],
            ghost: DeliveryGhost::default(),
        }
    }

    fn spend(&self, s: &mut DeliveryState, i: usize) -> Option<()> {
        let b = &self.bounds;
        let most = [
            b.crashes,
            b.expiries,
            b.timers,
            b.duplicates,
            b.store_failures,
        ][i];
        (s.used[i] < most).then(|| s.used[i] += 1)
    }

    /// Whether the consumer acks a delivery whose run ended as `end`: its own table
    /// ([`idem_mq::verdict`]), or a planted bug's.
    fn acks(&self, end: RunEnd) -> bool {
        match (self.bug, end) {
            (Some(DeliveryBug::AckWhileInProgress), RunEnd::InProgress)
            | (Some(DeliveryBug::AckNotRecorded), RunEnd::NotRecorded) => true,
            _ => idem_mq::verdict(end).acks(),
        }
    }

    /// Takes `action` from `last`: the next state, or `None` if the action is not possible.
    pub fn apply(&self, last: &DeliveryState, action: DeliveryAction) -> Option<DeliveryState> {
        let mut s = last.clone();
        let now = Timestamp::from_millis(s.now);
        match action {
            DeliveryAction::Receive(c) => {
                if s.consumers[usize::from(c)].phase != Phase::Idle {
                    return None;
                }
                let i = s.copies.iter().position(|k| *k == Copy::Ready)?;
                s.copies[i] = Copy::With(c);
                let consumer = &mut s.consumers[usize::from(c)];
                consumer.phase = Phase::Received;
                consumer.copy = u8::try_from(i).ok()?;
            }
            DeliveryAction::Claim(c) => self.claim(&mut s, c, now)?,
            DeliveryAction::Handle(c) => self.handle(&mut s, c, now)?,
            DeliveryAction::Fail(c) => {
                let Phase::Running(claimed) = s.consumers[usize::from(c)].phase else {
                    return None;
                };
                if let Ok(Some(write)) = Record::release(s.record.as_ref(), &claimed.lease(), now) {
                    s.record = Some(write);
                }
                s.consumers[usize::from(c)].phase = Phase::Settling(self.acks(RunEnd::Failed));
            }
            DeliveryAction::Complete(c) => {
                let Phase::Handled(claimed) = s.consumers[usize::from(c)].phase else {
                    return None;
                };
                let response = Bytes::from(vec![c]);
                let done = Record::complete(s.record.as_ref(), &claimed.lease(), response, now);
                let end = match done {
                    Ok(write) => {
                        if let Some(write) = write {
                            s.record = Some(write);
                            s.ghost.recorded = Some(claimed.seq);
                        }
                        RunEnd::Handled
                    }
                    // `RunError::LeaseLost`.
                    Err(_) => RunEnd::Unsettled,
                };
                s.consumers[usize::from(c)].phase = Phase::Settling(self.acks(end));
            }
            DeliveryAction::StoreFails(c) => {
                let stored_by = matches!(
                    (self.mode, s.consumers[usize::from(c)].phase),
                    (Mode::Plain, Phase::Handled(_)) | (Mode::Inbox, Phase::Running(_))
                );
                if !stored_by {
                    return None;
                }
                self.spend(&mut s, STORE_FAILURES)?;
                s.ghost.seen[4] = true;
                s.consumers[usize::from(c)].phase = Phase::Settling(self.acks(RunEnd::NotRecorded));
            }
            DeliveryAction::AckEarly(c) => {
                if self.bug != Some(DeliveryBug::AckBeforeRecord) {
                    return None;
                }
                let consumer = s.consumers[usize::from(c)];
                let early = matches!(
                    (self.mode, consumer.phase),
                    (Mode::Plain, Phase::Handled(_)) | (Mode::Inbox, Phase::Running(_))
                );
                if !early || s.copies[usize::from(consumer.copy)] == Copy::Acked {
                    return None;
                }
                ack(&mut s, consumer.copy);
            }
            DeliveryAction::Settle(c) => {
                let consumer = s.consumers[usize::from(c)];
                let Phase::Settling(acked) = consumer.phase else {
                    return None;
                };
                let copy = usize::from(consumer.copy);
                if acked {
                    if s.copies[copy] != Copy::Acked {
                        ack(&mut s, consumer.copy);
                    }
                } else if s.copies[copy] == Copy::With(c) {
                    s.copies[copy] = Copy::Ready;
                }
                s.consumers[usize::from(c)].phase = Phase::Idle;
            }
            DeliveryAction::Crash(c) => {
                let consumer = s.consumers[usize::from(c)];
                if consumer.phase == Phase::Idle {
                    return None;
                }
                self.spend(&mut s, CRASHES)?;
                let copy = usize::from(consumer.copy);
                if s.copies[copy] == Copy::With(c) {
                    s.copies[copy] = Copy::Ready;
                }
                s.consumers[usize::from(c)].phase = Phase::Idle;
            }
            DeliveryAction::Expire => {
                let end = s
                    .record
                    .as_ref()
                    .filter(|r| r.status == Status::InProgress)
                    .map(|r| r.lease_expires_at.as_millis())
                    .filter(|&end| end > s.now)?;
                self.spend(&mut s, EXPIRIES)?;
                s.now = end;
            }
            DeliveryAction::Redeliver(i) => {
                let copy = s.copies.get_mut(usize::from(i))?;
                if !matches!(copy, Copy::With(_)) {
                    return None;
                }
                *copy = Copy::Ready;
                self.spend(&mut s, TIMERS)?;
            }
            DeliveryAction::Publish => {
                self.spend(&mut s, DUPLICATES)?;
                s.copies.push(Copy::Ready);
            }
        }
        Some(s)
    }

    fn claim(&self, s: &mut DeliveryState, c: u8, now: Timestamp) -> Option<()> {
        let consumer = s.consumers[usize::from(c)];
        if consumer.phase != Phase::Received || consumer.begun >= self.bounds.begins {
            return None;
        }
        let existing = s.record.as_ref();
        let took_over = existing.is_some_and(|r| r.status == Status::InProgress);
        let step = Record::begin(existing, &request(), now, lease_id(c, consumer.begun));
        s.consumers[usize::from(c)].begun += 1;
        if let Some(write) = step.write {
            s.record = Some(write);
        }
        let phase = match step.outcome {
            BeginOutcome::Acquired(lease) => {
                let g = &mut s.ghost;
                g.acquisitions += 1;
                g.seen[0] |= took_over;
                Phase::Running(Claimed {
                    id: lease.id,
                    fence: lease.fence,
                    expires_ms: lease.expires_at.as_millis(),
                    seq: g.acquisitions,
                })
            }
            BeginOutcome::Replay(_) => {
                s.ghost.seen[1] = true;
                Phase::Settling(self.acks(RunEnd::Replayed))
            }
            // Waited for, then settled as the table says.
            BeginOutcome::InProgress { .. } => Phase::Settling(self.acks(RunEnd::InProgress)),
            // One message, one fingerprint.
            _ => return None,
        };
        s.consumers[usize::from(c)].phase = phase;
        Some(())
    }

    fn handle(&self, s: &mut DeliveryState, c: u8, now: Timestamp) -> Option<()> {
        let Phase::Running(claimed) = s.consumers[usize::from(c)].phase else {
            return None;
        };
        let g = &mut s.ghost;
        let phase = match (self.mode, self.bug) {
            (Mode::Plain, bug) => {
                g.effects += 1;
                let fenced = bug != Some(DeliveryBug::PostWithoutFence);
                match g.counted {
                    Some((_, highest)) if fenced && claimed.fence < highest => g.seen[2] = true,
                    _ => g.counted = Some((claimed.seq, claimed.fence)),
                }
                Phase::Handled(claimed)
            }
            (Mode::Inbox, Some(DeliveryBug::CommitApart)) => {
                commit_effect(g, claimed);
                Phase::Handled(claimed)
            }
            (Mode::Inbox, _) => {
                let response = Bytes::from(vec![c]);
                match Record::complete(s.record.as_ref(), &claimed.lease(), response, now) {
                    Ok(write) => {
                        commit_effect(g, claimed);
                        if let Some(write) = write {
                            s.record = Some(write);
                            s.ghost.recorded = Some(claimed.seq);
                        }
                        Phase::Settling(self.acks(RunEnd::Handled))
                    }
                    Err(_) => {
                        // Rolled back; `run` releases the key (refused: the lease is stale)
                        // and the delivery is requeued.
                        g.seen[2] = true;
                        if let Ok(Some(write)) =
                            Record::release(s.record.as_ref(), &claimed.lease(), now)
                        {
                            s.record = Some(write);
                        }
                        Phase::Settling(self.acks(RunEnd::Unsettled))
                    }
                }
            }
        };
        s.consumers[usize::from(c)].phase = phase;
        Some(())
    }
}

/// An effect committed in the business database (inbox mode).
fn commit_effect(g: &mut DeliveryGhost, claimed: Claimed) {
    g.effects += 1;
    g.double |= g.counted.is_some();
    g.counted = Some((claimed.seq, claimed.fence));
}

/// Acks copy `i`: the broker forgets it. The effect must be done and the result recorded.
fn ack(s: &mut DeliveryState, i: u8) {
    s.copies[usize::from(i)] = Copy::Acked;
    let recorded = s
        .record
        .as_ref()
        .is_some_and(|r| r.status == Status::Completed);
    let g = &mut s.ghost;
    g.acked_unrecorded |= !(recorded && g.effects > 0);
    g.seen[3] |= s.copies.iter().all(|k| *k == Copy::Acked);
}

impl Model for DeliveryModel {
    type State = DeliveryState;
    type Action = DeliveryAction;

    fn init_states(&self) -> Vec<DeliveryState> {
        vec![self.start()]
    }

    fn actions(&self, s: &DeliveryState, actions: &mut Vec<DeliveryAction>) {
        for c in 0..self.bounds.consumers {
            actions.extend([
                DeliveryAction::Receive(c),
                DeliveryAction::Claim(c),
                DeliveryAction::Handle(c),
                DeliveryAction::Fail(c),
                DeliveryAction::Complete(c),
                DeliveryAction::StoreFails(c),
                DeliveryAction::AckEarly(c),
                DeliveryAction::Settle(c),
                DeliveryAction::Crash(c),
            ]);
        }
        for i in 0..s.copies.len() {
            actions.extend(u8::try_from(i).ok().map(DeliveryAction::Redeliver));
        }
        actions.extend([DeliveryAction::Expire, DeliveryAction::Publish]);
    }

    fn next_state(&self, last: &DeliveryState, action: DeliveryAction) -> Option<DeliveryState> {
        self.apply(last, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ACKED_RECORDED, |_, s: &DeliveryState| {
                !s.ghost.acked_unrecorded
            }),
            Property::always(ONE_EFFECT, |_, s: &DeliveryState| {
                let g = &s.ghost;
                !g.double && g.recorded.is_none_or(|r| g.counted.map(|c| c.0) == Some(r))
            }),
            Property::sometimes("a lease is taken over", |_, s: &DeliveryState| {
                s.ghost.seen[0]
            }),
            Property::sometimes(
                "a redelivery is acked without running",
                |_, s: &DeliveryState| s.ghost.seen[1],
            ),
            Property::sometimes(
                "a stale attempt's effect is refused",
                |_, s: &DeliveryState| s.ghost.seen[2],
            ),
            Property::sometimes("every copy is acked", |_, s: &DeliveryState| {
                s.ghost.seen[3]
            }),
            Property::sometimes(
                "the store fails to take a result",
                |_, s: &DeliveryState| s.ghost.seen[4],
            ),
        ]
    }
}
