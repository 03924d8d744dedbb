use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, Store, StoreError, Timestamp,
};

/// A store operation, for choosing where a [`Fault`] strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `begin`
    Begin,
    /// `complete`
    Complete,
    /// `release`
    Release,
    /// `renew`
    Renew,
    /// `reopen`
    Reopen,
    /// `get`
    Get,
    /// `purge_expired`
    Purge,
    /// `advance`
    Advance,
    /// `raise`
    Raise,
}

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The operation fails before it reaches the store: nothing changes.
    Unavailable,
    /// The operation takes effect in the store, but its answer is lost: the caller sees an
    /// error (a timeout after the commit).
    LostReply,
    /// The operation takes effect in the store at once, and its answer arrives after this
    /// long: a caller that gives up meanwhile leaves the effect behind.
    SlowReply(std::time::Duration),
}

/// Wraps a store and fails operations on demand. Clones share the same schedule.
#[derive(Clone)]
pub struct FaultyStore<S> {
    inner: S,
    plan: Arc<Mutex<VecDeque<(Op, Fault)>>>,
    down: Arc<AtomicBool>,
}

impl<S: Store> FaultyStore<S> {
    /// Wraps `inner`; nothing fails until told to.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            plan: Arc::default(),
            down: Arc::default(),
        }
    }

    /// The next `op` fails with `fault` (faults are used up in the order they were planned).
    pub fn fail_next(&self, op: Op, fault: Fault) {
        self.plan.lock().unwrap().push_back((op, fault));
    }

    /// While `down`, every operation fails with `Unavailable` before reaching the store.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn fault_for(&self, op: Op) -> Option<Fault> {
        if self.down.load(Ordering::SeqCst) {
            return Some(Fault::Unavailable);
        }
        let mut plan = self.plan.lock().unwrap();
        let i = plan.iter().position(|(o, _)| *o == op)?;
        plan.remove(i).map(|(_, f)| f)
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::Unavailable {
        message: format!("injected fault: {what}"),
        source: None,
    }
}

impl<S: Store> FaultyStore<S> {
    async fn with_fault<T, E: From<StoreError>>(
        &self,
        op: Op,
        run: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        match self.fault_for(op) {
            Some(Fault::Unavailable) => Err(injected("store unavailable").into()),
            Some(Fault::LostReply) => {
                // The effect happens; the answer does not arrive.
                let _ = run.await;
                Err(injected("reply lost").into())
            }
            Some(Fault::SlowReply(after)) => {
                let result = run.await;
                tokio::time::sleep(after).await;
                result
            }
            None => run.await,
        }
    }
}

impl<S: Store> Store for FaultyStore<S> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        self.with_fault(Op::Begin, self.inner.begin(req, now)).await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.with_fault(Op::Complete, self.inner.complete(key, lease, response, now))
            .await
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.with_fault(Op::Release, self.inner.release(key, lease, now))
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: std::time::Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        self.with_fault(Op::Renew, self.inner.renew(key, lease, length, now))
            .await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        self.with_fault(Op::Reopen, self.inner.reopen(key, fence, now))
            .await
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.with_fault(Op::Get, self.inner.get(key, now)).await
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        self.with_fault(Op::Advance, self.inner.advance(key, by))
            .await
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        self.with_fault(Op::Raise, self.inner.raise(key, to)).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.with_fault(Op::Purge, self.inner.purge_expired(now, limit))
            .await
    }
}
