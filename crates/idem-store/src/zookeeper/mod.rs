//! Locks in ZooKeeper (feature `zookeeper`): the recipe of ephemeral sequential nodes, with a
//! lease and a fence on top.
//!
//! # Layout
//!
//! Under the root (`/idem` by default):
//!
//! - `locks/<name digest>`: one container node per lock name (ZooKeeper deletes it once it
//!   has no children), whose data is the name;
//! - under it, one ephemeral sequential node per owner that holds or waits:
//!   `<owner digest>-<sequence>`, whose data is its state and a length of time in
//!   milliseconds: `h <lease>` (holds, or claims to), `w <wait>` (waits) or `r 0` (released);
//! - `clock`: a node written to read the ensemble's time, for listings.
//!
//! # Who holds
//!
//! A node holds the lock when it is in state `h`, its lease has not run out, and no live node
//! comes before it. A node is dead when it is released, or its time has run out: `mtime` (set
//! by the ZooKeeper leader when the node was last written) plus its milliseconds. Whoever
//! finds a dead node ahead of its own deletes it, with the version it read, so a concurrent
//! renewal wins. The lease runs by the ensemble's clock, as other backends use their server's.
//!
//! Nodes are ephemeral: the end of this store's session (a crashed process) removes all of
//! its nodes, holdings and places in queues alike.
//!
//! # Fences
//!
//! The fence of a holding is its node's `czxid`, the id of the transaction that created it.
//! Zxids only rise, across sessions, leader elections (each new epoch is higher) and restarts
//! of the ensemble (they are on disk); a node holds only after every node created before it
//! for the name is gone, so each holding's fence is above every earlier one's.
//!
//! # Waiting
//!
//! [`LockStore::acquire_queued`] keeps the waiter's node in the queue and watches the node
//! just ahead of it (its predecessor) only: a release wakes one waiter, not all of them. A
//! timer covers a predecessor whose lease runs out without a write.

mod queue;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{
    Acquire, HeldLock, LockError, LockName, LockStore, OwnerDigest, Queued, StoreError, Timestamp,
};
use zookeeper_client as zk;

use crate::session::{self, Vouched};

/// How a [`ZooKeeperLocks`] connects.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZooKeeperOptions {
    /// The node every lock lives under (default `/idem`).
    pub root: String,
    /// The session timeout asked for (default 10 s; the ensemble may bound it). A process
    /// that stops answering for this long loses its holdings and places in queues.
    pub session_timeout: Duration,
}

impl Default for ZooKeeperOptions {
    fn default() -> Self {
        Self {
            root: "/idem".to_owned(),
            session_timeout: Duration::from_secs(10),
        }
    }
}

impl ZooKeeperOptions {
    /// With the node every lock lives under.
    #[must_use]
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    /// With the session timeout asked for.
    #[must_use]
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }
}

/// Locks in a ZooKeeper ensemble. Cheap to clone: clones share one session.
#[derive(Clone)]
pub struct ZooKeeperLocks {
    inner: Arc<Inner>,
}

struct Inner {
    hosts: String,
    options: ZooKeeperOptions,
    /// The session; replaced by a new one once it has ended (expired or closed).
    client: tokio::sync::Mutex<zk::Client>,
    /// The session in `client`, and until when the ensemble keeps it at least (see
    /// [`vouch`]); replaced with it.
    session: tokio::sync::watch::Sender<Vouched>,
    /// How many times a waiter was woken by its watch.
    wakeups: AtomicU64,
    /// The holdings this store granted or renewed: their node and its version, so that a
    /// renewal and a release are one conditional write (the version check makes a stale
    /// entry harmless: it falls back to reading the queue).
    holdings: quick_cache::sync::Cache<(String, u64), queue::Holding>,
}

/// How many holdings a store remembers.
const HOLDINGS: usize = 16_384;

impl std::fmt::Debug for ZooKeeperLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperLocks")
            .field("hosts", &self.inner.hosts)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl ZooKeeperLocks {
    /// Connects to the ensemble at `hosts` (`host:port[,host:port…]`). Fails if no member
    /// answers, or the root is not a valid path.
    pub async fn connect(hosts: &str, options: ZooKeeperOptions) -> Result<Self, StoreError> {
        let root = options.root.trim_end_matches('/');
        if !root.starts_with('/')
            || root
                .split('/')
                .skip(1)
                .any(|part| part.is_empty() || part == "." || part == "..")
        {
            return Err(StoreError::Backend {
                message: format!(
                    "invalid ZooKeeper root {:?}: an absolute path such as /idem",
                    options.root
                ),
                source: None,
            });
        }
        let options = ZooKeeperOptions {
            root: root.to_owned(),
            ..options
        };
        let sent = Instant::now();
        let client = session(hosts, options.session_timeout).await?;
        let inner = Arc::new(Inner {
            hosts: hosts.to_owned(),
            options,
            session: tokio::sync::watch::Sender::new(vouched(&client, sent)),
            client: tokio::sync::Mutex::new(client),
            wakeups: AtomicU64::new(0),
            holdings: quick_cache::sync::Cache::new(HOLDINGS),
        });
        let locks = Self { inner };
        let dir = locks.locks_dir();
        let client = locks.client().await?;
        client
            .mkdir(
                &dir,
                &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
            )
            .await
            .map_err(|e| error("cannot create the locks' node", e))?;
        tokio::spawn(sweep(Arc::downgrade(&locks.inner)));
        tokio::spawn(vouch(Arc::downgrade(&locks.inner)));
        Ok(locks)
    }

    /// How many times a waiter in a queue was woken by its watch since the store was made: at
    /// most a few per hand-off (a predecessor taking the lock, then leaving it), however many
    /// wait; 8 for 8 waiters served one after another in `a_release_wakes_only_the_next_waiter`.
    pub fn wakeups(&self) -> u64 {
        self.inner.wakeups.load(Ordering::Relaxed)
    }

    fn locks_dir(&self) -> String {
        format!("{}/locks", self.inner.options.root)
    }

    fn parent(&self, name: &LockName) -> String {
        format!("{}/{}", self.locks_dir(), name.digest_hex())
    }

    /// The session, opened again if it has ended.
    async fn client(&self) -> Result<zk::Client, StoreError> {
        let mut client = self.inner.client.lock().await;
        if client.state().is_terminated() {
            tracing::warn!("ZooKeeper session ended; opening a new one");
            let sent = Instant::now();
            *client = session(&self.inner.hosts, self.inner.options.session_timeout).await?;
            self.inner.session.send_replace(vouched(&client, sent));
        }
        Ok(client.clone())
    }

    /// The ensemble's time now: the `mtime` of a write to the clock node.
    async fn now(&self, client: &zk::Client) -> Result<i64, StoreError> {
        let path = format!("{}/clock", self.inner.options.root);
        let stat = match client.set_data(&path, b"", None).await {
            Err(zk::Error::NoNode) => {
                let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                match client.create(&path, b"", &persistent).await {
                    Ok(_) | Err(zk::Error::NodeExists) => {}
                    Err(e) => return Err(error("cannot create the clock node", e)),
                }
                client.set_data(&path, b"", None).await
            }
            other => other,
        }
        .map_err(|e| error("cannot read the ensemble's time", e))?;
        Ok(stat.mtime)
    }
}

/// How long after a request of its own was sent the ensemble keeps `client`'s session at
/// least: the negotiated timeout, less a fifth for the member it talks to, which hears the
/// request, to pass it on to the leader, which expires sessions.
fn keeps(client: &zk::Client) -> Duration {
    let timeout = client.session_timeout();
    timeout - timeout / 5
}

/// `client`'s session, kept at least until [`keeps`] after `sent`.
fn vouched(client: &zk::Client, sent: Instant) -> Vouched {
    Vouched::new(client.session_id().0, sent, keeps(client))
}

/// Asks the ensemble a third of the session apart whether it still has the session: a `sync`,
/// which the member the client talks to passes on to the leader, so that a member cut off from
/// the leader does not answer for it. Each answer keeps the session's holdings until
/// [`keeps`] after it was sent; a session that found none for that long is over for its
/// holders ([`LockStore::session_end`]), whatever the client library says of its connection
/// (it may go on reporting a connection as up well past the session's end).
async fn vouch(inner: std::sync::Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let locks = ZooKeeperLocks { inner: strong };
        let every = locks.inner.options.session_timeout / 3;
        if let Ok(client) = locks.client().await {
            let (id, keeps) = (client.session_id().0, keeps(&client));
            let sent = Instant::now();
            let dir = locks.locks_dir();
            match tokio::time::timeout(every, client.sync(&dir)).await {
                Ok(Ok(())) => session::extend(&locks.inner.session, id, sent, keeps),
                Ok(Err(zk::Error::SessionExpired)) => session::end(&locks.inner.session, id),
                _ => {}
            }
        }
        drop(locks);
        tokio::time::sleep(every).await;
    }
}

async fn session(hosts: &str, timeout: Duration) -> Result<zk::Client, StoreError> {
    zk::Client::connector()
        .with_session_timeout(timeout)
        .with_connection_timeout(Duration::from_secs(5))
        .with_fail_eagerly()
        .connect(hosts)
        .await
        .map_err(|e| error(&format!("cannot open a session with {hosts}"), e))
}

/// A ZooKeeper error as a store error: transient where a retry may succeed.
fn error(what: &str, e: zk::Error) -> StoreError {
    use zk::Error::*;
    let message = format!("ZooKeeper: {what}: {e}");
    match e {
        ConnectionLoss | Timeout | SessionExpired | ClientClosed | NoHosts | Throttled
        | SessionMoved | NotReadOnly => StoreError::unavailable(message, e),
        _ => StoreError::backend(message, e),
    }
}

/// What often a session's leftovers are swept: released nodes, and nodes whose time ran out
/// long ago, kept until then so that a late release by their owner is still recognised.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Deletes this session's nodes that are dead for longer than
/// [`LOCK_STATE_RETENTION`](idem_core::lock::LOCK_STATE_RETENTION), until the store is dropped.
async fn sweep(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let locks = ZooKeeperLocks { inner };
        if let Err(e) = queue::sweep_once(&locks).await {
            tracing::debug!(error = %e, "sweeping old lock nodes failed");
        }
    }
}

impl LockStore for ZooKeeperLocks {
    fn kind(&self) -> &'static str {
        "zookeeper"
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        queue::Lock::new(self, name, owner)
            .await?
            .try_acquire(lease)
            .await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<idem_core::Held, LockError> {
        queue::Lock::new(self, name, owner)
            .await?
            .renew(fence, lease)
            .await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        queue::Lock::new(self, name, owner)
            .await?
            .release(fence)
            .await
    }

    fn listen(&self) -> Option<Box<dyn idem_core::ReleaseListener>> {
        // Waiters wait in the queue (`acquire_queued`), woken by their predecessor.
        None
    }

    /// Resolves once the session was replaced, or no `sync` (sent a third of the session
    /// apart, passed on to the leader) was answered for as long as the ensemble surely keeps a
    /// session it hears nothing from: from then on the ensemble may have expired it and given
    /// its nodes' locks to the next owners.
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
                .await?
                .wait(lease, wait)
                .await
        }))
    }

    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        queue::held(self, limit).await.map(Some)
    }
}

/// A time in milliseconds from ZooKeeper as a timestamp (never before the epoch).
fn timestamp(ms: i64) -> Timestamp {
    Timestamp::from_millis(u64::try_from(ms).unwrap_or(0))
}
