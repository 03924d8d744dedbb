//! What the id tests share: a store that can stall a chosen call until the test lets it go,
//! fail or panic it, forget everything at once (a Redis restarted empty), or lose one record
//! (deleted by hand); and a generator clock driven by a manual clock.

#![allow(dead_code, clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Clock, Counters, Key, Lease, LeaseError, ManualClock,
    Record, RecordState, Repair, SharedStore, Shown, Store, StoreError, Timestamp,
};
use idem_testkit::Op;
use tokio::sync::watch;

/// How a stalled call ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// It goes on (to the store, or with the store's answer).
    Answer,
    /// It fails with `Unavailable`.
    Fail,
    /// It panics.
    Panic,
}

/// Whether a stall holds a call before it reaches the store or after the store has applied
/// it (its answer delayed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum When {
    /// Nothing has happened in the store yet.
    Before,
    /// The store has applied the call; its answer waits.
    After,
}

/// A call held by a [`TestStore`] until the test says how it ends.
#[derive(Clone)]
pub(crate) struct Stall {
    reached: watch::Sender<bool>,
    then: watch::Sender<Option<Then>>,
}

impl Stall {
    /// Waits until the call is held (at most 30 s, so a call that never comes fails the
    /// test instead of hanging it).
    pub(crate) async fn reached(&self) {
        let mut rx = self.reached.subscribe();
        tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|r| *r))
            .await
            .expect("the stalled call was never made")
            .unwrap();
    }

    /// Lets the call end as `then` says.
    pub(crate) fn end(&self, then: Then) {
        self.then.send_replace(Some(then));
    }

    async fn hold(&self) -> Then {
        self.reached.send_replace(true);
        let mut rx = self.then.subscribe();
        let then = *rx.wait_for(Option::is_some).await.unwrap();
        then.unwrap()
    }
}

struct Planned {
    op: Op,
    skip: usize,
    when: When,
    stall: Stall,
}

/// A store in front of another, which it can swap for an empty one, stall calls of, or take
/// down.
pub(crate) struct TestStore {
    inner: Mutex<SharedStore>,
    planned: Mutex<Vec<Planned>>,
    down: std::sync::atomic::AtomicBool,
}

impl TestStore {
    /// In front of a fresh memory store.
    pub(crate) fn new() -> Arc<Self> {
        Self::over(Arc::new(idem_store::MemoryStore::new()))
    }

    /// In front of `inner`.
    pub(crate) fn over(inner: SharedStore) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(inner),
            planned: Mutex::default(),
            down: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// From now on, calls go to `store`: with an empty one, the store has forgotten every
    /// record and counter, as a Redis without persistence does when it restarts.
    pub(crate) fn replace(&self, store: SharedStore) {
        *self.inner.lock().unwrap() = store;
    }

    /// Forgets everything (calls go to a fresh memory store).
    pub(crate) fn forget_everything(&self) {
        self.replace(Arc::new(idem_store::MemoryStore::new()));
    }

    /// Deletes the record under `key`, as an operator does by hand; see [`delete_record`].
    pub(crate) async fn delete_record(&self, key: &Key, now: Timestamp) -> bool {
        delete_record(&self.store(), key, now).await
    }

    /// While `down`, every call fails with `Unavailable` before reaching the store.
    pub(crate) fn set_down(&self, down: bool) {
        self.down.store(down, std::sync::atomic::Ordering::SeqCst);
    }

    /// Holds the call of `op` after the next `skip` ones, `when` it says, until the test ends
    /// it.
    pub(crate) fn stall(&self, op: Op, skip: usize, when: When) -> Stall {
        let stall = Stall {
            reached: watch::channel(false).0,
            then: watch::channel(None).0,
        };
        self.planned.lock().unwrap().push(Planned {
            op,
            skip,
            when,
            stall: stall.clone(),
        });
        stall
    }

    fn store(&self) -> SharedStore {
        self.inner.lock().unwrap().clone()
    }

    fn plan_for(&self, op: Op) -> Option<(When, Stall)> {
        let mut planned = self.planned.lock().unwrap();
        let i = planned.iter().position(|p| p.op == op)?;
        if planned[i].skip > 0 {
            planned[i].skip -= 1;
            return None;
        }
        let p = planned.remove(i);
        Some((p.when, p.stall))
    }

    async fn call<T, E: From<StoreError>>(
        &self,
        op: Op,
        run: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(unavailable().into());
        }
        let Some((when, stall)) = self.plan_for(op) else {
            return run.await;
        };
        // A future does nothing until awaited: `Before` holds the call before it starts.
        match when {
            When::Before => match stall.hold().await {
                Then::Answer => run.await,
                Then::Fail => Err(unavailable().into()),
                Then::Panic => panic!("a store call panicked (on purpose)"),
            },
            When::After => {
                let answer = run.await;
                match stall.hold().await {
                    Then::Answer => answer,
                    Then::Fail => Err(unavailable().into()),
                    Then::Panic => panic!("a store call panicked (on purpose)"),
                }
            }
        }
    }
}

fn unavailable() -> StoreError {
    StoreError::Unavailable {
        message: "injected fault: store unavailable".to_owned(),
        source: None,
    }
}

/// Deletes the record under `key` as an operator does by hand (a repair through the store's
/// admin, which every store offers), leaving counters alone; whether there was one to delete.
pub(crate) async fn delete_record(store: &SharedStore, key: &Key, now: Timestamp) -> bool {
    let Some(record) = store.get(key, now).await.unwrap() else {
        return false;
    };
    let shown = Shown {
        state: RecordState::of(&record, now),
        fence: record.fence,
    };
    store
        .admin()
        .expect("every store in idem offers an admin")
        .repair(key, shown, Repair::Delete, now)
        .await
        .unwrap()
}

/// The record of `worker` in the id space `space`.
pub(crate) fn worker_key(space: &str, worker: u64) -> Key {
    Key::parse(
        "idem.ids",
        &format!("snowflake.{space}"),
        &format!("worker-{worker}"),
    )
    .unwrap()
}

/// A layout with two worker bits: four worker ids, so tests can use them all up.
pub(crate) fn small_layout() -> idem_id::Layout {
    idem_id::Layout::new(
        41,
        2,
        20,
        std::time::UNIX_EPOCH + Duration::from_millis(idem_id::DEFAULT_EPOCH_MS),
    )
    .unwrap()
}

/// The generators' clock, driven by the same manual clock as the store's callers.
pub(crate) struct ManualTime {
    pub(crate) clock: ManualClock,
    pub(crate) start: Timestamp,
}

impl ManualTime {
    pub(crate) fn new(clock: &ManualClock) -> Arc<Self> {
        Arc::new(Self {
            clock: clock.clone(),
            start: clock.now(),
        })
    }
}

impl idem_id::TimeSource for ManualTime {
    fn wall(&self) -> std::time::SystemTime {
        self.clock.now().to_system_time()
    }
    fn elapsed(&self) -> Duration {
        self.clock.now().saturating_since(self.start)
    }
}

/// Waits until `check` holds, looking every few milliseconds, for at most 30 s (then the test
/// fails with `what`).
pub(crate) async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "never happened: {what}");
}

impl Store for TestStore {
    fn kind(&self) -> &'static str {
        "test"
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        self.call(Op::Begin, self.store().begin(req, now)).await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.call(
            Op::Complete,
            self.store().complete(key, lease, response, now),
        )
        .await
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.call(Op::Release, self.store().release(key, lease, now))
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        self.call(Op::Renew, self.store().renew(key, lease, length, now))
            .await
    }

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &idem_core::Step,
        now: Timestamp,
    ) -> Result<(), idem_core::StepError> {
        self.store().record_step(key, lease, step, now).await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        self.call(Op::Reopen, self.store().reopen(key, fence, now))
            .await
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.call(Op::Get, self.store().get(key, now)).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.call(Op::Purge, self.store().purge_expired(now, limit))
            .await
    }
}

impl Counters for TestStore {
    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        self.call(Op::Raise, self.store().raise(key, to)).await
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        self.call(Op::Advance, self.store().advance(key, by)).await
    }
}
