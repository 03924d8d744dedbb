//! Locks in etcd (feature `etcd`): a queue of keys per lock, ordered by their create revision,
//! with a lease and a fence on top.
//!
//! # Layout
//!
//! Under the prefix (`/idem` by default), one key per owner that holds or waits:
//! `<prefix>/locks/<name digest>/<owner digest>-<session>-<n>`, whose value is its state, a
//! number and the lock's name: `h <lease ms> <name>` (holds), `w <wait ms> <name>` (waits) or
//! `r <when, ms since the epoch> <name>` (released). Every key is attached to this store's
//! session: an etcd lease that a task keeps alive, so a process that dies or stops answering
//! for the session's length loses its keys, holdings and places in queues alike.
//!
//! # Who holds
//!
//! The queue's order is the keys' create revisions. A key holds when it is in state `h`, its
//! lease has not run out, and no live key comes before it. etcd has no clock a client can
//! read, and its own leases count whole seconds; so a lease runs from when it is *seen*. The
//! holder counts from when it sent the write; every other store counts from when it first read
//! that version of the key (its mod revision), which is later. So each sees the lease end no
//! earlier than the holder does, without the processes' clocks agreeing on the time (only on
//! its rate). A store that has just started waits a whole lease for a key it has never seen.
//!
//! Every write is one transaction that compares what it read: taking a lock deletes the dead
//! keys ahead and writes its own only if none of them changed; taking a free lock compares
//! the whole queue's mod revisions with the revision it was read at. A failed comparison
//! reads the queue in the same round trip.
//!
//! # Fences
//!
//! The fence of a holding is its key's create revision. etcd's revision only rises, across
//! members, leader elections and restarts (it is in the replicated log). A key holds only once
//! every key created before it for the name is gone, so each holding's fence is above every
//! earlier one's.
//!
//! # Waiting
//!
//! [`LockStore::acquire_queued`] puts the waiter's key in the queue and watches the live key
//! just ahead of it (its predecessor) only: a release wakes one waiter, not all of them. A
//! timer covers a predecessor whose lease runs out without a write.

mod queue;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client as etcd;
use idem_core::{
    Acquire, HeldLock, LockError, LockName, LockStore, OwnerDigest, Queued, StoreError, Timestamp,
};

use crate::session::{self, Vouched};

/// How an [`EtcdLocks`] connects.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The prefix of every key (default `/idem`).
    pub prefix: String,
    /// The session's length (default 10 s, whole seconds, at least 1; the cluster may raise
    /// it to its minimum). A process that stops answering for this long loses its holdings
    /// and places in queues.
    pub session_ttl: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            prefix: "/idem".to_owned(),
            session_ttl: Duration::from_secs(10),
        }
    }
}

impl EtcdOptions {
    /// With the prefix of every key.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// With the session's length.
    #[must_use]
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }
}

/// Locks in an etcd cluster. Cheap to clone: clones share one session.
#[derive(Clone)]
pub struct EtcdLocks {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: String,
    options: EtcdOptions,
    client: etcd::Client,
    /// The session: its etcd lease (replaced by a new one once it has ended), and until when
    /// the cluster keeps it at least, as its last answered keep-alive says.
    session: tokio::sync::watch::Sender<Vouched>,
    /// Tells the keep-alive task that an operation found the session's lease gone.
    lost: Arc<tokio::sync::Notify>,
    /// Numbers this store's keys apart.
    next_key: AtomicU64,
    /// When this store first saw a key at a mod revision (or sent the write that made it):
    /// where its lease runs from. An entry pushed out only makes a lease run from later.
    seen: quick_cache::sync::Cache<(Vec<u8>, i64), Instant>,
    /// The holdings this store granted or renewed: their key, its mod revision and when
    /// their lease ends, so that a renewal and a release are one conditional write.
    holdings: quick_cache::sync::Cache<(Vec<u8>, u64), queue::Holding>,
    /// How many times a waiter was woken by its watch.
    wakeups: AtomicU64,
    /// A moment by this process's monotonic clock and the wall clock's time then: moments
    /// are told as times from it, so that one moment is always told as the same time.
    epoch: (Instant, Timestamp),
}

/// How many keys' first sightings, and holdings, a store remembers.
const REMEMBERED: usize = 65_536;

impl std::fmt::Debug for EtcdLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLocks")
            .field("endpoints", &self.inner.endpoints)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl EtcdLocks {
    /// Connects to the cluster at `endpoints` (`host:port[,host:port…]`) and opens a session.
    /// Fails if no member answers within 5 s, or the prefix is empty.
    pub async fn connect(endpoints: &str, options: EtcdOptions) -> Result<Self, StoreError> {
        let prefix = options.prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(StoreError::Backend {
                message: format!(
                    "invalid etcd prefix {:?}: a path such as /idem",
                    options.prefix
                ),
                source: None,
            });
        }
        let options = EtcdOptions {
            prefix: prefix.to_owned(),
            session_ttl: options.session_ttl.max(Duration::from_secs(1)),
        };
        let list: Vec<&str> = endpoints.split(',').collect();
        let connect = etcd::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
        let client = etcd::Client::connect(&list, Some(connect))
            .await
            .map_err(|e| error(&format!("cannot connect to {endpoints}"), e))?;
        let session = grant(&client, options.session_ttl)
            .await
            .map_err(|e| error(&format!("cannot open a session with {endpoints}"), e))?;
        let inner = Arc::new(Inner {
            endpoints: endpoints.to_owned(),
            options,
            client,
            session: tokio::sync::watch::Sender::new(session),
            lost: Arc::new(tokio::sync::Notify::new()),
            next_key: AtomicU64::new(0),
            seen: quick_cache::sync::Cache::new(REMEMBERED),
            holdings: quick_cache::sync::Cache::new(REMEMBERED),
            wakeups: AtomicU64::new(0),
            epoch: (Instant::now(), Timestamp::now()),
        });
        tokio::spawn(keep_alive(Arc::downgrade(&inner)));
        tokio::spawn(sweep(Arc::downgrade(&inner)));
        Ok(Self { inner })
    }

    /// How many times a waiter in a queue was woken by its watch since the store was made: at
    /// most a few per hand-off (a predecessor taking the lock, then leaving it), however many
    /// wait.
    pub fn wakeups(&self) -> u64 {
        self.inner.wakeups.load(Ordering::Relaxed)
    }

    fn locks_dir(&self) -> String {
        format!("{}/locks/", self.inner.options.prefix)
    }

    fn parent(&self, name: &LockName) -> String {
        format!("{}{}/", self.locks_dir(), name.digest_hex())
    }

    /// The wall clock's time at `moment` (an end never reached: the longest lease from now).
    fn wall(&self, moment: Option<Instant>) -> Timestamp {
        let (base, at) = self.inner.epoch;
        match moment {
            Some(moment) => match moment.checked_duration_since(base) {
                Some(after) => at.saturating_add(after),
                None => at.saturating_sub(base.duration_since(moment)),
            },
            None => Timestamp::now()
                .saturating_add(Duration::from_millis(idem_core::lock::MAX_LEASE_MILLIS)),
        }
    }

    fn client(&self) -> etcd::Client {
        self.inner.client.clone()
    }

    /// The session's lease now.
    fn session(&self) -> i64 {
        self.inner.session.borrow().id
    }

    /// Waits (up to 5 s) for the keep-alive task to open a session after `ended`; whether it
    /// did.
    async fn new_session_after(&self, ended: i64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.session() != ended {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// A new key's name for `owner`, unique to this store's session.
    fn new_key(&self, parent: &str, owner: &str) -> Vec<u8> {
        let n = self.inner.next_key.fetch_add(1, Ordering::Relaxed);
        format!("{parent}{owner}-{:x}-{n:x}", self.session()).into_bytes()
    }
}

impl Drop for Inner {
    /// Ends the session, so that what it holds is free at once rather than when its lease
    /// runs out. Outside a runtime the lease runs out by itself.
    fn drop(&mut self) {
        let lease = self.session.borrow().id;
        let mut leases = self.client.lease_client();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = leases.revoke(lease).await;
            });
        }
    }
}

/// A lease's length as the cluster answered it, in seconds.
fn ttl_of(secs: i64) -> Duration {
    Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}

/// Grants a session lease of `ttl`.
async fn grant(client: &etcd::Client, ttl: Duration) -> Result<Vouched, etcd::Error> {
    let secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX).max(1);
    let sent = Instant::now();
    let granted = client.lease_client().grant(secs, None).await?;
    Ok(Vouched::new(granted.id(), sent, ttl_of(granted.ttl())))
}

/// Keeps the session's lease alive (a keep-alive a third of its length apart), and grants a
/// new one once it has ended, until the store is dropped. Keys of an ended session are gone,
/// so its holders learn at their next renewal that they hold nothing.
async fn keep_alive(inner: std::sync::Weak<Inner>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let locks = EtcdLocks { inner: strong };
        let lease = locks.session();
        let every = locks.inner.options.session_ttl / 3;
        let ended = match locks.client().lease_client().keep_alive(lease).await {
            Ok((mut keeper, mut stream)) => {
                drop(locks);
                loop {
                    let sent = Instant::now();
                    let answer = async {
                        keeper.keep_alive().await?;
                        stream.message().await
                    };
                    match answer.await {
                        Ok(Some(answer)) if answer.ttl() > 0 => {
                            backoff = Duration::from_millis(100);
                            if let Some(strong) = inner.upgrade() {
                                session::extend(&strong.session, lease, sent, ttl_of(answer.ttl()));
                            }
                        }
                        // The cluster says the lease is gone.
                        Ok(Some(_)) => break true,
                        // The stream ended without a word: the lease is asked after.
                        Ok(None) => break false,
                        Err(e) => {
                            tracing::debug!(error = %e, "an etcd keep-alive failed");
                            break false;
                        }
                    }
                    let Some(strong) = inner.upgrade() else {
                        return;
                    };
                    let lost = Arc::clone(&strong.lost);
                    drop(strong);
                    tokio::select! {
                        () = tokio::time::sleep(every) => {}
                        () = lost.notified() => break false,
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot keep the etcd session alive");
                false
            }
        };
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let locks = EtcdLocks { inner: strong };
        // A keep-alive that failed is tried again; one answered "gone" (or an operation that
        // found the lease gone) ends the session.
        let gone = ended
            || matches!(
                locks.client().lease_client().time_to_live(lease, None).await,
                Ok(answer) if answer.ttl() <= 0
            );
        if gone {
            // Its keys are gone already: its holders hear it now, not when it would have run
            // out, whether or not a new session can be had.
            session::end(&locks.inner.session, lease);
            match grant(&locks.inner.client, locks.inner.options.session_ttl).await {
                Ok(new) => {
                    tracing::warn!("etcd session ended; opened a new one");
                    locks.inner.session.send_replace(new);
                    continue;
                }
                Err(e) => tracing::debug!(error = %e, "cannot open a new etcd session"),
            }
        }
        drop(locks);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// An etcd error as a store error: transient where a retry may succeed.
fn error(what: &str, e: etcd::Error) -> StoreError {
    let message = format!("etcd: {what}: {e}");
    if transient(&e) {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
}

/// Whether a retry of what failed with `e` may succeed.
fn transient(e: &etcd::Error) -> bool {
    match e {
        etcd::Error::TransportError(_) | etcd::Error::IoError(_) => true,
        etcd::Error::GRpcStatus(status) => matches!(
            status.code(),
            tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Cancelled
                | tonic::Code::Aborted
                | tonic::Code::ResourceExhausted
                | tonic::Code::Unknown
                | tonic::Code::NotFound
        ),
        _ => false,
    }
}

/// Whether `e` says the session's lease is gone (a write attached to it was refused).
fn lease_gone(e: &etcd::Error) -> bool {
    matches!(e, etcd::Error::GRpcStatus(s)
        if s.code() == tonic::Code::NotFound && s.message().contains("lease not found"))
}

/// How often a session's leftovers are swept: keys released, or dead, an hour ago.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

async fn sweep(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let locks = EtcdLocks { inner };
        if let Err(e) = queue::sweep_once(&locks).await {
            tracing::debug!(error = %e, "sweeping old lock keys failed");
        }
    }
}

impl LockStore for EtcdLocks {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        queue::Lock::new(self, name, owner).try_acquire(lease).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<idem_core::Held, LockError> {
        queue::Lock::new(self, name, owner)
            .renew(fence, lease)
            .await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        queue::Lock::new(self, name, owner).release(fence).await
    }

    fn listen(&self) -> Option<Box<dyn idem_core::ReleaseListener>> {
        // Waiters wait in the queue (`acquire_queued`), woken by their predecessor.
        None
    }

    /// Resolves once the session's lease is gone, or no keep-alive was answered for as long
    /// as the cluster keeps it: from then on the cluster may have deleted its keys.
    fn session_end(&self) -> Option<idem_core::BoxFuture<'static, ()>> {
        Some(session::ended(&self.inner.session))
    }

    fn acquire_queued(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
        wait: Duration,
    ) -> Option<idem_core::BoxFuture<'static, Result<Queued, StoreError>>> {
        let (locks, name) = (self.clone(), name.clone());
        Some(Box::pin(async move {
            queue::Lock::new(&locks, &name, owner)
                .wait(lease, wait)
                .await
        }))
    }

    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        queue::held(self, limit).await.map(Some)
    }
}
