//! Locks in Redis, single node or Cluster.
//!
//! A lock is one string, `<prefix>lock:{<digest>}` (the digest being 128 bits of SHA-256 of
//! the name, its own hash tag), holding `<fence> <lease end> <owner> <name>`: the last owner's
//! fence, its lease end (ms, by the server's clock), its digest and the name (for listings of
//! held locks). Each operation is one Lua script applying [`LockState`](idem_core::LockState)'s
//! rules with the server's clock (`TIME`), so clients' clocks never decide who holds a lock,
//! and the fence is computed in the same step as the lock is taken: `max(fence + 1, TIME in
//! µs)`. A state written as a hash (fields `o`, `f`, `e`, `n`: the layout before) is read by
//! every script and the listing, and becomes a string at its next write; an instance of the
//! hash layout refuses a string state (`WRONGTYPE`), so while both run, its lock calls fail
//! rather than take a lock held by the other kind.
//!
//! **Plain releases.** Where the server compares and sets a value (`SET … IFEQ`, the same
//! servers as the records' plain settles), the holder knows the exact state its acquire or
//! renewal wrote (the answer carries the fence and lease end), so a release is one pipeline
//! of `SET key released IFEQ held PX retention` and the `PUBLISH` that wakes waiters (on a
//! Cluster the `PUBLISH` follows the `SET`: its channel hashes to another slot): the
//! server writes the released state (lease end 0, the fence kept) exactly when the lock is
//! still as this holder left it, when the script would have released it too. Anything else
//! (`nil`: renewed elsewhere, taken over, already released) goes to the script, which
//! decides. A renewal stays a script: its lease end is read from the server's clock.
//!
//! The hash outlives the lease by [`LOCK_STATE_RETENTION`] (native TTL), so a late release by
//! the last owner is recognised; after that, or when the server lost its data (a restart
//! without persistence, a failover to a replica that missed the last writes), the fence's
//! clock term still makes the next fence higher.
//!
//! A release publishes the name on `<prefix>lock-released`. The store subscribes once (its own
//! connection, opened when the first waiter listens and closed when none has listened for a
//! while) and wakes its waiters. A Cluster delivers every `PUBLISH` to every node, so there
//! the store subscribes on the first node it was given; while that node is down, waiters poll.

use std::sync::Arc;
use std::time::Duration;

use idem_core::lock::{LOCK_STATE_RETENTION, lease_millis};
use idem_core::{
    Acquire, Held, HeldLock, LockError, LockName, LockStore, OwnerDigest, ReleaseListener,
    StoreError, Timestamp,
};
use redis::Value;

use super::admin::{BATCH, Node};
use super::conn::Lua;
use super::error::{corrupt, error};
use super::plain::refused_ifeq;
use super::scripts::{CLOCK, FENCED_SET, LOCK_ACQUIRE, LOCK_RELEASE, LOCK_RENEW, LOCK_STATE};
use super::{Conn, RedisStore};
use crate::fenced::Fenced;
use crate::lock_wakeup::{FeedTask, ReleaseFeed};

/// The lock scripts and the release feed, shared by a store's clones.
pub(crate) struct LockScripts {
    acquire: Lua,
    renew: Lua,
    release: Lua,
    fenced_set: Lua,
    feed: ReleaseFeed,
}

impl LockScripts {
    pub(crate) fn new() -> Self {
        let script = |body: &str| Lua::new(&format!("{CLOCK}{LOCK_STATE}{body}"));
        Self {
            acquire: script(LOCK_ACQUIRE),
            renew: script(LOCK_RENEW),
            release: script(LOCK_RELEASE),
            fenced_set: Lua::new(FENCED_SET),
            feed: ReleaseFeed::new(),
        }
    }
}

/// A lock's state as the scripts write it: `<fence> <lease end ms> <owner> <name>`.
fn state(fence: u64, expires: u64, owner: &str, name: &str) -> String {
    format!("{fence} {expires} {owner} {name}")
}

/// The name, fence and lease end of a lock state, if `value` is one.
fn parse_state(value: &[u8]) -> Option<(String, u64, u64)> {
    let text = std::str::from_utf8(value).ok()?;
    let mut parts = text.splitn(4, ' ');
    let fence = parts.next()?.parse().ok()?;
    let expires = parts.next()?.parse().ok()?;
    let _owner = parts.next()?;
    Some((parts.next()?.to_owned(), fence, expires))
}

/// The full source of the acquire and release scripts, for measuring them on their own
/// (`redis-benchmark`), beside the store.
#[doc(hidden)]
pub fn lock_scripts() -> (String, String) {
    (
        format!("{CLOCK}{LOCK_STATE}{LOCK_ACQUIRE}"),
        format!("{CLOCK}{LOCK_STATE}{LOCK_RELEASE}"),
    )
}

impl RedisStore {
    fn lock_key(&self, name: &LockName) -> String {
        format!("{}lock:{{{}}}", self.prefix, name.digest_hex())
    }

    /// Notes the state a holding wrote, where releases may go as plain commands.
    fn note_held(&self, key: &str, owner: &str, held: Held) {
        self.plain
            .note_holding(key, held.fence, owner, held.expires_at);
    }

    /// Releases the holding with one `SET … IFEQ` of the state it wrote, and wakes waiters
    /// (see the module's notes): `true` if it did; `false` if it is the script's to decide.
    async fn released_plainly(
        &self,
        key: &str,
        owner: &str,
        name: &LockName,
        fence: u64,
    ) -> Result<bool, StoreError> {
        let Some(expires) = self.plain.take_holding(key, fence, owner) else {
            return Ok(false);
        };
        let written = state(fence, expires, owner, name.as_str());
        let mut set = redis::cmd("SET");
        set.arg(key)
            .arg(state(fence, 0, owner, name.as_str()))
            .arg("IFEQ")
            .arg(written)
            .arg("PX")
            .arg(retention());
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(self.release_channel()).arg(name.as_str());
        let failed = |e| error("cannot release the lock", e);
        let answer = match self.conn {
            // One round trip (the `PUBLISH` wakes waiters for nothing when the state had
            // moved on; the script then releases it and publishes again).
            Conn::Single(_) => {
                let mut pipe = redis::pipe();
                pipe.ignore_errors().add_command(set).add_command(publish);
                let answers: Vec<redis::RedisResult<Value>> = pipe
                    .query_async(&mut self.conn.clone())
                    .await
                    .map_err(failed)?;
                answers.into_iter().next().unwrap_or(Ok(Value::Nil))
            }
            // A Cluster routes the channel as a key, to another slot than the lock's: the
            // `PUBLISH` follows once the `SET` is done.
            Conn::Cluster(_) => {
                let answer = set.query_async(&mut self.conn.clone()).await;
                if matches!(answer, Ok(Value::Okay)) {
                    publish
                        .query_async::<Value>(&mut self.conn.clone())
                        .await
                        .map_err(failed)?;
                }
                answer
            }
        };
        match answer {
            Ok(Value::Okay) => Ok(true),
            Err(e) if refused_ifeq(&e) => {
                self.plain.disable();
                Ok(false)
            }
            Err(e) => Err(failed(e)),
            // Changed since (renewed elsewhere, taken over, released): the script decides.
            _ => Ok(false),
        }
    }

    fn release_channel(&self) -> String {
        format!("{}lock-released", self.prefix)
    }

    /// Stores `value` at `key` (a hash of `fence` and `value`, the key exactly as given) unless
    /// a higher fence was stored there before: a resource that refuses a lock holder which
    /// lost its lock. See [`crate::fenced`].
    pub async fn fenced_set(
        &self,
        key: &str,
        fence: u64,
        value: &[u8],
    ) -> Result<Fenced, StoreError> {
        let answer: Vec<Value> = self
            .locks
            .fenced_set
            .key(key)
            .arg(crate::fenced::checked_fence(fence)?)
            .arg(value)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot write the fenced value", e))?;
        match answer.as_slice() {
            [Value::Int(1)] => Ok(Fenced::Accepted),
            [Value::Int(0), highest] => Ok(Fenced::Stale {
                highest: u64::try_from(number(highest, "fence")?).map_err(|_| corrupt("fence"))?,
            }),
            _ => Err(corrupt("fenced write answer")),
        }
    }

    /// The fence and value [`RedisStore::fenced_set`] stored at `key`, if any.
    pub async fn fenced_get(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, StoreError> {
        let (fence, value): (Option<u64>, Option<Vec<u8>>) = redis::cmd("HMGET")
            .arg(key)
            .arg("fence")
            .arg("value")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot read the fenced value", e))?;
        Ok(fence.zip(value))
    }

    /// The locks at `keys` on `node` held by that node's clock, read after them. A key that
    /// holds no lock state with a name (a value this store did not write) is skipped.
    async fn held_of(&self, node: Node, keys: &[String]) -> Result<Vec<HeldLock>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for key in keys {
            pipe.cmd("GET").arg(key);
        }
        pipe.cmd("TIME");
        let mut values = self
            .pipeline(node, pipe, keys.len() + 1)
            .await
            .map_err(|e| error("cannot read the locks", e))?;
        let (secs, micros): (u64, u64) = values
            .pop()
            .and_then(|t| redis::from_redis_value(t).ok())
            .ok_or_else(|| corrupt("answer to TIME"))?;
        let now = secs.saturating_mul(1000).saturating_add(micros / 1000);
        let mut states = Vec::new();
        // States still in the hash layout (GET refuses them), read as hashes.
        let mut hashes = Vec::new();
        for (key, value) in keys.iter().zip(values) {
            match value {
                Value::BulkString(v) => states.extend(parse_state(&v)),
                Value::ServerError(_) => hashes.push(key),
                _ => {}
            }
        }
        if !hashes.is_empty() {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for key in &hashes {
                pipe.cmd("HMGET").arg(key).arg("n").arg("f").arg("e");
            }
            let values = self
                .pipeline(node, pipe, hashes.len())
                .await
                .map_err(|e| error("cannot read the locks", e))?;
            states.extend(
                values
                    .into_iter()
                    .filter_map(|v| redis::from_redis_value(v).ok()),
            );
        }
        Ok(states
            .into_iter()
            .filter_map(|(name, fence, expires): (String, u64, u64)| {
                if expires <= now {
                    return None;
                }
                Some(HeldLock {
                    name: LockName::new(&name).ok()?,
                    fence,
                    expires_at: Timestamp::from_millis(expires),
                })
            })
            .collect())
    }
}

fn retention() -> u64 {
    lease_millis(LOCK_STATE_RETENTION)
}

fn number(v: &Value, what: &str) -> Result<i64, StoreError> {
    match v {
        Value::Int(i) => Ok(*i),
        _ => Err(corrupt(what)),
    }
}

fn timestamp(v: &Value, what: &str) -> Result<Timestamp, StoreError> {
    let ms = u64::try_from(number(v, what)?).map_err(|_| corrupt(what))?;
    Ok(Timestamp::from_millis(ms))
}

impl LockStore for RedisStore {
    fn kind(&self) -> &'static str {
        idem_core::Store::kind(self)
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        lease: Duration,
    ) -> Result<Acquire, StoreError> {
        let (key, owner) = (self.lock_key(name), owner.to_hex());
        let answer: Vec<Value> = self
            .locks
            .acquire
            .key(&key)
            .arg(&owner)
            .arg(lease_millis(lease))
            .arg(retention())
            .arg(name.as_str())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot acquire the lock", e))?;
        match answer.as_slice() {
            [Value::Int(1), fence, expires] => {
                let held = Held {
                    fence: u64::try_from(number(fence, "lock fence")?)
                        .map_err(|_| corrupt("lock fence"))?,
                    expires_at: timestamp(expires, "lock expiry")?,
                };
                self.note_held(&key, &owner, held);
                Ok(Acquire::Acquired(held))
            }
            [Value::Int(0), until] => Ok(Acquire::Busy {
                until: timestamp(until, "lock expiry")?,
            }),
            _ => Err(corrupt("lock answer")),
        }
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
        lease: Duration,
    ) -> Result<Held, LockError> {
        let (key, owner) = (self.lock_key(name), owner.to_hex());
        // The state changes whatever the answer: a release goes by the script unless this
        // renewal says what it wrote.
        self.plain.take_holding(&key, fence, &owner);
        let answer: i64 = self
            .locks
            .renew
            .key(&key)
            .arg(&owner)
            .arg(fence)
            .arg(lease_millis(lease))
            .arg(retention())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot renew the lock", e))?;
        let expires = u64::try_from(answer).map_err(|_| LockError::NotOwner)?;
        let held = Held {
            fence,
            expires_at: Timestamp::from_millis(expires),
        };
        self.note_held(&key, &owner, held);
        Ok(held)
    }

    async fn release(
        &self,
        name: &LockName,
        owner: OwnerDigest,
        fence: u64,
    ) -> Result<(), LockError> {
        let (key, owner) = (self.lock_key(name), owner.to_hex());
        if self.released_plainly(&key, &owner, name, fence).await? {
            return Ok(());
        }
        let answer: i64 = self
            .locks
            .release
            .key(&key)
            .arg(&owner)
            .arg(fence)
            .arg(retention())
            .arg(self.release_channel())
            .arg(name.as_str())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot release the lock", e))?;
        if answer < 0 {
            return Err(LockError::NotOwner);
        }
        Ok(())
    }

    /// By `SCAN` over the lock keys (on a Cluster, each primary in turn), each batch read with
    /// the server's clock of the node it lives on, until `limit` held locks are found: when
    /// more are held, the ones shown are those found first. A lock acquired before names were
    /// kept beside the state is not shown until it is acquired again.
    async fn held(&self, limit: usize) -> Result<Option<Vec<HeldLock>>, StoreError> {
        let pattern = self.key_pattern("lock:");
        let mut held = Vec::new();
        'nodes: for node in self.nodes().await? {
            let mut at = 0;
            while held.len() < limit {
                let (next, keys) = self.scan(node, &pattern, at, BATCH).await?;
                held.extend(self.held_of(node, &keys).await?);
                at = next;
                if at == 0 {
                    continue 'nodes;
                }
            }
            break;
        }
        // `SCAN` may return a key twice.
        held.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        held.dedup_by(|a, b| a.name == b.name);
        held.truncate(limit);
        Ok(Some(held))
    }

    fn listen(&self) -> Option<Box<dyn ReleaseListener>> {
        let client = self.client.as_ref()?;
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let listener = self.locks.feed.listen();
        if let Some(task) = self.locks.feed.claim() {
            runtime.spawn(run_feed(
                redis::Client::clone(client),
                self.release_channel(),
                self.locks.feed.clone(),
                task,
            ));
        }
        Some(listener)
    }
}

/// Forwards the server's release messages to this process's waiters, reconnecting after
/// failures, until nobody has listened for [`FEED_IDLE`](crate::lock_wakeup::FEED_IDLE).
async fn run_feed(client: redis::Client, channel: String, feed: ReleaseFeed, mut task: FeedTask) {
    use futures_core::Stream;
    use std::pin::Pin;

    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub.into_on_message())
        };
        let Ok(Ok(mut stream)) = tokio::time::timeout(Duration::from_secs(5), connected).await
        else {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            if task.stop_if_idle() {
                return;
            }
            continue;
        };
        backoff = Duration::from_millis(50);
        // Releases published while this connection was down were missed.
        feed.send_missed();
        loop {
            let next = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx));
            match tokio::time::timeout(Duration::from_secs(1), next).await {
                Ok(Some(msg)) => {
                    if let Ok(name) = std::str::from_utf8(msg.get_payload_bytes()) {
                        feed.send(Arc::from(name));
                    }
                }
                // The connection ended: connect again.
                Ok(None) => break,
                Err(_) => {}
            }
            if task.idle_too_long() {
                return;
            }
        }
    }
}
