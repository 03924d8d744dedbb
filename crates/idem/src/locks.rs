//! Distributed locks with fencing numbers and a loud "lost" signal.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idem::{Locks, MemoryStore};
//!
//! let locks = Locks::new(MemoryStore::new());
//! // Wait up to 2 s for the lock; hold it for 10 s at a time, renewed in the background.
//! let guard = locks
//!     .acquire("payouts:daily", Duration::from_secs(10), Duration::from_secs(2))
//!     .await?
//!     .auto_renew();
//! // Pass the fence along with every write, and let the resource refuse lower fences
//! // (see `idem_store::fenced`).
//! let fence = guard.fence();
//! # let _ = fence;
//! tokio::select! {
//!     _ = guard.lost() => { /* stop: another holder may be running now */ }
//!     _ = async { /* the work */ } => {}
//! }
//! guard.release().await?;
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
//! ```
//!
//! # What a lock gives, and what it does not
//!
//! A lease-based lock gives *efficiency*: usually one worker at a time. It cannot give
//! correctness on its own: a holder that pauses (a stopped process, a long GC, a slow network)
//! past its lease still believes it holds the lock while another has taken it. Two things make
//! that case safe and visible:
//!
//! - **The fence.** Each holding gets a number higher than every earlier one for the name. A
//!   resource that keeps the highest fence it has accepted and refuses lower ones turns away
//!   the paused holder's writes (`idem_store::fenced`).
//! - **The lost signal.** A guard knows its lease end by its own monotonic clock, counted from
//!   before it asked (so it ends no later than the backend's). Once that time passes without a
//!   renewal, or a renewal is refused, the guard is lost, for good: [`LockGuard::is_lost`],
//!   [`LockGuard::lost`].
//!
//! # Waiting
//!
//! A waiter subscribes to the backend's releases before each attempt (Redis pub/sub,
//! PostgreSQL `LISTEN`, in-process channels) and tries again when its lock is released. A
//! timer covers releases it cannot hear of (a lease that simply ran out, another process on
//! the same SQLite file, a lost notification): it retries at the holder's lease end, or after
//! [`Locks::poll_interval`] at most.
//!
//! # Giving up
//!
//! Any of these futures may be dropped (a timeout, a client that hangs up) without leaving a
//! lock held for nobody: an acquire already sent to the backend is finished in the background
//! and a lock it got is released (except by [`Locks::acquire_as`], whose owner id the caller
//! keeps and may use to get the holding back); a waiter holds nothing while it waits; a guard
//! dropped, or dropped while it releases, releases in the background.

use std::sync::Arc;
use std::time::Duration;

use crate::cancel::finishing;
use idem_core::{
    Acquire, BoxFuture, DynLockStore, Held, LockError, LockName, LockOwner, OwnerDigest, Queued,
    ReleaseListener, SharedLockStore, StoreError, Timestamp,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Acquires locks from one backend.
#[derive(Clone)]
pub struct Locks {
    store: SharedLockStore,
    poll: Duration,
}

impl std::fmt::Debug for Locks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locks")
            .field("store", &(*self.store).kind())
            .field("poll", &self.poll)
            .finish()
    }
}

/// The shortest a waiter sleeps between attempts on its timer.
const MIN_NAP: Duration = Duration::from_millis(20);

/// How long a waiter pauses after a store failure before trying again.
const RETRY_AFTER_FAILURE: Duration = Duration::from_millis(100);

/// The default longest wait between two attempts of a waiter.
pub const DEFAULT_POLL: Duration = Duration::from_millis(500);

/// Whether a lock granted to a caller who stopped waiting is released on its behalf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GiveBack {
    /// Yes: the owner id is this call's own, so the holding is surely new and nobody else
    /// could use it.
    Yes,
    /// No: the caller keeps the owner id and may repeat the call to get the holding back.
    No,
}

impl Locks {
    /// Locks in `store`.
    pub fn new(store: impl idem_core::LockStore) -> Self {
        Self::shared(Arc::new(store))
    }

    /// Locks in a shared backend.
    pub fn shared(store: SharedLockStore) -> Self {
        Self {
            store,
            poll: DEFAULT_POLL,
        }
    }

    /// The longest a waiter sleeps between attempts when it hears of no release (default
    /// [`DEFAULT_POLL`]).
    #[must_use]
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll.max(Duration::from_millis(1));
        self
    }

    /// The backend.
    pub fn store(&self) -> &SharedLockStore {
        &self.store
    }

    /// Acquires `name` for `lease` if nobody holds it; [`LockError::Held`] otherwise.
    /// Dropped before it answers, it leaves the lock free (see [`Locks::acquire`]).
    pub async fn try_acquire(&self, name: &str, lease: Duration) -> Result<LockGuard, LockError> {
        self.acquire_for(
            name,
            LockOwner::random(),
            lease,
            Duration::ZERO,
            GiveBack::Yes,
        )
        .await
    }

    /// Acquires `name` for `lease`, waiting up to `wait` for its holder to release it;
    /// [`LockError::Timeout`] if it does not. Store failures that may pass are retried while
    /// the wait lasts.
    ///
    /// Safe to drop at any point: an acquire already sent to the backend is finished in the
    /// background, and a lock it got (for an owner id nobody else knows) is released at once,
    /// rather than held for its whole lease on behalf of a caller who is gone.
    pub async fn acquire(
        &self,
        name: &str,
        lease: Duration,
        wait: Duration,
    ) -> Result<LockGuard, LockError> {
        self.acquire_for(name, LockOwner::random(), lease, wait, GiveBack::Yes)
            .await
    }

    /// As [`Locks::acquire`], for an owner id the caller keeps: repeating the call with the
    /// same id after a lost answer gets the same holding back (same fence, lease extended).
    /// With a zero `wait`, a held lock answers [`LockError::Held`].
    ///
    /// Dropped before it answers, it may leave the lock held by `owner` (the backend may have
    /// granted it): the id's keeper gets it back by repeating the call, or it ends with its
    /// lease. It is not released on the caller's behalf, since the same id may already have
    /// held it before this call (a repeated acquire), and a holder must not lose its lock to
    /// a retry it gave up on.
    pub async fn acquire_as(
        &self,
        name: &str,
        owner: LockOwner,
        lease: Duration,
        wait: Duration,
    ) -> Result<LockGuard, LockError> {
        self.acquire_for(name, owner, lease, wait, GiveBack::No)
            .await
    }

    async fn acquire_for(
        &self,
        name: &str,
        owner: LockOwner,
        lease: Duration,
        wait: Duration,
        give_back: GiveBack,
    ) -> Result<LockGuard, LockError> {
        let name = LockName::new(name)?;
        let digest = owner.digest();
        let deadline = far(Instant::now(), wait);
        if !wait.is_zero()
            && let Some(answer) = self.acquire_in_queue(&name, digest, lease, deadline).await
        {
            let (held, asked, session) = answer?;
            return Ok(LockGuard::new(
                Arc::clone(&self.store),
                name,
                owner,
                digest,
                held,
                asked,
                lease,
            )
            .watching(session));
        }
        let mut listener = if wait.is_zero() {
            None
        } else {
            (*self.store).listen()
        };
        loop {
            let asked = Instant::now();
            // Asked before each attempt, so that a session ending in between is not missed,
            // and one replaced before a retry does not count against the new holding.
            let session = (*self.store).session_end();
            let answer = match self.acquire_once(&name, digest, lease, give_back).await {
                // A store that is briefly away (a restart, a failover) is tried again while
                // the wait lasts; the owner id makes a repeated attempt safe.
                Err(e) if e.is_transient() && asked + RETRY_AFTER_FAILURE < deadline => {
                    tracing::debug!(lock = %name, error = %e, "acquiring failed; retrying");
                    tokio::time::sleep(RETRY_AFTER_FAILURE).await;
                    continue;
                }
                answer => answer?,
            };
            let until = match answer {
                Acquire::Acquired(held) => {
                    return Ok(LockGuard::new(
                        Arc::clone(&self.store),
                        name,
                        owner,
                        digest,
                        held,
                        asked,
                        lease,
                    )
                    .watching(session));
                }
                Acquire::Busy { until } => until,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(if wait.is_zero() {
                    LockError::Held { until }
                } else {
                    LockError::Timeout
                });
            }
            // The holder's lease end is by the backend's clock; ours is close enough to aim a
            // timer at, and a timer that fires early only costs one more attempt.
            // At least MIN_NAP: with the backend's clock behind ours, the lease end looks
            // past while it is not, and retrying at once would spin.
            let lease_left = until
                .saturating_since(Timestamp::now())
                .max(MIN_NAP.min(self.poll));
            let nap = self.poll.min(lease_left).min(deadline - now);
            wait_for_release(listener.as_deref_mut(), &name, nap).await;
        }
    }

    /// Waits in the backend's own queue, for a backend that keeps one (see
    /// [`LockStore::acquire_queued`](idem_core::LockStore::acquire_queued)): the holding, when
    /// it was asked for and the end of the session it belongs to, or `None` for a backend
    /// without a queue. Store failures that may
    /// pass are retried while the wait lasts. Dropped, the backend's future takes back its
    /// place in the queue and any holding it got for a caller who is gone.
    async fn acquire_in_queue(
        &self,
        name: &LockName,
        digest: OwnerDigest,
        lease: Duration,
        deadline: Instant,
    ) -> Option<Result<(Held, Instant, Option<BoxFuture<'static, ()>>), LockError>> {
        loop {
            let asked = Instant::now();
            let wait = deadline.saturating_duration_since(asked);
            let session = (*self.store).session_end();
            let answer = (*self.store)
                .acquire_queued(name, digest, lease, wait)?
                .await;
            return Some(match answer {
                Ok(Queued {
                    answer: Acquire::Acquired(held),
                    asked,
                }) => Ok((held, Instant::from_std(asked), session)),
                Ok(Queued {
                    answer: Acquire::Busy { .. },
                    ..
                }) => Err(LockError::Timeout),
                Err(e) if e.is_transient() && asked + RETRY_AFTER_FAILURE < deadline => {
                    tracing::debug!(lock = %name, error = %e, "waiting in the queue failed; retrying");
                    tokio::time::sleep(RETRY_AFTER_FAILURE).await;
                    continue;
                }
                Err(e) => Err(e.into()),
            });
        }
    }

    /// Extends the holding `owner` has on `name` with `fence` to `lease` from now, for callers
    /// that keep no [`LockGuard`] (the HTTP API).
    pub async fn renew(
        &self,
        name: &str,
        owner: &LockOwner,
        fence: u64,
        lease: Duration,
    ) -> Result<Held, LockError> {
        let name = LockName::new(name)?;
        (*self.store)
            .renew(&name, owner.digest(), fence, lease)
            .await
    }

    /// Releases the holding `owner` has on `name` with `fence`, for callers that keep no
    /// [`LockGuard`]. Repeating a release succeeds.
    pub async fn release(
        &self,
        name: &str,
        owner: &LockOwner,
        fence: u64,
    ) -> Result<(), LockError> {
        let name = LockName::new(name)?;
        (*self.store).release(&name, owner.digest(), fence).await
    }

    /// One acquire. With [`GiveBack::Yes`] it is finished in the background if the caller
    /// stops waiting, and a lock it gets then is released.
    async fn acquire_once(
        &self,
        name: &LockName,
        digest: OwnerDigest,
        lease: Duration,
        give_back: GiveBack,
    ) -> Result<Acquire, StoreError> {
        if give_back == GiveBack::No {
            return (*self.store).acquire(name, digest, lease).await;
        }
        let call = {
            let (store, name) = (Arc::clone(&self.store), name.clone());
            async move { (*store).acquire(&name, digest, lease).await }
        };
        let (store, name) = (Arc::clone(&self.store), name.clone());
        finishing(call, move |answer| async move {
            if let Ok(Acquire::Acquired(held)) = answer
                && let Err(e) = (*store).release(&name, digest, held.fence).await
            {
                // The lock frees itself when the lease runs out.
                tracing::debug!(lock = %name, error = %e, "releasing a lock acquired for a caller that left failed");
            }
        })
        .await
    }
}

/// Sleeps until `name` is released (as far as `listener` hears) or `nap` has passed.
async fn wait_for_release(
    listener: Option<&mut (dyn ReleaseListener + 'static)>,
    name: &LockName,
    nap: Duration,
) {
    let Some(listener) = listener else {
        tokio::time::sleep(nap).await;
        return;
    };
    let heard = async {
        loop {
            match listener.next().await {
                Some(released) if *released != *name.as_str() => continue,
                // This name, or releases were missed: try again.
                _ => return,
            }
        }
    };
    let _ = tokio::time::timeout(nap, heard).await;
}

/// The guard's view of its lease.
#[derive(Debug, Clone, Copy)]
struct LeaseView {
    /// When the lease ends by this process's monotonic clock (a little before the backend's).
    deadline: Instant,
    /// When it ends by the backend's clock.
    expires_at: Timestamp,
    lost: bool,
}

struct Shared {
    store: SharedLockStore,
    name: LockName,
    owner: LockOwner,
    digest: OwnerDigest,
    fence: u64,
    view: watch::Sender<LeaseView>,
}

/// When a lease asked for at `asked` ends by this process's clock: `lease` minus an allowance
/// for the two clocks running at slightly different rates (1%, and 2 ms).
fn local_deadline(asked: Instant, lease: Duration) -> Instant {
    far(
        asked,
        lease.saturating_sub(lease / 100 + Duration::from_millis(2)),
    )
}

/// `at + d`, or a century on for a `d` too long to add (`Duration::MAX` as "for ever").
fn far(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(at)
}

impl Shared {
    /// Whether the lease is lost; marks it lost for good once its deadline has passed.
    fn check_lost(&self) -> bool {
        let mut lost = false;
        self.view.send_if_modified(|v| {
            if !v.lost && Instant::now() >= v.deadline {
                v.lost = true;
                lost = true;
                return true;
            }
            lost = v.lost;
            false
        });
        lost
    }

    fn mark_lost(&self) {
        self.view
            .send_if_modified(|v| !std::mem::replace(&mut v.lost, true));
    }

    async fn renew(&self, lease: Duration) -> Result<Held, LockError> {
        if self.check_lost() {
            return Err(LockError::Lost);
        }
        let asked = Instant::now();
        match self
            .store
            .renew(&self.name, self.digest, self.fence, lease)
            .await
        {
            Ok(held) => {
                // Extend only a lease that is not lost meanwhile: once lost, always lost.
                let mut kept = false;
                self.view.send_if_modified(|v| {
                    if v.lost || Instant::now() >= v.deadline {
                        v.lost = true;
                        return true;
                    }
                    v.deadline = local_deadline(asked, lease);
                    v.expires_at = held.expires_at;
                    kept = true;
                    true
                });
                if kept { Ok(held) } else { Err(LockError::Lost) }
            }
            Err(LockError::NotOwner) => {
                self.mark_lost();
                Err(LockError::Lost)
            }
            Err(e) => Err(e),
        }
    }
}

/// A holding of a lock. Release it with [`LockGuard::release`]; dropping it releases it in the
/// background, so a guard does not keep its lock until the lease ends (a guard dropped outside
/// any Tokio runtime cannot, and its lock lasts until its lease ends).
pub struct LockGuard {
    shared: Arc<Shared>,
    lease: Duration,
    renewer: Option<JoinHandle<()>>,
    /// Marks the holding lost when the store's session ends (ZooKeeper, etcd).
    session: Option<JoinHandle<()>>,
    released: bool,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.shared.name)
            .field("fence", &self.shared.fence)
            .field("lost", &self.shared.view.borrow().lost)
            .finish_non_exhaustive()
    }
}

impl LockGuard {
    fn new(
        store: SharedLockStore,
        name: LockName,
        owner: LockOwner,
        digest: OwnerDigest,
        held: Held,
        asked: Instant,
        lease: Duration,
    ) -> Self {
        let view = watch::Sender::new(LeaseView {
            deadline: local_deadline(asked, lease),
            expires_at: held.expires_at,
            lost: false,
        });
        Self {
            shared: Arc::new(Shared {
                store,
                name,
                owner,
                digest,
                fence: held.fence,
                view,
            }),
            lease,
            renewer: None,
            session: None,
            released: false,
        }
    }

    /// Marks the holding lost once `session` (the store's [`session_end`]) resolves: a holding
    /// that belongs to a session ends with it, whatever its lease says, since the service
    /// frees it for the next owner then.
    ///
    /// [`session_end`]: idem_core::LockStore::session_end
    fn watching(mut self, session: Option<BoxFuture<'static, ()>>) -> Self {
        // Polled by a task of its own: a session that has ended already is heard as soon as
        // the runtime runs that task.
        let Some(ended) = session else {
            return self;
        };
        self.session = Some({
            let shared = Arc::downgrade(&self.shared);
            tokio::spawn(async move {
                ended.await;
                if let Some(shared) = shared.upgrade() {
                    shared.mark_lost();
                }
            })
        });
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        self.shared.name.as_str()
    }

    /// The fence of this holding: pass it with every write the lock protects.
    pub fn fence(&self) -> u64 {
        self.shared.fence
    }

    /// The owner id (a secret: whoever has it may release the lock).
    pub fn owner(&self) -> &LockOwner {
        &self.shared.owner
    }

    /// When the lease ends by the backend's clock, as of the last acquire or renewal.
    pub fn expires_at(&self) -> Timestamp {
        self.shared.view.borrow().expires_at
    }

    /// Whether the lock is lost: its lease ran out (by this process's clock), a renewal was
    /// refused, or the store's session it belongs to ended or lost touch with the service
    /// (ZooKeeper, etcd). Once true, it stays true.
    pub fn is_lost(&self) -> bool {
        self.shared.check_lost()
    }

    /// Resolves when the lock is lost (at once if it is). Race the work against it.
    pub async fn lost(&self) {
        let mut rx = self.shared.view.subscribe();
        loop {
            let view = *rx.borrow_and_update();
            if view.lost || self.shared.check_lost() {
                return;
            }
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(view.deadline) => {}
            }
        }
    }

    /// Extends the lease to `lease` from now. [`LockError::Lost`] if the lock is lost (and
    /// then it stays lost); a store error leaves the lease as it was.
    pub async fn renew(&self, lease: Duration) -> Result<(), LockError> {
        self.shared.renew(lease).await.map(drop)
    }

    /// Renews the lease in the background every third of its length until the guard is
    /// released or dropped. A refused renewal marks the lock lost at once; store errors are
    /// retried until the lease runs out, and then it is lost. Needs a Tokio runtime.
    #[must_use]
    pub fn auto_renew(mut self) -> Self {
        if self.renewer.is_none() {
            let shared = Arc::clone(&self.shared);
            let lease = self.lease;
            self.renewer = Some(tokio::spawn(renew_loop(shared, lease)));
        }
        self
    }

    /// Stops any renewal, then releases the lock so that a waiter gets it at once.
    /// [`LockError::NotOwner`] if another owner took it meanwhile (the lease ran out).
    /// Dropped before the backend answers, the guard releases the lock in the background, as
    /// a dropped guard does.
    pub async fn release(mut self) -> Result<(), LockError> {
        self.stop_renewing().await;
        self.shared.mark_lost();
        let s = &self.shared;
        let answer = (*s.store).release(&s.name, s.digest, s.fence).await;
        // Only now: until the backend has answered, dropping the guard releases it again.
        self.released = true;
        answer
    }

    /// Hands the holding over to the caller, who renews and releases it by owner and fence
    /// ([`Locks::renew`], [`Locks::release`]): the guard stops renewing, and dropping it no
    /// longer releases the lock.
    pub fn detach(mut self) -> (LockOwner, Held) {
        self.stop_watching();
        if let Some(task) = self.renewer.take() {
            task.abort();
        }
        self.released = true;
        let held = Held {
            fence: self.shared.fence,
            expires_at: self.expires_at(),
        };
        (self.shared.owner.clone(), held)
    }

    async fn stop_renewing(&mut self) {
        self.stop_watching();
        if let Some(task) = self.renewer.take() {
            task.abort();
            let _ = task.await;
        }
    }

    fn stop_watching(&mut self) {
        if let Some(task) = self.session.take() {
            task.abort();
        }
    }
}

async fn renew_loop(shared: Arc<Shared>, lease: Duration) {
    let every = lease / 3;
    let retry = (lease / 20).clamp(Duration::from_millis(1), Duration::from_millis(200));
    let mut next = far(Instant::now(), every);
    loop {
        tokio::time::sleep_until(next).await;
        match shared.renew(lease).await {
            Ok(_) => next = far(Instant::now(), every),
            Err(LockError::Lost) => return,
            Err(e) => {
                tracing::warn!(lock = %shared.name, error = %e, "lock renewal failed; retrying");
                next = Instant::now() + retry;
            }
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.stop_watching();
        if self.released {
            return;
        }
        if let Some(task) = self.renewer.take() {
            task.abort();
        }
        self.shared.mark_lost();
        // Release in the background rather than leave waiters until the lease ends. The
        // renewal task is aborted first; a renewal already on its way cannot outlive the
        // release (a released lock is never renewed).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let shared = Arc::clone(&self.shared);
            runtime.spawn(async move {
                let s = &shared;
                if let Err(e) = (*s.store).release(&s.name, s.digest, s.fence).await {
                    tracing::debug!(lock = %s.name, error = %e, "releasing a dropped lock guard failed");
                }
            });
        }
    }
}
