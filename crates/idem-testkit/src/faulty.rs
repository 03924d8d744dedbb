use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    Acquire, BeginOutcome, BeginRequest, Bytes, Counters, Held, Key, Lease, LeaseError, LockError,
    LockName, LockStore, OwnerDigest, Record, ReleaseListener, Step, StepError, Store, StoreError,
    Timestamp,
};
use tokio::sync::watch;

/// A store operation, for choosing where a [`Fault`] strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// `record_step`
    RecordStep,
    /// `get`
    Get,
    /// `purge_expired`
    Purge,
    /// `advance`
    Advance,
    /// `raise`
    Raise,
    /// [`LockStore::acquire`]
    LockAcquire,
    /// [`LockStore::renew`]
    LockRenew,
    /// [`LockStore::release`]
    LockRelease,
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The operation fails before it reaches the store: nothing changes.
    Unavailable,
    /// The store refuses the operation with an error that retrying will not cure (not
    /// transient): nothing changes.
    Refused,
    /// The operation takes effect in the store, but its answer is lost: the caller sees an
    /// error (a timeout after the commit).
    LostReply,
    /// The operation takes effect in the store at once, and its answer arrives after this
    /// long: a caller that gives up meanwhile leaves the effect behind.
    SlowReply(Duration),
    /// The operation stops on its way to the store until the [`Stall`] is released, then goes
    /// on. A caller that gives up meanwhile takes it back: it never reaches the store (a
    /// request still in the client's hands, or in a queue that skips callers who left).
    Stall(Stall),
    /// The operation is sent at once and waits at the store until the [`Stall`] is released;
    /// then it takes effect whether or not its caller still waits (a statement queued behind
    /// a lock, run when the server resumes). [`Stall::landed`] tells when it has.
    StallThenLand(Stall),
}

/// A gate that holds one stalled operation ([`Fault::Stall`], [`Fault::StallThenLand`]) until
/// released. Clones are the same gate; a test keeps one and plans the fault with another.
///
/// ```
/// use idem_core::{BeginRequest, Store, Timestamp};
/// use idem_testkit::{FaultyStore, Op};
///
/// async fn a_caller_gives_up<S: Store>(store: FaultyStore<S>, req: BeginRequest) {
///     let stall = store.stall_next(Op::Begin);
///     let caller = {
///         let store = store.clone();
///         async move { store.begin(&req, Timestamp::now()).await }
///     };
///     // Dropped while its `begin` waits on the store...
///     stall.abandon(caller).await;
///     // ...which it never reaches (with `Fault::StallThenLand`, it would now).
///     stall.release();
///     // Then: is the next caller served?
/// }
/// ```
#[derive(Clone, Default)]
pub struct Stall(Arc<watch::Sender<Progress>>);

#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    reached: bool,
    released: bool,
    landed: bool,
}

impl Stall {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resolves once the stalled operation has reached the gate (at once if it has): from
    /// then on its caller is waiting on the store.
    pub async fn reached(&self) {
        self.wait(|p| p.reached).await;
    }

    /// Opens the gate: the operation goes on (for [`Fault::Stall`], only if its caller still
    /// waits). Opening it again does nothing.
    pub fn release(&self) {
        self.0.send_modify(|p| p.released = true);
    }

    /// Resolves once the wrapped store has answered the stalled operation: its effect, if it
    /// has one, is made. Never resolves for a [`Fault::Stall`] whose caller gave up first.
    pub async fn landed(&self) {
        self.wait(|p| p.landed).await;
    }

    /// Starts `caller` in a task of its own, waits until the operation it makes is held at
    /// this gate, and drops it there, as a caller that gives up does (a timeout, a client
    /// that hangs up). The gate stays closed. Panics if the call does not arrive within
    /// [`PATIENCE`](crate::PATIENCE).
    pub async fn abandon<F>(&self, caller: F)
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let task = tokio::spawn(caller);
        crate::within("the call to reach the stall", self.reached()).await;
        task.abort();
        // Resolves once the task's future has been dropped.
        if let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    async fn wait(&self, until: impl Fn(&Progress) -> bool) {
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = self.0.subscribe().wait_for(until).await;
    }

    fn arrive(&self) {
        self.0.send_modify(|p| p.reached = true);
    }

    fn land(&self) {
        self.0.send_modify(|p| p.landed = true);
    }

    /// Holds the operation until released, then runs it.
    async fn pass<T>(self, run: impl Future<Output = T>) -> T {
        self.arrive();
        self.wait(|p| p.released).await;
        let answer = run.await;
        self.land();
        answer
    }
}

impl std::fmt::Debug for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Stall").field(&*self.0.borrow()).finish()
    }
}

impl PartialEq for Stall {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Stall {}

/// Wraps a store and fails or stalls operations on demand. Clones share the same store and
/// schedule. Wraps a [`LockStore`] too.
pub struct FaultyStore<S> {
    inner: Arc<S>,
    plan: Arc<Mutex<VecDeque<(Op, Fault)>>>,
    down: Arc<AtomicBool>,
    calls: Arc<Mutex<std::collections::HashMap<Op, usize>>>,
}

impl<S> Clone for FaultyStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            plan: Arc::clone(&self.plan),
            down: Arc::clone(&self.down),
            calls: Arc::clone(&self.calls),
        }
    }
}

impl<S: Send + Sync + 'static> FaultyStore<S> {
    /// Wraps `inner`; nothing fails until told to.
    pub fn new(inner: S) -> Self {
        Self {
            inner: Arc::new(inner),
            plan: Arc::default(),
            down: Arc::default(),
            calls: Arc::default(),
        }
    }

    /// The next `op` fails with `fault` (faults are used up in the order they were planned).
    pub fn fail_next(&self, op: Op, fault: Fault) {
        self.plan.lock().unwrap().push_back((op, fault));
    }

    /// The next `op` stalls on its way to the store ([`Fault::Stall`]); the answer releases
    /// it.
    pub fn stall_next(&self, op: Op) -> Stall {
        let stall = Stall::new();
        self.fail_next(op, Fault::Stall(stall.clone()));
        stall
    }

    /// While `down`, every operation fails with `Unavailable` before reaching the store.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// How many times `op` was called, failed or not.
    pub fn calls(&self, op: Op) -> usize {
        self.calls.lock().unwrap().get(&op).copied().unwrap_or(0)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn fault_for(&self, op: Op) -> Option<Fault> {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
        if self.down.load(Ordering::SeqCst) {
            return Some(Fault::Unavailable);
        }
        let mut plan = self.plan.lock().unwrap();
        let i = plan.iter().position(|(o, _)| *o == op)?;
        plan.remove(i).map(|(_, f)| f)
    }

    /// Runs `op` through its planned fault. `run` makes the call on the wrapped store, owned,
    /// so that a [`Fault::StallThenLand`] can carry it on in a task of its own.
    async fn with_fault<T, E, Fut>(&self, op: Op, run: impl FnOnce(Arc<S>) -> Fut) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let run = run(Arc::clone(&self.inner));
        match self.fault_for(op) {
            Some(Fault::Unavailable) => Err(injected("store unavailable").into()),
            Some(Fault::Refused) => Err(StoreError::backend(
                "store refused the operation",
                std::io::Error::other("injected"),
            )
            .into()),
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
            Some(Fault::Stall(stall)) => stall.pass(run).await,
            Some(Fault::StallThenLand(stall)) => {
                // Marked before the task runs: once `reached` resolves, the call is on its way
                // whatever becomes of this caller.
                stall.arrive();
                tokio::spawn(stall.pass(run))
                    .await
                    .unwrap_or_else(|_| Err(injected("the stalled operation was cancelled").into()))
            }
            None => run.await,
        }
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::Unavailable {
        message: format!("injected fault: {what}"),
        source: None,
    }
}

impl<S: Store> Store for FaultyStore<S> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        let req = req.clone();
        self.with_fault(Op::Begin, move |s| async move { s.begin(&req, now).await })
            .await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let (key, lease) = (key.clone(), *lease);
        self.with_fault(Op::Complete, move |s| async move {
            s.complete(&key, &lease, response, now).await
        })
        .await
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        let (key, lease) = (key.clone(), *lease);
        self.with_fault(Op::Release, move |s| async move {
            s.release(&key, &lease, now).await
        })
        .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        let (key, lease) = (key.clone(), *lease);
        self.with_fault(Op::Renew, move |s| async move {
            s.renew(&key, &lease, length, now).await
        })
        .await
    }

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        let (key, lease, step) = (key.clone(), *lease, step.clone());
        self.with_fault(Op::RecordStep, move |s| async move {
            s.record_step(&key, &lease, &step, now).await
        })
        .await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        let key = key.clone();
        self.with_fault(Op::Reopen, move |s| async move {
            s.reopen(&key, fence, now).await
        })
        .await
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let key = key.clone();
        self.with_fault(Op::Get, move |s| async move { s.get(&key, now).await })
            .await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.with_fault(Op::Purge, move |s| async move {
            s.purge_expired(now, limit).await
        })
        .await
    }

    /// The wrapped store's operator view, without faults: operators' tools are not what a
    /// fault test exercises.
    fn admin(&self) -> Option<&dyn idem_core::RecordAdmin> {
        self.inner.admin()
    }
}

impl<S: Store> Counters for FaultyStore<S> {
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        let key = key.clone();
        self.with_fault(
            Op::Advance,
            move |s| async move { s.advance(&key, by).await },
        )
        .await
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        let key = key.clone();
        self.with_fault(Op::Raise, move |s| async move { s.raise(&key, to).await })
            .await
    }
}

impl<S: LockStore> LockStore for FaultyStore<S> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        let name = name.clone();
        self.with_fault(Op::LockAcquire, move |s| async move {
            s.acquire(&name, owner, lease).await
        })
        .await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<Held, LockError> {
        let name = name.clone();
        self.with_fault(Op::LockRenew, move |s| async move {
            s.renew(&name, owner, fence, lease).await
        })
        .await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        let name = name.clone();
        self.with_fault(Op::LockRelease, move |s| async move {
            s.release(&name, owner, fence).await
        })
        .await
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        self.inner.listen()
    }

    fn session_end(&self) -> Option<idem_core::BoxFuture<'static, ()>> {
        self.inner.session_end()
    }

    /// The wrapped store's listing of held locks, without faults, as for `admin`.
    async fn held(&self, limit: usize) -> Result<Option<Vec<idem_core::HeldLock>>, StoreError> {
        self.inner.held(limit).await
    }
}
