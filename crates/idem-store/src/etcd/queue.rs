//! One lock name's queue of keys, and what each operation does with it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use etcd_client as etcd;
use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};
use idem_core::lock::{LOCK_STATE_RETENTION, lease_millis};
use idem_core::{
    Acquire, Held, HeldLock, LockError, LockName, OwnerDigest, Queued, StoreError, Timestamp,
};

use super::{EtcdLocks, error, lease_gone};

/// How much longer than its wait a waiter's key lives before others may delete it (a waiter
/// that could not leave the queue itself, its process still up).
const WAIT_SLACK_MS: u64 = 2_000;

/// How long after a predecessor's lease end, as this store counts it, a waiter looks again.
const TIMER_SLACK: Duration = Duration::from_millis(5);

/// How long a waiter waits before it tries again after a failure a retry may cure.
const RETRY_AFTER: Duration = Duration::from_millis(100);

/// How many transactions one call makes before it gives up on a queue that keeps changing
/// under it (each failed one brings the queue as it is now).
const ATTEMPTS: usize = 64;

/// A key's state, as its value says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Holds (`h`): written only by an owner that found nothing alive ahead of it.
    Held,
    /// Waits (`w`).
    Waiting,
    /// Released (`r`): dead at once.
    Released,
}

/// A key's value: its state, a number (the lease or wait in milliseconds; for a release, when
/// it was, in milliseconds since the epoch) and the lock's name.
fn encode(state: State, number: u64, name: &LockName) -> Vec<u8> {
    let tag = match state {
        State::Held => 'h',
        State::Waiting => 'w',
        State::Released => 'r',
    };
    format!("{tag} {number} {}", name.as_str()).into_bytes()
}

/// A value's state, number and name; `None` for what no version of idem writes (never taken
/// for a holding).
fn decode(value: &[u8]) -> Option<(State, u64, &str)> {
    let text = std::str::from_utf8(value).ok()?;
    let (tag, rest) = text.split_once(' ')?;
    let (number, name) = rest.split_once(' ')?;
    let state = match tag {
        "h" => State::Held,
        "w" => State::Waiting,
        "r" => State::Released,
        _ => return None,
    };
    Some((state, number.parse().ok()?, name))
}

/// One key of a lock's queue, as read.
#[derive(Debug, Clone)]
struct Row {
    key: Vec<u8>,
    mine: bool,
    create: i64,
    modrev: i64,
    state: State,
    /// When its lease or wait ends as this store counts it (from when it first saw this
    /// version); `None` for one that never ends.
    ends: Option<Instant>,
}

impl Row {
    fn live(&self, now: Instant) -> bool {
        self.state != State::Released && self.ends.is_none_or(|end| end > now)
    }

    fn fence(&self) -> u64 {
        u64::try_from(self.create).unwrap_or(0)
    }
}

/// A lock's queue, oldest key first, and the revision it was read at.
#[derive(Debug)]
struct Listing {
    rows: Vec<Row>,
    revision: i64,
}

/// A write of a transaction (or the queue's read, in one that always goes through).
enum Write {
    Put(Vec<u8>, State, u64),
    Delete(Vec<u8>),
    List,
}

/// What a transaction came to.
enum Outcome {
    /// It went through, at this revision; with what its operations answered.
    Done {
        revision: i64,
        answers: Vec<etcd::TxnOpResponse>,
    },
    /// What it compared had changed: the queue as it is now.
    Changed(Listing),
}

/// A holding this store granted or renewed, as it last wrote it.
#[derive(Debug, Clone)]
pub(super) struct Holding {
    key: Vec<u8>,
    modrev: i64,
    ends: Option<Instant>,
}

/// One lock name, as one owner sees it.
pub(super) struct Lock<'a> {
    locks: &'a EtcdLocks,
    name: &'a LockName,
    parent: String,
    owner: String,
}

impl<'a> Lock<'a> {
    pub(super) fn new(locks: &'a EtcdLocks, name: &'a LockName, owner: OwnerDigest) -> Self {
        Self {
            parent: locks.parent(name),
            owner: format!("{}-", owner.to_hex()),
            locks,
            name,
        }
    }

    fn client(&self) -> etcd::Client {
        self.locks.client()
    }

    /// The read of the queue, oldest first.
    fn listing_op(&self) -> TxnOp {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        TxnOp::get(self.parent.as_bytes(), Some(options))
    }

    /// Where the lease of a key first seen now, at `modrev`, with `millis`, runs from.
    fn ends(&self, key: &[u8], modrev: i64, millis: u64) -> Option<Instant> {
        let seen = &self.locks.inner.seen;
        let lookup = (key.to_vec(), modrev);
        let first = seen.get(&lookup).unwrap_or_else(|| {
            let now = Instant::now();
            seen.insert(lookup, now);
            now
        });
        first.checked_add(Duration::from_millis(millis))
    }

    /// A key of the queue as a row; `None` for one no version of idem writes.
    fn row(&self, kv: &etcd::KeyValue) -> Option<Row> {
        let (state, number, _) = decode(kv.value())?;
        let rest = kv.key().strip_prefix(self.parent.as_bytes())?;
        Some(Row {
            key: kv.key().to_vec(),
            mine: rest.starts_with(self.owner.as_bytes()),
            create: kv.create_revision(),
            modrev: kv.mod_revision(),
            state,
            ends: match state {
                State::Released => None,
                _ => self.ends(kv.key(), kv.mod_revision(), number),
            },
        })
    }

    fn rows(&self, response: &etcd::GetResponse) -> Vec<Row> {
        response
            .kvs()
            .iter()
            .filter_map(|kv| self.row(kv))
            .collect()
    }

    fn listing(&self, response: &etcd::GetResponse) -> Listing {
        Listing {
            rows: self.rows(response),
            revision: response.header().map_or(0, etcd::ResponseHeader::revision),
        }
    }

    /// The queue now.
    async fn list(&self) -> Result<Listing, StoreError> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response = retried(|| {
            let options = options.clone();
            let mut client = self.client();
            async move { client.get(self.parent.as_bytes(), Some(options)).await }
        })
        .await
        .map_err(|e| error("cannot read a lock's queue", e))?;
        Ok(self.listing(&response))
    }

    /// Writes `then` if every comparison in `when` holds; otherwise reads the queue, in the
    /// same round trip. A write refused because the session's lease is gone (the session
    /// ended) is made once more with the new session's, once the keep-alive task has it.
    async fn txn(&self, when: Vec<Compare>, then: Vec<Write>) -> Result<Outcome, StoreError> {
        let mut session = self.locks.session();
        let mut retried_on_new = false;
        let response = loop {
            let ops: Vec<TxnOp> = then.iter().map(|w| self.op(w, session)).collect();
            let txn = Txn::new()
                .when(when.clone())
                .and_then(ops)
                .or_else(vec![self.listing_op()]);
            let sent = retried(|| {
                let (mut client, txn) = (self.client(), txn.clone());
                async move { client.txn(txn).await }
            })
            .await;
            match sent {
                Ok(response) => break response,
                Err(e) if lease_gone(&e) && !retried_on_new => {
                    self.locks.inner.lost.notify_one();
                    if !self.locks.new_session_after(session).await {
                        return Err(error("a lock's transaction failed", e));
                    }
                    session = self.locks.session();
                    retried_on_new = true;
                }
                Err(e) => return Err(error("a lock's transaction failed", e)),
            }
        };
        let revision = response.header().map_or(0, etcd::ResponseHeader::revision);
        let mut answers = response.op_responses();
        if response.succeeded() {
            return Ok(Outcome::Done { revision, answers });
        }
        match answers.pop() {
            Some(etcd::TxnOpResponse::Get(get)) => Ok(Outcome::Changed(self.listing(&get))),
            _ => Err(StoreError::backend(
                "etcd: a transaction answered out of shape",
                std::io::Error::other("txn"),
            )),
        }
    }

    fn op(&self, write: &Write, session: i64) -> TxnOp {
        match write {
            Write::Put(key, state, number) => TxnOp::put(
                key.clone(),
                encode(*state, *number, self.name),
                Some(PutOptions::new().with_lease(session)),
            ),
            Write::Delete(key) => TxnOp::delete(key.clone(), None),
            Write::List => self.listing_op(),
        }
    }

    /// Notes a holding this store wrote at `modrev` with a request sent at `sent`.
    fn remember(&self, key: &[u8], fence: u64, modrev: i64, sent: Instant, millis: u64) -> Held {
        self.locks.inner.seen.insert((key.to_vec(), modrev), sent);
        let ends = sent.checked_add(Duration::from_millis(millis));
        self.locks.inner.holdings.insert(
            self.holding_key(fence),
            Holding {
                key: key.to_vec(),
                modrev,
                ends,
            },
        );
        Held {
            fence,
            expires_at: self.locks.wall(ends),
        }
    }

    /// A [`Place`] for `key` (none: nothing to take back), written with the session now open.
    fn place(&self, key: Option<Vec<u8>>) -> Place {
        Place {
            client: self.client(),
            key,
            // Released now, as a release writes it: swept an hour from now, not at once.
            released: encode(State::Released, Timestamp::now().as_millis(), self.name),
            locks: self.locks.clone(),
        }
    }

    fn holding_key(&self, fence: u64) -> (Vec<u8>, u64) {
        (format!("{}{}", self.parent, self.owner).into_bytes(), fence)
    }

    /// The holding this store knows of, forgotten (a renewal or release writes it anew).
    fn recall(&self, fence: u64) -> Option<Holding> {
        self.locks
            .inner
            .holdings
            .remove(&self.holding_key(fence))
            .map(|(_, h)| h)
    }

    /// Takes a lock in which nothing is alive, as `listing` says (`None`: the queue is
    /// empty), with a new key; or keeps the holding this owner has; or says who holds it.
    /// `Err` with the listing to go on with when the queue changed meanwhile.
    async fn take_or_busy(
        &self,
        listing: Option<&Listing>,
        millis: u64,
    ) -> Result<Result<Held, Listing>, NotTaken> {
        let sent = Instant::now();
        let now = sent;
        let (when, then, key, fence) = match listing {
            None => {
                let key = self.locks.new_key(&self.parent, &self.owner);
                let empty = Compare::create_revision(self.parent.as_bytes(), CompareOp::Less, 1)
                    .with_prefix();
                let put = Write::Put(key.clone(), State::Held, millis);
                (vec![empty], vec![put], key, None)
            }
            Some(listing) => match listing.rows.iter().find(|r| r.live(now)) {
                None => {
                    let key = self.locks.new_key(&self.parent, &self.owner);
                    // Nothing in the queue changed since it was read, and every key in it is
                    // dead: they go as the new one is made.
                    let unchanged = Compare::mod_revision(
                        self.parent.as_bytes(),
                        CompareOp::Less,
                        listing.revision.saturating_add(1),
                    )
                    .with_prefix();
                    let mut then: Vec<Write> = listing
                        .rows
                        .iter()
                        .map(|r| Write::Delete(r.key.clone()))
                        .collect();
                    then.push(Write::Put(key.clone(), State::Held, millis));
                    (vec![unchanged], then, key, None)
                }
                Some(row) if row.mine && row.state == State::Held => {
                    let same = Compare::mod_revision(row.key.clone(), CompareOp::Equal, row.modrev);
                    let put = Write::Put(row.key.clone(), State::Held, millis);
                    (vec![same], vec![put], row.key.clone(), Some(row.fence()))
                }
                Some(row) => return Err(NotTaken::Busy(self.locks.wall(row.ends))),
            },
        };
        // A new key is taken back if this call is dropped, or fails, before it answers: the
        // holding it may have made is nobody's.
        let mut place = self.place(fence.is_none().then(|| key.clone()));
        let outcome = self.txn(when, then).await.map_err(NotTaken::Failed)?;
        place.keep();
        match outcome {
            Outcome::Done { revision, .. } => {
                let fence = fence.unwrap_or(u64::try_from(revision).unwrap_or(0));
                Ok(Ok(self.remember(&key, fence, revision, sent, millis)))
            }
            Outcome::Changed(listing) => Ok(Err(listing)),
        }
    }

    /// One attempt that does not wait: the holding, or who holds it.
    pub(super) async fn try_acquire(&self, lease: Duration) -> Result<Acquire, StoreError> {
        let millis = lease_millis(lease);
        let mut listing = None;
        for _ in 0..ATTEMPTS {
            match self.take_or_busy(listing.as_ref(), millis).await {
                Ok(Ok(held)) => return Ok(Acquire::Acquired(held)),
                Ok(Err(now)) => listing = Some(now),
                Err(NotTaken::Busy(until)) => return Ok(Acquire::Busy { until }),
                Err(NotTaken::Failed(e)) => return Err(e),
            }
        }
        Err(changing())
    }

    /// Waits in the queue up to `wait` for the lock. Failures a retry may cure (a member
    /// down, an election) are retried until the wait runs out.
    pub(super) async fn wait(&self, lease: Duration, wait: Duration) -> Result<Queued, StoreError> {
        let asked = Instant::now();
        let deadline = asked.checked_add(wait);
        let millis = lease_millis(lease);
        let waiting = lease_millis(wait).saturating_add(WAIT_SLACK_MS);
        let mut place = None;
        loop {
            match self
                .queue(&mut place, asked, deadline, millis, waiting)
                .await
            {
                Err(e) if e.is_transient() && deadline.is_none_or(|d| Instant::now() < d) => {
                    tracing::debug!(error = %e, "a lock waiter retries");
                    tokio::time::sleep(RETRY_AFTER).await;
                }
                answer => return answer,
            }
        }
    }

    /// [`Lock::wait`]'s work between failures: `place` is the waiter's key once it has one.
    async fn queue(
        &self,
        place: &mut Option<Place>,
        asked: Instant,
        deadline: Option<Instant>,
        millis: u64,
        waiting: u64,
    ) -> Result<Queued, StoreError> {
        let mut listing = match place {
            Some(_) => Some(self.list().await?),
            None => None,
        };
        if place.is_none() {
            // The lock taken at once, or the queue joined.
            for attempt in 0.. {
                if attempt > ATTEMPTS {
                    return Err(changing());
                }
                match self.take_or_busy(listing.as_ref(), millis).await {
                    Ok(Ok(held)) => {
                        return Ok(Queued {
                            answer: Acquire::Acquired(held),
                            asked,
                        });
                    }
                    Ok(Err(now)) => listing = Some(now),
                    Err(NotTaken::Failed(e)) => return Err(e),
                    Err(NotTaken::Busy(_)) => break,
                }
            }
            listing = None;
        }
        // Rows other than the one watched may be out of date after a watch's news: the queue
        // is read again before one of them is trusted to be alive.
        let mut fresh_only: Option<Vec<u8>> = None;
        let mut attempts = 0;
        loop {
            let (key, now_listing) =
                match (place.as_ref().and_then(|p| p.key.clone()), listing.take()) {
                    (Some(key), Some(l)) => (key, l),
                    (Some(key), None) => (key, self.list().await?),
                    (None, _) => {
                        let joined = self.join(waiting).await?;
                        *place = Some(joined.place);
                        fresh_only = None;
                        (joined.key, joined.listing)
                    }
                };
            let now = Instant::now();
            let Some(mine) = now_listing.rows.iter().find(|r| r.key == key).cloned() else {
                // Deleted, as a waiter whose time ran out (or with a session that ended):
                // it joins again at the back.
                if let Some(place) = place.as_mut() {
                    place.keep();
                }
                *place = None;
                continue;
            };
            let ahead: Vec<&Row> = now_listing
                .rows
                .iter()
                .filter(|r| r.create < mine.create)
                .collect();
            let predecessor = ahead
                .iter()
                .rev()
                .find(|r| r.live(now))
                .map(|r| (*r).clone());
            if let (Some(pred), Some(fresh)) = (&predecessor, &fresh_only)
                && &pred.key != fresh
            {
                fresh_only = None;
                continue;
            }
            let Some(predecessor) = predecessor else {
                attempts += 1;
                if attempts > ATTEMPTS {
                    return Err(changing());
                }
                let sent = Instant::now();
                let mut when = vec![Compare::mod_revision(
                    mine.key.clone(),
                    CompareOp::Equal,
                    mine.modrev,
                )];
                let mut then = Vec::new();
                for row in &ahead {
                    when.push(Compare::mod_revision(
                        row.key.clone(),
                        CompareOp::Equal,
                        row.modrev,
                    ));
                    then.push(Write::Delete(row.key.clone()));
                }
                then.push(Write::Put(mine.key.clone(), State::Held, millis));
                match self.txn(when, then).await? {
                    Outcome::Done { revision, .. } => {
                        if let Some(place) = place.as_mut() {
                            place.keep();
                        }
                        let held = self.remember(&mine.key, mine.fence(), revision, sent, millis);
                        return Ok(Queued {
                            answer: Acquire::Acquired(held),
                            asked: sent,
                        });
                    }
                    Outcome::Changed(again) => {
                        fresh_only = None;
                        listing = Some(again);
                    }
                }
                continue;
            };
            if deadline.is_some_and(|d| now >= d) {
                let until = ahead
                    .iter()
                    .find(|r| r.live(now))
                    .map_or_else(Timestamp::now, |r| self.locks.wall(r.ends));
                if let Some(place) = place.as_mut() {
                    place.leave().await;
                }
                return Ok(Queued {
                    answer: Acquire::Busy { until },
                    asked,
                });
            }
            // Until the predecessor changes or leaves, its time runs out, or the wait does.
            let lease_end = predecessor
                .ends
                .map(|e| e.saturating_duration_since(now) + TIMER_SLACK);
            let left = deadline.map(|d| d.saturating_duration_since(now));
            let nap = match (lease_end, left) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let watched = self.changed(&predecessor, now_listing.revision);
            let woke = match nap {
                Some(nap) => tokio::time::timeout(nap, watched).await.ok(),
                None => Some(watched.await),
            };
            let mut next = now_listing;
            match woke {
                Some(Ok(Some((revision, event)))) => {
                    // What the predecessor became, without reading the queue again.
                    next.revision = revision;
                    if let Some(at) = next.rows.iter().position(|r| r.key == predecessor.key) {
                        match event {
                            Some(row) => next.rows[at] = row,
                            None => {
                                next.rows.remove(at);
                            }
                        }
                    }
                    fresh_only = Some(predecessor.key);
                    listing = Some(next);
                }
                // News of another key: read the queue again now.
                Some(Ok(None)) => fresh_only = None,
                // The watch ended without news (a compaction, a lost connection): read the
                // queue again after a pause.
                Some(Err(e)) if e.is_transient() => {
                    fresh_only = None;
                    tokio::time::sleep(RETRY_AFTER).await;
                }
                Some(Err(e)) => return Err(e),
                // The predecessor's time, or the wait, ran out: judged again, in a listing
                // as fresh as it was.
                None => listing = Some(next),
            }
        }
    }

    /// Puts a waiter's key at the back of the queue and reads the queue, in one round trip.
    async fn join(&self, waiting: u64) -> Result<Joined, StoreError> {
        let key = self.locks.new_key(&self.parent, &self.owner);
        let sent = Instant::now();
        let then = vec![
            Write::Put(key.clone(), State::Waiting, waiting),
            Write::List,
        ];
        let place = self.place(Some(key.clone()));
        // The key is new: only a call dropped before this request arrived has written it (its
        // place marked released), and then nothing is put.
        let new = Compare::create_revision(key.clone(), CompareOp::Equal, 0);
        let Outcome::Done {
            revision,
            mut answers,
        } = self.txn(vec![new], then).await?
        else {
            return Err(changing());
        };
        self.locks.inner.seen.insert((key.clone(), revision), sent);
        let Some(etcd::TxnOpResponse::Get(get)) = answers.pop() else {
            return Err(StoreError::backend(
                "etcd: a transaction answered out of shape",
                std::io::Error::other("txn"),
            ));
        };
        Ok(Joined {
            listing: self.listing(&get),
            key,
            place,
        })
    }

    /// Watches the predecessor, read at revision `read_at`, until it changes: the revision
    /// then and what it became (`None` if deleted); `Ok(None)` if it brought news of another
    /// key; a transient error if the watch ended first (the queue is read again). Every piece of news counts as a
    /// wake-up.
    ///
    /// The watch starts at the cluster's revision now, not at `read_at + 1`: etcd serves a
    /// watch that starts in the past from a loop that runs every 100 ms, which would delay
    /// every hand-off. Whatever changed in between is read once the watch is in place.
    async fn changed(
        &self,
        predecessor: &Row,
        read_at: i64,
    ) -> Result<Option<(i64, Option<Row>)>, StoreError> {
        let key = predecessor.key.as_slice();
        let mut stream = retried(|| {
            let mut client = self.client();
            async move { client.watch(key, None).await }
        })
        .await
        .map_err(|e| error("cannot watch a lock's key", e))?;
        let mut checked = false;
        loop {
            let answer = match stream.message().await {
                Ok(Some(answer)) if !answer.canceled() => answer,
                Ok(_) => return Err(watch_ended()),
                Err(e) => return Err(error("a lock's watch failed", e)),
            };
            if answer.created() && !checked {
                checked = true;
                let now = answer
                    .header()
                    .map_or(i64::MAX, etcd::ResponseHeader::revision);
                if now > read_at {
                    let got = retried(|| {
                        let mut client = self.client();
                        async move { client.get(key, None).await }
                    })
                    .await
                    .map_err(|e| error("cannot read a lock's key", e))?;
                    match got.kvs().first() {
                        None => {
                            let at = got.header().map_or(now, etcd::ResponseHeader::revision);
                            return Ok(Some((at, None)));
                        }
                        Some(kv) if kv.mod_revision() != predecessor.modrev => {
                            return Ok(Some((kv.mod_revision(), self.row(kv))));
                        }
                        Some(_) => {}
                    }
                }
            }
            if let Some(event) = answer.events().last() {
                self.locks.inner.wakeups.fetch_add(1, Ordering::Relaxed);
                let Some(kv) = event.kv().filter(|kv| kv.key() == key) else {
                    return Ok(None);
                };
                let row = match event.event_type() {
                    etcd::EventType::Put => self.row(kv),
                    etcd::EventType::Delete => None,
                };
                // The change's own revision: a later one may be in a later answer.
                return Ok(Some((kv.mod_revision(), row)));
            }
        }
    }

    /// This owner's key for the holding `fence`, in `listing`.
    fn mine<'l>(&self, listing: &'l Listing, fence: u64) -> Option<&'l Row> {
        listing.rows.iter().find(|r| r.mine && r.fence() == fence)
    }

    pub(super) async fn renew(&self, fence: u64, lease: Duration) -> Result<Held, LockError> {
        let millis = lease_millis(lease);
        let mut listing = None;
        // One conditional write when this store knows the holding as it is.
        if let Some(known) = self.recall(fence) {
            if known.ends.is_some_and(|end| end <= Instant::now()) {
                // Ran out: lost stays lost, even if nobody took it yet.
                return Err(LockError::NotOwner);
            }
            let sent = Instant::now();
            let same = Compare::mod_revision(known.key.clone(), CompareOp::Equal, known.modrev);
            match self
                .txn(
                    vec![same],
                    vec![Write::Put(known.key.clone(), State::Held, millis)],
                )
                .await?
            {
                Outcome::Done { revision, .. } => {
                    return Ok(self.remember(&known.key, fence, revision, sent, millis));
                }
                Outcome::Changed(now) => listing = Some(now),
            }
        }
        for _ in 0..ATTEMPTS {
            let now = match listing.take() {
                Some(now) => now,
                None => self.list().await?,
            };
            let at = Instant::now();
            let Some(row) = self.mine(&now, fence) else {
                return Err(LockError::NotOwner);
            };
            let first = now.rows.iter().find(|r| r.live(at)).map(|r| &r.key);
            if row.state != State::Held || first != Some(&row.key) {
                return Err(LockError::NotOwner);
            }
            let sent = Instant::now();
            let same = Compare::mod_revision(row.key.clone(), CompareOp::Equal, row.modrev);
            match self
                .txn(
                    vec![same],
                    vec![Write::Put(row.key.clone(), State::Held, millis)],
                )
                .await?
            {
                Outcome::Done { revision, .. } => {
                    return Ok(self.remember(&row.key, fence, revision, sent, millis));
                }
                Outcome::Changed(again) => listing = Some(again),
            }
        }
        Err(changing().into())
    }

    pub(super) async fn release(&self, fence: u64) -> Result<(), LockError> {
        let released =
            |key: &[u8]| Write::Put(key.to_vec(), State::Released, Timestamp::now().as_millis());
        let mut listing = None;
        if let Some(known) = self.recall(fence) {
            let same = Compare::mod_revision(known.key.clone(), CompareOp::Equal, known.modrev);
            match self.txn(vec![same], vec![released(&known.key)]).await? {
                Outcome::Done { .. } => return Ok(()),
                Outcome::Changed(now) => listing = Some(now),
            }
        }
        for _ in 0..ATTEMPTS {
            let now = match listing.take() {
                Some(now) => now,
                None => self.list().await?,
            };
            let Some(row) = self.mine(&now, fence) else {
                return Err(LockError::NotOwner);
            };
            match row.state {
                State::Released => return Ok(()),
                State::Waiting => return Err(LockError::NotOwner),
                State::Held => {}
            }
            // Marked, not deleted: a repeated release is recognised, and the waiter just
            // behind is woken by the change.
            let same = Compare::mod_revision(row.key.clone(), CompareOp::Equal, row.modrev);
            match self.txn(vec![same], vec![released(&row.key)]).await? {
                Outcome::Done { .. } => return Ok(()),
                Outcome::Changed(again) => listing = Some(again),
            }
        }
        Err(changing().into())
    }
}

/// Runs `call` again, a few times, while it fails with nobody to answer (a member down or
/// not serving: the client spreads calls over every member): such a call had no effect.
async fn retried<T, F: std::future::Future<Output = Result<T, etcd::Error>>>(
    mut call: impl FnMut() -> F,
) -> Result<T, etcd::Error> {
    let mut pause = Duration::from_millis(20);
    for _ in 0..5 {
        match call().await {
            Err(etcd::Error::GRpcStatus(status)) if status.code() == tonic::Code::Unavailable => {
                tracing::debug!(%status, "an etcd member did not answer; trying again");
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            answer => return answer,
        }
    }
    call().await
}

/// Why an acquire did not take the lock.
enum NotTaken {
    /// Another owner holds it (or waits first in line) until then.
    Busy(Timestamp),
    /// The store failed.
    Failed(StoreError),
}

fn watch_ended() -> StoreError {
    StoreError::unavailable(
        "etcd: a lock's watch ended",
        std::io::Error::other("watch ended"),
    )
}

fn changing() -> StoreError {
    StoreError::unavailable(
        "etcd: a lock's queue kept changing",
        std::io::Error::other("contention"),
    )
}

/// A waiter's key in a queue, and the queue as last seen.
struct Joined {
    listing: Listing,
    key: Vec<u8>,
    place: Place,
}

/// A key that is taken back unless kept: the place (or holding) of a call that may be dropped
/// before it answers.
///
/// Dropped, it is marked released (in the background) rather than deleted. The dropped call's
/// request may still reach the cluster after the cleanup does: a delete that came first would
/// delete nothing and leave the late request's key alive until its time ran out, holding the
/// lock or a place ahead of every waiter. A released key written first makes the late request
/// fail its comparison (a take compares the queue unchanged, a join its key new), and a released
/// key is dead to everyone, deleted by the next take.
struct Place {
    client: etcd::Client,
    key: Option<Vec<u8>>,
    /// The key's value once released.
    released: Vec<u8>,
    /// The store, for its session when the key is marked.
    locks: EtcdLocks,
}

impl Place {
    fn keep(&mut self) {
        self.key = None;
    }

    /// Deletes the key now; dropped before it is done, the key is deleted in the background.
    async fn leave(&mut self) {
        if let Some(key) = self.key.clone() {
            delete_key(self.client.clone(), key).await;
            self.key = None;
        }
    }
}

/// Marks `key` released (see [`Place`]), with the store's session, trying again for a few
/// seconds while the cluster does not answer or a session is being opened again. Never a plain
/// delete: that could reach the cluster before the dropped request, and leave its key alive.
async fn release_key(mut client: etcd::Client, key: Vec<u8>, released: Vec<u8>, locks: EtcdLocks) {
    let mut pause = Duration::from_millis(50);
    for _ in 0..8 {
        let options = PutOptions::new().with_lease(locks.session());
        match client
            .put(key.clone(), released.clone(), Some(options))
            .await
        {
            Err(e) if lease_gone(&e) || super::transient(&e) => {
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            _ => return,
        }
    }
}

/// Deletes `key`, trying again for a few seconds while the cluster does not answer (a
/// member down, an election): a key left behind keeps its place in a queue until its time
/// runs out.
async fn delete_key(mut client: etcd::Client, key: Vec<u8>) {
    let mut pause = Duration::from_millis(50);
    for _ in 0..6 {
        match client.delete(key.clone(), None).await {
            Err(e) if super::transient(&e) => {
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            _ => return,
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        // Outside a runtime the key lives until its wait runs out or the session ends.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let released = std::mem::take(&mut self.released);
            runtime.spawn(release_key(
                self.client.clone(),
                key,
                released,
                self.locks.clone(),
            ));
        }
    }
}

/// The locks held now, by name, at most `limit`.
pub(super) async fn held(locks: &EtcdLocks, limit: usize) -> Result<Vec<HeldLock>, StoreError> {
    let dir = locks.locks_dir();
    let options = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend);
    let response = locks
        .client()
        .get(dir.as_bytes(), Some(options))
        .await
        .map_err(|e| error("cannot list locks", e))?;
    let now = Instant::now();
    let mut firsts: std::collections::BTreeMap<Vec<u8>, Option<HeldLock>> =
        std::collections::BTreeMap::new();
    for kv in response.kvs() {
        let Some((state, number, name)) = decode(kv.value()) else {
            continue;
        };
        let Some(parent) = kv.key().iter().rposition(|b| *b == b'/') else {
            continue;
        };
        let parent = kv.key()[..parent].to_vec();
        if firsts.contains_key(&parent) {
            continue;
        }
        let Ok(name) = LockName::new(name) else {
            continue;
        };
        let lock = Lock::new(locks, &name, OwnerDigest([0; 32]));
        let ends = lock.ends(kv.key(), kv.mod_revision(), number);
        let live = state != State::Released && ends.is_none_or(|e| e > now);
        if !live {
            continue;
        }
        let held = (state == State::Held).then(|| HeldLock {
            name: name.clone(),
            fence: u64::try_from(kv.create_revision()).unwrap_or(0),
            expires_at: locks.wall(ends),
        });
        firsts.insert(parent, held);
    }
    let mut listed: Vec<HeldLock> = firsts.into_values().flatten().collect();
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    listed.truncate(limit);
    Ok(listed)
}

/// Deletes this session's keys released, or dead, for longer than
/// [`LOCK_STATE_RETENTION`] (kept until then so that a late release by their owner is still
/// recognised).
pub(super) async fn sweep_once(locks: &EtcdLocks) -> Result<(), StoreError> {
    let session = locks.session();
    let response = locks
        .client()
        .get(
            locks.locks_dir().as_bytes(),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| error("cannot list this session's lock keys", e))?;
    let (now, wall_now) = (Instant::now(), Timestamp::now().as_millis());
    let retention = LOCK_STATE_RETENTION;
    for kv in response.kvs().iter().filter(|kv| kv.lease() == session) {
        let Some((state, number, _)) = decode(kv.value()) else {
            continue;
        };
        let old = match state {
            State::Released => {
                number.saturating_add(u64::try_from(retention.as_millis()).unwrap_or(u64::MAX))
                    <= wall_now
            }
            _ => locks
                .inner
                .seen
                .get(&(kv.key().to_vec(), kv.mod_revision()))
                .and_then(|seen| seen.checked_add(Duration::from_millis(number)))
                .and_then(|end| end.checked_add(retention))
                .is_some_and(|gone| gone <= now),
        };
        if old {
            let same = Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision());
            let delete = TxnOp::delete(kv.key(), None);
            let _ = locks
                .client()
                .txn(Txn::new().when(vec![same]).and_then(vec![delete]))
                .await;
        }
    }
    Ok(())
}
