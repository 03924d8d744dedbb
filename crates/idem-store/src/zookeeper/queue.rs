//! The recipe: one lock name's queue of nodes, and what each operation does with it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::lock::{LOCK_STATE_RETENTION, lease_millis};
use idem_core::{Acquire, Held, HeldLock, LockError, LockName, OwnerDigest, Queued, StoreError};
use zookeeper_client as zk;

use super::{ZooKeeperLocks, error, timestamp};

/// How much longer than its wait a waiter's node lives before others may delete it (a
/// waiter that could not leave the queue itself, its process still up).
const WAIT_SLACK_MS: u64 = 2_000;

/// How long after a predecessor's lease end, by the ensemble's clock, a waiter looks again:
/// the two clocks' rates differ a little.
const TIMER_SLACK: Duration = Duration::from_millis(5);

/// A node's state, as its data says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Holds (`h`): written only by an owner that found nothing alive ahead of it.
    Held,
    /// A claim of an acquire that does not wait (`c`): it holds if it was made with nothing
    /// ahead of it (and says so by nothing more: a free lock is taken with one write), or
    /// once it turns `h`; otherwise it is withdrawn.
    Claimed,
    /// Waits (`w`).
    Waiting,
    /// Released (`r`): dead at once.
    Released,
}

/// A node's data: its state, and how long after its last write it stays alive.
#[derive(Debug, Clone, Copy)]
struct Entry {
    state: State,
    millis: u64,
}

impl Entry {
    fn encode(self) -> Vec<u8> {
        let tag = match self.state {
            State::Held => 'h',
            State::Claimed => 'c',
            State::Waiting => 'w',
            State::Released => 'r',
        };
        format!("{tag} {}", self.millis).into_bytes()
    }

    fn decode(data: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(data).ok()?;
        let (tag, millis) = text.split_once(' ')?;
        let state = match tag {
            "h" => State::Held,
            "c" => State::Claimed,
            "w" => State::Waiting,
            "r" => State::Released,
            _ => return None,
        };
        Some(Self {
            state,
            millis: millis.parse().ok()?,
        })
    }

    /// When the node's time runs out, by the ensemble's clock.
    fn ends(self, stat: &zk::Stat) -> i64 {
        stat.mtime
            .saturating_add(i64::try_from(self.millis).unwrap_or(i64::MAX))
    }

    /// Whether the node no longer counts at `now`.
    fn dead(self, stat: &zk::Stat, now: i64) -> bool {
        self.state == State::Released || self.ends(stat) <= now
    }

    /// Whether the node is a holding (or a claim that may be one) with this lease.
    fn holds(self) -> bool {
        matches!(self.state, State::Held | State::Claimed)
    }
}

const RELEASED: Entry = Entry {
    state: State::Released,
    millis: 0,
};

/// One child of a lock's node.
#[derive(Debug, Clone)]
struct Node {
    path: String,
    owner: bool,
    seq: i64,
}

/// What is ahead of a node in the queue.
enum Ahead {
    /// Nothing alive: the node is first.
    Nothing,
    /// The live node just ahead: its path, the version read, when its time runs out, and
    /// whether it is the first node of all (so that once it is gone, nothing is ahead: nodes
    /// between it and this one were dead, and no node is ever made ahead of an older one).
    Behind {
        predecessor: String,
        version: i32,
        ends: i64,
        first: bool,
    },
}

/// How long an acquire that does not wait waits for a claim ahead of it to hold or withdraw.
const DECIDE_WAIT: Duration = Duration::from_secs(1);

/// What an acquire that does not wait finds ahead of its claim.
enum Judged {
    /// Nothing alive; `alone` if nothing at all was there; the dead nodes to clear (path and
    /// version read).
    Free {
        alone: bool,
        dead: Vec<(String, i32)>,
    },
    /// A holding, until this lease end.
    Held { until: i64 },
    /// A claim or waiter that may hold or withdraw: its path, version and end.
    Undecided {
        path: String,
        version: i32,
        ends: i64,
    },
}

/// What came of a waiter's step: the lock, or what to do next.
enum Taken {
    Held(Queued),
    /// The waiter's node is gone (deleted as a waiter whose time ran out): it joins the
    /// queue again.
    Gone,
    /// What is ahead changed: the queue is read again.
    Changed,
    /// The predecessor's time ran out by the waiter's timer: the ensemble's time is read
    /// (by a write to the waiter's node) before the queue is.
    Late,
}

/// A holding this store granted or renewed, as it last wrote it.
#[derive(Debug, Clone)]
pub(super) struct Holding {
    path: String,
    version: i32,
    entry_ends: i64,
}

/// One lock name, as one owner sees it.
pub(super) struct Lock<'a> {
    locks: &'a ZooKeeperLocks,
    client: zk::Client,
    name: &'a LockName,
    parent: String,
    owner: String,
}

impl<'a> Lock<'a> {
    pub(super) async fn new(
        locks: &'a ZooKeeperLocks,
        name: &'a LockName,
        owner: OwnerDigest,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            client: locks.client().await?,
            parent: locks.parent(name),
            owner: owner.to_hex(),
            locks,
            name,
        })
    }

    /// The nodes under the lock's node, oldest first (none if it has no node).
    async fn nodes(&self) -> Result<Vec<Node>, StoreError> {
        let names = match self.client.list_children(&self.parent).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(e) => return Err(error("cannot list a lock's queue", e)),
        };
        let mut nodes: Vec<Node> = names
            .into_iter()
            .filter_map(|child| {
                let (owner, seq) = child.rsplit_once('-')?;
                Some(Node {
                    owner: owner == self.owner,
                    seq: seq.parse().ok()?,
                    path: format!("{}/{child}", self.parent),
                })
            })
            .collect();
        nodes.sort_by_key(|n| n.seq);
        Ok(nodes)
    }

    /// A node's entry and stat; `None` if it is gone (or holds what no version of idem
    /// writes, which is never taken for a holding).
    async fn read(&self, path: &str) -> Result<Option<(Entry, zk::Stat)>, StoreError> {
        match self.client.get_data(path).await {
            Ok((data, stat)) => Ok(Entry::decode(&data).map(|e| (e, stat))),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(error("cannot read a lock node", e)),
        }
    }

    /// Deletes a node if it is still at `version`; whether it is gone (deleted, or already
    /// gone). A newer version (a renewal) keeps it.
    async fn delete(&self, path: &str, version: i32) -> Result<bool, StoreError> {
        match self.client.delete(path, Some(version)).await {
            Ok(()) | Err(zk::Error::NoNode) => Ok(true),
            Err(zk::Error::BadVersion) => Ok(false),
            Err(e) => Err(error("cannot delete a lock node", e)),
        }
    }

    /// Creates this owner's node with `entry`: its path and stat.
    async fn create(&self, entry: Entry) -> Result<(Node, zk::Stat), StoreError> {
        let prefix = format!("{}/{}-", self.parent, self.owner);
        let data = entry.encode();
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        for _ in 0..3 {
            match self.client.create(&prefix, &data, &ephemeral).await {
                Ok((stat, seq)) => {
                    let node = Node {
                        path: format!("{prefix}{seq}"),
                        owner: true,
                        seq: seq.into_i64(),
                    };
                    return Ok((node, stat));
                }
                // The lock's node is missing, or was just deleted as empty: make it again.
                Err(zk::Error::NoNode) => self.create_parent().await?,
                Err(e) => return Err(error("cannot create a lock node", e)),
            }
        }
        Err(StoreError::unavailable(
            "ZooKeeper: a lock's node kept disappearing",
            std::io::Error::other("NoNode"),
        ))
    }

    async fn create_parent(&self) -> Result<(), StoreError> {
        let container = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
        match self
            .client
            .create(&self.parent, self.name.as_str().as_bytes(), &container)
            .await
        {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(e) => Err(error("cannot create a lock's node", e)),
        }
    }

    /// Walks back from `mine` (at `seq`), deleting the dead nodes ahead of it, to the first
    /// live one; `now` is the ensemble's time of a write made after every node ahead existed.
    async fn ahead(&self, seq: i64, now: i64) -> Result<Ahead, StoreError> {
        let nodes = self.nodes().await?;
        self.ahead_in(&nodes, seq, now).await
    }

    /// As [`Lock::ahead`], in a listing already made after the node at `seq` was.
    async fn ahead_in(&self, nodes: &[Node], seq: i64, now: i64) -> Result<Ahead, StoreError> {
        let head = nodes.first().map(|n| n.seq);
        for node in nodes.iter().rev().filter(|n| n.seq < seq) {
            loop {
                let Some((entry, stat)) = self.read(&node.path).await? else {
                    break;
                };
                if !entry.dead(&stat, now) {
                    return Ok(Ahead::Behind {
                        predecessor: node.path.clone(),
                        version: stat.version,
                        ends: entry.ends(&stat),
                        first: head == Some(node.seq),
                    });
                }
                if self.delete(&node.path, stat.version).await? {
                    break;
                }
                // Written since it was read (renewed, released): read it again.
            }
        }
        Ok(Ahead::Nothing)
    }

    /// When the lock is held until, for a `Busy` answer: the lease end of the first live node
    /// that holds, else `now`.
    async fn busy_until(&self, now: i64) -> Result<Acquire, StoreError> {
        let nodes = self.nodes().await?;
        self.busy_until_in(&nodes, now).await
    }

    /// As [`Lock::busy_until`], in a listing already made.
    async fn busy_until_in(&self, nodes: &[Node], now: i64) -> Result<Acquire, StoreError> {
        for node in nodes {
            if let Some((entry, stat)) = self.read(&node.path).await?
                && !entry.dead(&stat, now)
            {
                let ends = if entry.holds() {
                    entry.ends(&stat)
                } else {
                    now
                };
                return Ok(Acquire::Busy {
                    until: timestamp(ends),
                });
            }
        }
        Ok(Acquire::Busy {
            until: timestamp(now),
        })
    }

    /// This owner's node that holds the lock now, extended to `lease` from now; `None` if it
    /// holds none (a node of its own that is dead or released is deleted).
    async fn holding(&self, lease: u64) -> Result<Option<Held>, StoreError> {
        let held = Entry {
            state: State::Held,
            millis: lease,
        };
        for node in self.nodes().await?.into_iter().filter(|n| n.owner) {
            // Read again whenever the node was written in between (a renewal or release of
            // the same owner, through another call): its new state decides.
            loop {
                let Some((entry, stat)) = self.read(&node.path).await? else {
                    break;
                };
                // A released node stays until the next holder's take deletes it: while it is
                // there, a repeated release of that holding is still answered `Ok`, as on
                // every backend, even when this acquire then finds the lock busy.
                if matches!(entry.state, State::Waiting | State::Released) {
                    break;
                }
                let now = if entry.holds() {
                    match self
                        .client
                        .set_data(&node.path, &held.encode(), Some(stat.version))
                        .await
                    {
                        Ok(now) => now,
                        Err(zk::Error::BadVersion) => continue,
                        Err(zk::Error::NoNode) => break,
                        Err(e) => return Err(error("cannot extend a lock's lease", e)),
                    }
                } else {
                    stat
                };
                if entry.holds()
                    && entry.ends(&stat) > now.mtime
                    && matches!(self.ahead(node.seq, now.mtime).await?, Ahead::Nothing)
                {
                    return Ok(Some(self.remember(&node.path, fence(&stat), &now, held)));
                }
                // Released, run out, or not first after all (a claim being withdrawn): a new
                // holding needs a new node.
                if self.delete(&node.path, now.version).await? {
                    break;
                }
            }
        }
        Ok(None)
    }

    /// One attempt: the holding, or who holds it. The claim is made first and the queue
    /// read once after it: with nothing ahead, the claim holds (one write in all). Only an
    /// owner with a node here already (a holding to keep, or one to clear) reads further.
    pub(super) async fn try_acquire(
        &self,
        lease: std::time::Duration,
    ) -> Result<Acquire, StoreError> {
        let lease = lease_millis(lease);
        let claim = Entry {
            state: State::Claimed,
            millis: lease,
        };
        let mut checked = false;
        loop {
            let (node, stat) = self.create(claim).await?;
            // A claim left behind by a failure below would keep others out for a whole lease.
            let mut place = Place::new(self.client.clone(), node.path.clone());
            let mut nodes = self.nodes().await?;
            if !checked && nodes.iter().any(|n| n.owner && n.seq != node.seq) {
                place.leave().await;
                if let Some(held) = self.holding(lease).await? {
                    return Ok(Acquire::Acquired(held));
                }
                checked = true;
                continue;
            }
            let asked = Instant::now();
            loop {
                match self.judge(&nodes, node.seq, stat.ctime).await? {
                    Judged::Free { alone: true, .. } => {
                        place.keep();
                        let held = self.remember(&node.path, fence(&stat), &stat, claim);
                        return Ok(Acquire::Acquired(held));
                    }
                    Judged::Free { alone: false, dead } => {
                        // Nodes were ahead when the claim was made: others may have seen it
                        // undecided, so it says it holds, as it deletes the dead ones.
                        let held = Entry {
                            state: State::Held,
                            millis: lease,
                        };
                        let mut all = self.client.new_multi_writer();
                        for (path, version) in &dead {
                            all.add_delete(path, Some(*version))
                                .map_err(|e| error("cannot take a lock", e))?;
                        }
                        all.add_set_data(&node.path, &held.encode(), Some(stat.version))
                            .map_err(|e| error("cannot take a lock", e))?;
                        match all.commit().await {
                            Ok(results) => {
                                let Some(zk::MultiWriteResult::SetData { stat: written }) =
                                    results.last()
                                else {
                                    return Err(StoreError::backend(
                                        "ZooKeeper: a transaction answered out of shape",
                                        std::io::Error::other("multi"),
                                    ));
                                };
                                place.keep();
                                return Ok(Acquire::Acquired(self.remember(
                                    &node.path,
                                    fence(&stat),
                                    written,
                                    held,
                                )));
                            }
                            // A dead node changed or went since it was read: look again.
                            Err(zk::MultiWriteError::OperationFailed { index, .. })
                                if index < dead.len() =>
                            {
                                nodes = self.nodes().await?;
                            }
                            Err(
                                zk::MultiWriteError::RequestFailed { source }
                                | zk::MultiWriteError::OperationFailed { source, .. },
                            ) => return Err(error("cannot take a lock", source)),
                        }
                    }
                    Judged::Held { until } => {
                        place.leave().await;
                        return Ok(Acquire::Busy {
                            until: timestamp(until),
                        });
                    }
                    Judged::Undecided {
                        path,
                        version,
                        ends,
                    } => {
                        // A claim or waiter that may be withdrawing: its answer comes within
                        // its own round trips. One that takes longer is taken for a holder.
                        if asked.elapsed() >= DECIDE_WAIT {
                            place.leave().await;
                            return Ok(Acquire::Busy {
                                until: timestamp(ends),
                            });
                        }
                        let (exists, watch) = self
                            .client
                            .check_and_watch_stat(&path)
                            .await
                            .map_err(|e| error("cannot watch a lock node", e))?;
                        if exists.is_some_and(|s| s.version == version) {
                            let left = DECIDE_WAIT.saturating_sub(asked.elapsed());
                            let _ = tokio::time::timeout(left, watch.changed()).await;
                        }
                        nodes = self.nodes().await?;
                    }
                }
            }
        }
    }

    /// What is ahead of the claim at `seq`, for an answer that must be true when given:
    /// `Held` only on a live holding (or a claim or waiter first in the queue, about to hold);
    /// `Free` when nothing alive is ahead (`alone`: nothing at all was); `Undecided` when the
    /// first live node is a claim or waiter behind nodes that died, which may be withdrawing
    /// (it saw them alive) or about to hold.
    async fn judge(&self, nodes: &[Node], seq: i64, now: i64) -> Result<Judged, StoreError> {
        let mut alone = true;
        let mut dead = Vec::new();
        let mut first_live: Option<(&Node, i32, i64)> = None;
        for node in nodes.iter().rev().filter(|n| n.seq < seq) {
            alone = false;
            let Some((entry, stat)) = self.read(&node.path).await? else {
                continue;
            };
            // Dead nodes are cleared (with the claim's own `h`, in one transaction) up to the
            // first live one only: those ahead of a claim are its to judge, and it may have
            // seen them alive.
            if entry.dead(&stat, now) {
                if first_live.is_none() {
                    dead.push((node.path.clone(), stat.version));
                }
                continue;
            }
            if entry.state == State::Held {
                return Ok(Judged::Held {
                    until: entry.ends(&stat),
                });
            }
            first_live = first_live.or(Some((node, stat.version, entry.ends(&stat))));
        }
        Ok(match first_live {
            None => Judged::Free { alone, dead },
            // First of all in the listing: nothing was ahead of it, so it holds (a claim) or
            // is about to (a waiter).
            Some((node, _, ends)) if nodes.first().is_some_and(|n| n.seq == node.seq) => {
                Judged::Held { until: ends }
            }
            Some((node, version, ends)) => Judged::Undecided {
                path: node.path.clone(),
                version,
                ends,
            },
        })
    }

    /// Notes the holding `fence` of node `path`, just written as `written` with `entry`: its
    /// fence and lease end.
    fn remember(&self, path: &str, fence: u64, written: &zk::Stat, entry: Entry) -> Held {
        let held = Held {
            fence,
            expires_at: timestamp(entry.ends(written)),
        };
        self.locks.inner.holdings.insert(
            (format!("{}/{}", self.parent, self.owner), held.fence),
            Holding {
                path: path.to_owned(),
                version: written.version,
                entry_ends: entry.ends(written),
            },
        );
        held
    }

    /// The holding with `wanted` as this store last wrote it, if it remembers it.
    fn recall(&self, wanted: u64) -> Option<Holding> {
        let key = (format!("{}/{}", self.parent, self.owner), wanted);
        self.locks.inner.holdings.get(&key)
    }

    fn forget(&self, wanted: u64) {
        let key = (format!("{}/{}", self.parent, self.owner), wanted);
        self.locks.inner.holdings.remove(&key);
    }

    /// Makes this owner's waiting node (as last written, `stat`) the holding. With `dead`,
    /// the predecessor found dead (at that version) is deleted in the same transaction.
    async fn take(
        &self,
        node: &Node,
        stat: &zk::Stat,
        lease: u64,
        dead: Option<(&str, i32)>,
    ) -> Result<Taken, StoreError> {
        let asked = Instant::now();
        let held = Entry {
            state: State::Held,
            millis: lease,
        };
        let data = held.encode();
        let written = match dead {
            None => self
                .client
                .set_data(&node.path, &data, Some(stat.version))
                .await
                .map_err(|e| (0, e)),
            Some((predecessor, version)) => {
                let mut both = self.client.new_multi_writer();
                both.add_delete(predecessor, Some(version))
                    .and_then(|()| both.add_set_data(&node.path, &data, Some(stat.version)))
                    .map_err(|e| error("cannot take a lock", e))?;
                match both.commit().await {
                    Ok(results) => match results.last() {
                        Some(zk::MultiWriteResult::SetData { stat }) => Ok(*stat),
                        _ => {
                            return Err(StoreError::backend(
                                "ZooKeeper: a transaction answered out of shape",
                                std::io::Error::other("multi"),
                            ));
                        }
                    },
                    Err(zk::MultiWriteError::RequestFailed { source }) => Err((1, source)),
                    Err(zk::MultiWriteError::OperationFailed { index, source }) => {
                        Err((index, source))
                    }
                }
            }
        };
        match written {
            Ok(written) => Ok(Taken::Held(Queued {
                answer: Acquire::Acquired(self.remember(&node.path, fence(stat), &written, held)),
                asked,
            })),
            // The predecessor changed after it was read: look again.
            Err((0, zk::Error::NoNode | zk::Error::BadVersion)) if dead.is_some() => {
                Ok(Taken::Changed)
            }
            // This node was deleted, as a waiter whose time ran out.
            Err((_, zk::Error::NoNode | zk::Error::BadVersion)) => Ok(Taken::Gone),
            Err((_, e)) => Err(error("cannot take a lock", e)),
        }
    }

    /// Waits in the queue for up to `wait`, watching the node just ahead only.
    pub(super) async fn wait(&self, lease: Duration, wait: Duration) -> Result<Queued, StoreError> {
        let asked = Instant::now();
        let lease = lease_millis(lease);
        if let Some(held) = self.holding(lease).await? {
            return Ok(Queued {
                answer: Acquire::Acquired(held),
                asked,
            });
        }
        let deadline = asked.checked_add(wait);
        let waiting = Entry {
            state: State::Waiting,
            millis: lease_millis(wait).saturating_add(WAIT_SLACK_MS),
        };
        let (mut node, mut stat) = self.create(waiting).await?;
        // Taken back if this future is dropped before it answers.
        let mut place = Place::new(self.client.clone(), node.path.clone());
        // The ensemble's time at the last write of this node, and when that answer came.
        let (mut now, mut at) = (stat.ctime, Instant::now());
        loop {
            let next = match self.ahead(node.seq, now).await? {
                Ahead::Nothing => self.take(&node, &stat, lease, None).await?,
                Ahead::Behind {
                    predecessor,
                    version,
                    ends,
                    first,
                } => {
                    let (exists, watch) = self
                        .client
                        .check_and_watch_stat(&predecessor)
                        .await
                        .map_err(|e| error("cannot watch a lock node", e))?;
                    // A watch sees only later changes: one made since the node was read
                    // (released, say) means looking again at once.
                    let (mut woke, mut timer) = (None, false);
                    if exists.is_some_and(|s| s.version == version) {
                        // Until the predecessor changes or leaves, its time runs out, or
                        // the wait does.
                        let lease_end = Duration::from_millis(
                            u64::try_from(ends.saturating_sub(now)).unwrap_or(0),
                        )
                        .saturating_sub(at.elapsed())
                            + TIMER_SLACK;
                        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                        let nap = left.map_or(lease_end, |l| l.min(lease_end));
                        tokio::select! {
                            event = watch.changed() => {
                                self.locks.inner.wakeups.fetch_add(1, Ordering::Relaxed);
                                woke = Some(event.event_type);
                            }
                            () = tokio::time::sleep(nap) => timer = true,
                        }
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        let answer = self.busy_until(now).await;
                        place.leave().await;
                        return answer.map(|answer| Queued { answer, asked });
                    }
                    match woke {
                        Some(event) if first => {
                            self.next_in_line(&node, &stat, lease, &predecessor, event)
                                .await?
                        }
                        // Woken by the predecessor's change: what changed needs no newer
                        // time (a release, a departure). Only a timer needs the ensemble's
                        // time, from a write, which would wake the waiter behind this one.
                        None if timer => Taken::Late,
                        _ => Taken::Changed,
                    }
                }
            };
            match next {
                Taken::Held(queued) => {
                    place.keep();
                    return Ok(queued);
                }
                Taken::Changed => continue,
                Taken::Late | Taken::Gone => {}
            }
            // The ensemble's time now, from a write of this node's own (which also keeps
            // it alive); a node deleted meanwhile joins again at the back.
            let touched = match next {
                Taken::Late => self
                    .client
                    .set_data(&node.path, &waiting.encode(), Some(stat.version))
                    .await
                    .map(Some),
                _ => Ok(None),
            };
            match touched {
                Ok(Some(touched)) => {
                    stat = touched;
                    (now, at) = (touched.mtime, Instant::now());
                }
                Ok(None) | Err(zk::Error::NoNode | zk::Error::BadVersion) => {
                    place.leave().await;
                    (node, stat) = self.create(waiting).await?;
                    place = Place::new(self.client.clone(), node.path.clone());
                    (now, at) = (stat.ctime, Instant::now());
                }
                Err(e) => return Err(error("cannot wait for a lock", e)),
            }
        }
    }

    /// The first node, just ahead of this waiter's, changed or left (`event`): if it is gone
    /// or released, nothing is ahead any more, and the waiter takes the lock without reading
    /// the whole queue again (deleting a released predecessor in the same transaction).
    async fn next_in_line(
        &self,
        node: &Node,
        stat: &zk::Stat,
        lease: u64,
        predecessor: &str,
        event: zk::EventType,
    ) -> Result<Taken, StoreError> {
        if event == zk::EventType::NodeDeleted {
            return self.take(node, stat, lease, None).await;
        }
        match self.read(predecessor).await? {
            None => self.take(node, stat, lease, None).await,
            Some((entry, pred)) if entry.state == State::Released => {
                self.take(node, stat, lease, Some((predecessor, pred.version)))
                    .await
            }
            Some(_) => Ok(Taken::Changed),
        }
    }

    /// This owner's node with `fence`, its entry and stat.
    async fn mine(&self, wanted: u64) -> Result<Option<(Node, Entry, zk::Stat)>, StoreError> {
        for node in self.nodes().await?.into_iter().filter(|n| n.owner) {
            if let Some((entry, stat)) = self.read(&node.path).await?
                && fence(&stat) == wanted
            {
                return Ok(Some((node, entry, stat)));
            }
        }
        Ok(None)
    }

    pub(super) async fn renew(&self, wanted: u64, lease: Duration) -> Result<Held, LockError> {
        let held = Entry {
            state: State::Held,
            millis: lease_millis(lease),
        };
        // One conditional write when this store knows the holding as it is.
        if let Some(known) = self.recall(wanted) {
            self.forget(wanted);
            match self
                .client
                .set_data(&known.path, &held.encode(), Some(known.version))
                .await
            {
                Ok(now) => {
                    return self
                        .renewed(&known.path, wanted, known.entry_ends, &now, held)
                        .await;
                }
                Err(zk::Error::BadVersion | zk::Error::NoNode) => {}
                Err(e) => return Err(error("cannot renew a lock", e).into()),
            }
        }
        loop {
            let Some((node, entry, stat)) = self.mine(wanted).await? else {
                return Err(LockError::NotOwner);
            };
            if !entry.holds() {
                return Err(LockError::NotOwner);
            }
            let now = match self
                .client
                .set_data(&node.path, &held.encode(), Some(stat.version))
                .await
            {
                Ok(now) => now,
                Err(zk::Error::BadVersion) => continue,
                Err(zk::Error::NoNode) => return Err(LockError::NotOwner),
                Err(e) => return Err(error("cannot renew a lock", e).into()),
            };
            return self
                .renewed(&node.path, wanted, entry.ends(&stat), &now, held)
                .await;
        }
    }

    /// A renewal written (`now`) over a lease that ended at `ended`: kept, or, if that lease
    /// had run out before, taken back (lost stays lost).
    async fn renewed(
        &self,
        path: &str,
        wanted: u64,
        ended: i64,
        now: &zk::Stat,
        held: Entry,
    ) -> Result<Held, LockError> {
        if ended <= now.mtime {
            let _ = self
                .client
                .set_data(path, &RELEASED.encode(), Some(now.version))
                .await;
            return Err(LockError::NotOwner);
        }
        Ok(self.remember(path, wanted, now, held))
    }

    pub(super) async fn release(&self, wanted: u64) -> Result<(), LockError> {
        if let Some(known) = self.recall(wanted) {
            self.forget(wanted);
            match self
                .client
                .set_data(&known.path, &RELEASED.encode(), Some(known.version))
                .await
            {
                Ok(_) => return Ok(()),
                Err(zk::Error::BadVersion | zk::Error::NoNode) => {}
                Err(e) => return Err(error("cannot release a lock", e).into()),
            }
        }
        loop {
            let Some((node, entry, stat)) = self.mine(wanted).await? else {
                return Err(LockError::NotOwner);
            };
            match entry.state {
                State::Released => return Ok(()),
                State::Waiting => return Err(LockError::NotOwner),
                State::Held | State::Claimed => {}
            }
            // Marked, not deleted: a repeated release is recognised, and the waiter just
            // behind is woken by the change.
            match self
                .client
                .set_data(&node.path, &RELEASED.encode(), Some(stat.version))
                .await
            {
                Ok(_) => return Ok(()),
                Err(zk::Error::BadVersion) => continue,
                Err(zk::Error::NoNode) => return Err(LockError::NotOwner),
                Err(e) => return Err(error("cannot release a lock", e).into()),
            }
        }
    }
}

/// The fence of a holding: its node's creating transaction id.
fn fence(stat: &zk::Stat) -> u64 {
    u64::try_from(stat.czxid).unwrap_or(0)
}

/// A waiter's node, deleted in the background if the wait is dropped before it answers.
struct Place {
    client: zk::Client,
    path: Option<String>,
}

impl Place {
    fn new(client: zk::Client, path: String) -> Self {
        Self {
            client,
            path: Some(path),
        }
    }

    /// The node stays (it holds now, or is gone).
    fn keep(&mut self) {
        self.path = None;
    }

    /// Leaves the queue now.
    async fn leave(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = self.client.delete(&path, None).await;
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let Some(path) = self.path.take() else {
            return;
        };
        let client = self.client.clone();
        // The request is sent when `delete` is called; the task only reads the answer. Outside
        // a runtime the node lives until its wait runs out or the session ends.
        let delete = client.delete(&path, None);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = delete.await;
            });
        }
    }
}

/// The locks held now, by name, at most `limit`.
pub(super) async fn held(
    locks: &ZooKeeperLocks,
    limit: usize,
) -> Result<Vec<HeldLock>, StoreError> {
    let client = locks.client().await?;
    let now = locks.now(&client).await?;
    let dir = locks.locks_dir();
    let parents = match client.list_children(&dir).await {
        Ok(p) => p,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => return Err(error("cannot list locks", e)),
    };
    let mut named = Vec::new();
    for parent in parents {
        let path = format!("{dir}/{parent}");
        match client.get_data(&path).await {
            Ok((data, _)) => {
                if let Some(name) = std::str::from_utf8(&data)
                    .ok()
                    .and_then(|n| LockName::new(n).ok())
                {
                    named.push((name, path));
                }
            }
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(error("cannot read a lock's name", e)),
        }
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut listed = Vec::new();
    for (name, _) in named {
        if listed.len() >= limit {
            break;
        }
        let lock = Lock::new(locks, &name, idem_core::OwnerDigest([0; 32])).await?;
        for node in lock.nodes().await? {
            let Some((entry, stat)) = lock.read(&node.path).await? else {
                continue;
            };
            if entry.dead(&stat, now) {
                continue;
            }
            if entry.holds() {
                listed.push(HeldLock {
                    name: name.clone(),
                    fence: fence(&stat),
                    expires_at: timestamp(entry.ends(&stat)),
                });
            }
            break;
        }
    }
    Ok(listed)
}

/// Deletes this session's nodes dead for longer than the retention.
pub(super) async fn sweep_once(locks: &ZooKeeperLocks) -> Result<(), StoreError> {
    let client = locks.client().await?;
    let now = locks.now(&client).await?;
    let retention = i64::try_from(LOCK_STATE_RETENTION.as_millis()).unwrap_or(i64::MAX);
    let mine = client
        .list_ephemerals(&locks.locks_dir())
        .await
        .map_err(|e| error("cannot list this session's lock nodes", e))?;
    for path in mine {
        let Ok((data, stat)) = client.get_data(&path).await else {
            continue;
        };
        let gone_since = match Entry::decode(&data) {
            Some(e) if e.state == State::Released => stat.mtime,
            Some(e) => e.ends(&stat),
            None => continue,
        };
        if gone_since.saturating_add(retention) <= now {
            let _ = client.delete(&path, Some(stat.version)).await;
        }
    }
    Ok(())
}
