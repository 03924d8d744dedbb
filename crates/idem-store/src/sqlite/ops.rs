//! The operations the writer thread runs, in one place: what each asks (`Request`), where its
//! answer goes (`Responder`) and the answer (`Answer`), and `apply`, which runs one inside the
//! batch's transaction by the function that does it (`records`, `admin`'s repair, `locks`).
//! Those files do not import this one: the store sends operations (`mod.rs`), the writer runs
//! them (`writer.rs`), and this sits between.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, LockError, LockName, Record, Repair,
    Shown, Step, StepError, StoreError, Timestamp,
};
use tokio::sync::oneshot;

use super::admin::apply_repair;
use super::locks::{LockAnswer, LockOp, apply_lock};
use super::records;
use super::schema::store_error;

/// One operation for the writer thread: what to do, and where to send the answer.
pub(super) struct Op {
    pub(super) request: Request,
    pub(super) responder: Responder,
}

pub(super) enum Request {
    Begin(BeginRequest, Timestamp),
    Complete(Key, Lease, Bytes, Timestamp),
    Release(Key, Lease, Timestamp),
    Renew(Key, Lease, Duration, Timestamp),
    Step(Key, Lease, Step, Timestamp),
    Advance(Key, u64),
    Raise(Key, u64),
    Reopen(Key, u64, Timestamp),
    Get(Key, Timestamp),
    Purge(Timestamp, usize),
    Lock(LockName, LockOp),
    /// An operator's repair, fenced by what was shown; answered as `Reopen` is (whether it
    /// changed the record).
    Repair(Key, Shown, Repair, Timestamp),
}

pub(super) enum Responder {
    Begin(oneshot::Sender<Result<BeginOutcome, StoreError>>),
    Lease(oneshot::Sender<Result<(), LeaseError>>),
    Renew(oneshot::Sender<Result<Lease, LeaseError>>),
    Step(oneshot::Sender<Result<(), StepError>>),
    Advance(oneshot::Sender<Result<u64, StoreError>>),
    Reopen(oneshot::Sender<Result<bool, StoreError>>),
    Get(oneshot::Sender<Result<Option<Record>, StoreError>>),
    Purge(oneshot::Sender<Result<u64, StoreError>>),
    Lock(oneshot::Sender<Result<LockAnswer, LockError>>),
}

pub(super) enum Answer {
    Begin(Result<BeginOutcome, StoreError>),
    Lease(Result<(), LeaseError>),
    Renew(Result<Lease, LeaseError>),
    Step(Result<(), StepError>),
    Advance(Result<u64, StoreError>),
    Reopen(Result<bool, StoreError>),
    Get(Result<Option<Record>, StoreError>),
    Purge(Result<u64, StoreError>),
    Lock(Result<LockAnswer, LockError>),
}

impl Request {
    /// Whether the operation is of no use once its caller has stopped waiting (a claim, a lock
    /// or a read); writes of a result (complete, release) are made regardless: the work is
    /// done.
    pub(super) fn only_for_its_caller(&self) -> bool {
        matches!(
            self,
            Request::Begin(..)
                | Request::Get(..)
                | Request::Purge(..)
                | Request::Lock(_, LockOp::Acquire(..))
        )
    }
}

/// Runs one operation inside the batch's transaction. `Err` is a SQL failure that aborts the
/// whole batch; refusals and corrupt rows are part of the answer.
pub(super) fn apply(tx: &rusqlite::Transaction<'_>, request: &Request) -> rusqlite::Result<Answer> {
    Ok(match request {
        Request::Begin(req, now) => Answer::Begin(records::begin(tx, req, *now)?),
        Request::Complete(key, lease, response, now) => {
            Answer::Lease(records::complete(tx, key, lease, response, *now)?)
        }
        Request::Release(key, lease, now) => Answer::Lease(records::release(tx, key, lease, *now)?),
        Request::Step(key, lease, step, now) => {
            Answer::Step(records::record_step(tx, key, lease, step, *now)?)
        }
        Request::Renew(key, lease, length, now) => {
            Answer::Renew(records::renew(tx, key, lease, *length, *now)?)
        }
        Request::Advance(key, by) => Answer::Advance(records::advance(tx, key, *by)?),
        Request::Raise(key, to) => Answer::Advance(records::raise(tx, key, *to)?),
        Request::Reopen(key, fence, now) => Answer::Reopen(records::reopen(tx, key, *fence, *now)?),
        Request::Get(key, now) => Answer::Get(records::get(tx, key, *now)?),
        Request::Purge(now, limit) => Answer::Purge(records::purge(tx, *now, *limit)?),
        Request::Lock(name, op) => Answer::Lock(apply_lock(tx, name, op)?),
        Request::Repair(key, shown, repair, now) => {
            Answer::Reopen(apply_repair(tx, key, *shown, *repair, *now)?)
        }
    })
}

impl Responder {
    /// Whether the caller has stopped waiting.
    pub(super) fn is_closed(&self) -> bool {
        match self {
            Responder::Begin(tx) => tx.is_closed(),
            Responder::Lease(tx) => tx.is_closed(),
            Responder::Renew(tx) => tx.is_closed(),
            Responder::Step(tx) => tx.is_closed(),
            Responder::Advance(tx) => tx.is_closed(),
            Responder::Reopen(tx) => tx.is_closed(),
            Responder::Get(tx) => tx.is_closed(),
            Responder::Purge(tx) => tx.is_closed(),
            Responder::Lock(tx) => tx.is_closed(),
        }
    }

    /// Sends the answer; gives it back if the caller has gone.
    pub(super) fn send(self, answer: Answer) -> Option<Answer> {
        match (self, answer) {
            (Responder::Begin(tx), Answer::Begin(a)) => tx.send(a).err().map(Answer::Begin),
            (Responder::Lease(tx), Answer::Lease(a)) => tx.send(a).err().map(Answer::Lease),
            (Responder::Renew(tx), Answer::Renew(a)) => tx.send(a).err().map(Answer::Renew),
            (Responder::Step(tx), Answer::Step(a)) => tx.send(a).err().map(Answer::Step),
            (Responder::Advance(tx), Answer::Advance(a)) => tx.send(a).err().map(Answer::Advance),
            (Responder::Reopen(tx), Answer::Reopen(a)) => tx.send(a).err().map(Answer::Reopen),
            (Responder::Get(tx), Answer::Get(a)) => tx.send(a).err().map(Answer::Get),
            (Responder::Purge(tx), Answer::Purge(a)) => tx.send(a).err().map(Answer::Purge),
            (Responder::Lock(tx), Answer::Lock(a)) => tx.send(a).err().map(Answer::Lock),
            // `apply` answers each request with its own kind; nothing else reaches here.
            (_, answer) => Some(answer),
        }
    }

    /// Tells the caller that its batch failed.
    pub(super) fn fail(self, e: &rusqlite::Error) {
        let e = store_error(e);
        let _ = match self {
            Responder::Begin(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Lease(tx) => tx.send(Err(e.into())).map_err(drop),
            Responder::Renew(tx) => tx.send(Err(e.into())).map_err(drop),
            Responder::Step(tx) => tx.send(Err(e.into())).map_err(drop),
            Responder::Advance(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Reopen(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Get(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Purge(tx) => tx.send(Err(e)).map_err(drop),
            Responder::Lock(tx) => tx.send(Err(e.into())).map_err(drop),
        };
    }
}
