//! The record operations of a [`Store`](idem_core::Store) as a sequential specification, for
//! stateright's [`LinearizabilityTester`](stateright::semantics::LinearizabilityTester).
//!
//! A store is linearizable when every history of concurrent calls (each with its invocation and
//! its answer) can be put in one order that keeps the order of calls that did not overlap, and
//! in which every answer is what [`RecordSpec`] answers: the real state machine of `idem-core`
//! ([`Record::begin`], [`Record::complete`], [`Record::release`], `renew_in_place`,
//! `record_step_in_place`, [`Record::is_live`]) applied to one record per key, one call at a
//! time. Each call carries its own `now`, as the store API does, so an answer that depends on
//! the clock (a lease that ran out, a takeover) is a function of the call and the record alone.
//!
//! The one answer the state machine does not decide is the id of an acquired lease: a store
//! draws it. [`RecordSpec`] takes the id a `begin` answered with and checks everything else.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseId, Record, StaleLease, Step, StepRefused,
    Timestamp,
};
use stateright::semantics::SequentialSpec;

/// A call on a store's records.
#[derive(Debug, Clone)]
pub enum Op {
    /// [`Store::begin`](idem_core::Store::begin).
    Begin {
        /// The request.
        req: BeginRequest,
        /// The caller's clock.
        now: Timestamp,
    },
    /// [`Store::complete`](idem_core::Store::complete).
    Complete {
        /// The record's key.
        key: Key,
        /// The lease the caller completes with.
        lease: Lease,
        /// The answer it stores.
        response: Bytes,
        /// The caller's clock.
        now: Timestamp,
    },
    /// [`Store::release`](idem_core::Store::release).
    Release {
        /// The record's key.
        key: Key,
        /// The lease the caller gives back.
        lease: Lease,
        /// The caller's clock.
        now: Timestamp,
    },
    /// [`Store::renew`](idem_core::Store::renew).
    Renew {
        /// The record's key.
        key: Key,
        /// The lease the caller extends.
        lease: Lease,
        /// For how long from `now`.
        length: Duration,
        /// The caller's clock.
        now: Timestamp,
    },
    /// [`Store::record_step`](idem_core::Store::record_step).
    Step {
        /// The record's key.
        key: Key,
        /// The lease the caller records under.
        lease: Lease,
        /// The step.
        step: Step,
        /// The caller's clock.
        now: Timestamp,
    },
    /// [`Store::get`](idem_core::Store::get).
    Get {
        /// The record's key.
        key: Key,
        /// The caller's clock.
        now: Timestamp,
    },
}

/// What a call answered, as far as the state machine decides it. A store's failure (whose
/// effect is unknown) is no answer: such a call stays in flight, and the tester may take it
/// as done at any point after its invocation, or never.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ret {
    /// What `begin` answered.
    Begun(BeginOutcome),
    /// What `complete` or `release` answered.
    Settled(Result<(), StaleLease>),
    /// What `renew` answered: the lease with its new end, or a refusal.
    Renewed(Result<Lease, StaleLease>),
    /// What `record_step` answered.
    Stepped(Result<(), StepRefused>),
    /// What `get` answered: the live record, if any.
    Got(Option<Record>),
}

/// The records of a store, one per key, changed one call at a time by the real state machine.
#[derive(Debug, Clone, Default)]
pub struct RecordSpec {
    /// Every record written so far, live or not (a store keeps them until a purge, which the
    /// specification has no call for).
    records: Vec<Record>,
}

impl RecordSpec {
    /// No records.
    pub fn new() -> Self {
        Self::default()
    }

    fn record(&self, key: &Key) -> Option<&Record> {
        self.records.iter().find(|r| &r.key == key)
    }

    fn put(&mut self, record: Record) {
        match self.records.iter_mut().find(|r| r.key == record.key) {
            Some(r) => *r = record,
            None => self.records.push(record),
        }
    }

    /// Applies `op`, with `id` as the id of the lease a `begin` acquires, and answers what a
    /// store must: a store of its own for tests (behind a lock, one call at a time).
    pub fn apply(&mut self, op: &Op, id: LeaseId) -> Ret {
        match op {
            Op::Begin { req, now } => {
                let step = Record::begin(self.record(&req.key), req, *now, id);
                if let Some(write) = step.write {
                    self.put(write);
                }
                Ret::Begun(step.outcome)
            }
            Op::Complete {
                key,
                lease,
                response,
                now,
            } => {
                let done = Record::complete(self.record(key), lease, response.clone(), *now);
                self.settle(done)
            }
            Op::Release { key, lease, now } => {
                let done = Record::release(self.record(key), lease, *now);
                self.settle(done)
            }
            Op::Renew {
                key,
                lease,
                length,
                now,
            } => Ret::Renewed(self.in_place(key, |r| r.renew_in_place(lease, *length, *now))),
            Op::Step {
                key,
                lease,
                step,
                now,
            } => Ret::Stepped(
                self.in_place(key, |r| r.record_step_in_place(lease, step, *now).map(drop)),
            ),
            Op::Get { key, now } => Ret::Got(self.record(key).filter(|r| r.is_live(*now)).cloned()),
        }
    }

    /// The answer of a `complete` or `release` that decided `done`, whose record it stores.
    fn settle(&mut self, done: Result<Option<Record>, StaleLease>) -> Ret {
        Ret::Settled(done.map(|write| {
            if let Some(r) = write {
                self.put(r);
            }
        }))
    }

    /// `change` applied to the record of `key`, which it may leave changed only when it
    /// succeeds; a stale lease when there is no record.
    fn in_place<T, E: From<StaleLease>>(
        &mut self,
        key: &Key,
        change: impl FnOnce(&mut Record) -> Result<T, E>,
    ) -> Result<T, E> {
        let r = self
            .records
            .iter_mut()
            .find(|r| &r.key == key)
            .ok_or(StaleLease)?;
        let mut changed = r.clone();
        let answer = change(&mut changed)?;
        *r = changed;
        Ok(answer)
    }
}

impl SequentialSpec for RecordSpec {
    type Op = Op;
    type Ret = Ret;

    /// The answer `op` gets; an acquired lease's id is all zeros (it is never compared: an
    /// invocation that is still in flight has handed its lease to nobody).
    fn invoke(&mut self, op: &Op) -> Ret {
        self.apply(op, LeaseId::from_bytes([0; 16]))
    }

    /// Whether `op` may answer `ret`: the same as [`Self::invoke`], but with the id of the
    /// lease that `ret` acquired, if it acquired one.
    ///
    /// A record past its retention may be gone already: a store may forget it at any time
    /// (Redis's own expiry, a purge), and a `begin` then creates the record afresh, with a
    /// fence of the clock's ([`idem_core::Lease::first_fence`]) rather than one above the
    /// forgotten record's. Either answer is valid.
    fn is_valid_step(&mut self, op: &Op, ret: &Ret) -> bool {
        let id = match ret {
            Ret::Begun(BeginOutcome::Acquired(lease)) => lease.id,
            _ => LeaseId::from_bytes([0; 16]),
        };
        let Op::Begin { req, now } = op else {
            return &self.apply(op, id) == ret;
        };
        let before = self.clone();
        if &self.apply(op, id) == ret {
            return true;
        }
        *self = before;
        let dead = |r: &Record| r.key == req.key && !r.is_live(*now);
        if !self.records.iter().any(dead) {
            return false;
        }
        self.records.retain(|r| !dead(r));
        &self.apply(op, id) == ret
    }
}
