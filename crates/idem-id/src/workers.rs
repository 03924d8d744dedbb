//! Worker ids leased from a store, so that no two live processes ever issue Snowflake ids
//! under one worker id.
//!
//! Each worker id is a record (`idem.ids` / `snowflake.<name>` / `worker-<n>`) in any idem
//! store. A process claims one with a single `begin` (the store's atomic conditional write):
//! it gets a worker id nobody holds, or none. A heartbeat renews the lease; a renewal that
//! answers "stale" marks the worker id lost for good. Releasing a worker id completes its
//! record instead of deleting it: the record lives on for the quarantine, during which nobody
//! can claim the id.
//!
//! The record alone cannot keep two holders apart: it may vanish under a live holder (a Redis
//! that keeps nothing restarts, a failover loses the last writes, someone deletes rows), and
//! the holder learns of it only at its next renewal, while another process may claim the id
//! at once. So issuing is bounded by windows of at most [`ISSUE_WINDOW`] `W`, kept by the
//! holder and recorded where a claimer reads them:
//!
//! - a holder stamps no id later than `W` (or its lease, if shorter) after its last
//!   *confirmed* renewal was sent: with the store unreachable, or the record gone, it stops
//!   by itself within `W`;
//! - before a window opens (at the claim, and before each renewal is sent) the holder raises
//!   the worker id's reach (`worker-<n>-ceiling`, a counter: counters live apart from records,
//!   never expire and no purge touches them) to the window's end;
//! - a claimer reads the reach after the store's grant reached it, and stamps nothing at or
//!   below it.
//!
//! An earlier holder's last confirmed renewal was applied before the claim (after the claim its
//! renewals are stale), so it was sent before the grant came back, and the reach it wrote
//! before sending it is what the claimer reads: all its ids are stamped before the claimer's
//! first, whatever happened to the record. A claimer whose worker id was never held, or whose
//! holders' windows have all closed (released, or crashed and their lease run out: a lease is
//! longer than the window), starts at once; one whose earlier holder may still stamp (its
//! record vanished) waits, at most `W`, until that holder's window closes.
//!
//! The reach is only as good as the store's memory, and a store that forgets everything at
//! once (a Redis without persistence restarting) forgets it too. So the pool also records
//! when the store's memory of the id space began (`kept-since`, written by the first claim
//! that finds it missing): until `W` after that, no reach can be trusted, and a claimer waits
//! as before, `W` after the store began remembering. A store that loses a few acknowledged
//! writes but keeps the rest (a failover to a replica that lagged) can forget a reach while
//! its holder goes on; for such a store [`WorkerPool::always_wait`] makes every claim wait
//! `W` after its grant. All of this rests on the processes' clocks agreeing, as every lease in
//! idem does.
//!
//! A time floor per id space (a counter raised with `Counters::raise`) records the time of the
//! last id each generator issued, every second and when it stops; a new generator starts above
//! it, so a process restarted after the wall clock was set back still issues ids above the ids
//! issued before. The one exception is a process that crashed: the ids of its last second may
//! sort above a successor's first ones (they never collide: the rule above keeps them apart).
//! Keeping the floor ahead of the ids instead would close that second, but every restart would
//! then start ahead of the floor and push it further, so the ids of a fleet that restarts
//! often would drift into the future.
//!
//! (A time floor is not a fence: a record's or a lock's fence rises with each acquisition,
//! while the time floor holds a time, the one below which no new id may be stamped.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Clock, Fingerprint, Key, Lease, LeaseError, MIN_DURATION,
    SharedStore, Store, Timestamp,
};

use crate::{IdError, Layout, Snowflake, SnowflakeOptions, TimeSource};

/// How long after its last confirmed renewal was sent a holder may still stamp ids, and so the
/// longest a new holder waits before it stamps any (see the module's notes). One value for
/// every process, whatever its lease: a claimer that cannot read how far earlier holders may
/// go on waits this long. Three heartbeats at the longest beat (1 s), so a holder rides out a
/// failed renewal without a pause.
pub const ISSUE_WINDOW: Duration = Duration::from_secs(3);

/// Where worker ids of one generator family are leased, and for how long.
#[derive(Clone)]
pub struct WorkerPool {
    store: SharedStore,
    clock: Arc<dyn Clock>,
    name: String,
    lease: Duration,
    quarantine: Duration,
    time: Option<Arc<dyn TimeSource>>,
    always_wait: bool,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("name", &self.name)
            .field("lease", &self.lease)
            .field("quarantine", &self.quarantine)
            .field("always_wait", &self.always_wait)
            .finish_non_exhaustive()
    }
}

impl WorkerPool {
    /// Worker ids named `name` (generators of one id space share a name) in `store`, leased
    /// for 30 s, with a quarantine of 60 s after release. [`LeasedSnowflake::spawn_heartbeat`]
    /// renews every `min(lease / 3, 1 s)`.
    pub fn new(store: SharedStore, clock: Arc<dyn Clock>, name: &str) -> Self {
        Self {
            store,
            clock,
            name: name.to_owned(),
            lease: Duration::from_secs(30),
            quarantine: Duration::from_secs(60),
            time: None,
            always_wait: false,
        }
    }

    /// The counter holding the id space's time floor. Its stored name, `time-fence`, predates
    /// the term and stays: a new name would start every existing id space from a floor of 0.
    fn time_floor_key(&self) -> Result<Key, IdError> {
        self.space_key("time-fence")
    }

    /// The generators' time source (default: the system's clocks). It must agree with the
    /// store's clock: a worker id is claimed only once the claimer's clock is past every time
    /// the previous holder recorded, and that is what keeps the new holder's ids above the old
    /// one's.
    #[must_use]
    pub fn time_source(mut self, time: Arc<dyn TimeSource>) -> Self {
        self.time = Some(time);
        self
    }

    /// Sets the lease length (renewed at least every third of it).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets how long a released worker id stays unclaimable.
    #[must_use]
    pub fn quarantine(mut self, quarantine: Duration) -> Self {
        self.quarantine = quarantine;
        self
    }

    /// Makes every claim wait [`ISSUE_WINDOW`] after its grant before its first id, whatever
    /// the store records of earlier holders. By default a claim waits only as long as an
    /// earlier holder may still stamp ids by the store's records (not at all for a worker id
    /// never held, released, or whose holder's lease ran out), and the whole window only while
    /// the store's memory of the id space is younger than that. That trusts the store to keep
    /// what it acknowledged, or to lose everything at once; for a store that may lose only its
    /// last writes (a failover to a replica that lagged, a Redis that syncs its append-only
    /// file every second), turn this on.
    #[must_use]
    pub fn always_wait(mut self, always: bool) -> Self {
        self.always_wait = always;
        self
    }

    /// The id space's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// How long a worker id's lease lasts.
    pub(crate) fn lease_length(&self) -> Duration {
        self.lease
    }

    pub(crate) fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// How often a holder renews: every third of the lease, and at least every second (each
    /// renewal also records the last id's time in the time floor).
    pub(crate) fn beat_every(&self) -> Duration {
        (self.lease / 3).min(Duration::from_secs(1))
    }

    /// How long after a confirmed renewal was sent its holder may stamp ids: the
    /// [`ISSUE_WINDOW`], or the lease if shorter.
    fn window(&self) -> Duration {
        ISSUE_WINDOW.min(self.lease)
    }

    fn key(&self, worker: u64) -> Result<Key, IdError> {
        self.worker_key(worker, "")
    }

    /// The worker id's reach: the counter holding the latest time (Unix milliseconds, by the
    /// holders' generators) up to which any holder of `worker` was let stamp ids, raised before
    /// each window opens (see the module's notes). Its stored name, `-ceiling`, is from when
    /// only a generator running ahead of the clock wrote it.
    fn ceiling_key(&self, worker: u64) -> Result<Key, IdError> {
        self.worker_key(worker, "-ceiling")
    }

    /// The counter holding when (Unix milliseconds) the store's memory of the id space began:
    /// written by the first claim that finds it at 0, so a store that forgot everything shows
    /// it young again.
    fn kept_since_key(&self) -> Result<Key, IdError> {
        self.space_key("kept-since")
    }

    /// When the store's memory of the id space began, writing now if it has none.
    async fn kept_since(&self) -> Result<u64, IdError> {
        let key = self.kept_since_key()?;
        match self.store.raise(&key, 0).await? {
            0 => Ok(self.store.raise(&key, self.clock.now().as_millis()).await?),
            since => Ok(since),
        }
    }

    fn worker_key(&self, worker: u64, suffix: &str) -> Result<Key, IdError> {
        self.space_key(&format!("worker-{worker}{suffix}"))
    }

    /// The record or counter `name` of the id space.
    fn space_key(&self, name: &str) -> Result<Key, IdError> {
        Key::parse("idem.ids", &format!("snowflake.{}", self.name), name)
            .map_err(|e| IdError::Space(e.to_string()))
    }

    /// Claims a free worker id and makes a generator on it, or fails with
    /// [`IdError::NoWorkerFree`]. Ids are tried from a random starting point, so processes
    /// starting together spread out.
    ///
    /// The generator issues nothing while an earlier holder of its worker id may still stamp
    /// ids by the store's records (it answers [`IdError::Starting`], for at most
    /// [`ISSUE_WINDOW`]): a worker id never held, released, or whose holder's lease ran out
    /// issues at once; one whose record vanished under a live holder waits until that
    /// holder's window has closed; and while the store's memory of the id space is younger
    /// than the window (a new id space, a store that forgot everything), or with
    /// [`WorkerPool::always_wait`], a claim waits [`ISSUE_WINDOW`] (see the module's notes).
    /// Then it issues only within the window of its last confirmed renewal: call
    /// [`LeasedSnowflake::heartbeat`] every `min(lease / 3, 1 s)`, or
    /// [`LeasedSnowflake::spawn_heartbeat`] on a Tokio runtime, which does.
    ///
    /// A claim that fails, or whose future is dropped, after the store granted it a worker id
    /// gives the id back (in a task of its own when dropped): nobody else would ever use it
    /// until its lease ran out. A claim dropped while the grant itself is on its way never
    /// learns its lease, and the worker id stays held until the lease runs out.
    pub async fn claim(
        &self,
        layout: Layout,
        options: SnowflakeOptions,
    ) -> Result<Arc<LeasedSnowflake>, IdError> {
        // Every id ever issued in this space is below the time floor (Unix milliseconds).
        let time_floor = self.store.raise(&self.time_floor_key()?, 0).await?;
        let count = layout.max_worker() + 1;
        let start = rand::random::<u64>() % count;
        for i in 0..count {
            let worker = (start + i) % count;
            let key = self.key(worker)?;
            let now = self.clock.now();
            // What the last holder left: its lease end is a time floor for our ids.
            let previous = self.store.get(&key, now).await?;
            let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"idem worker id"))
                .with_lease(self.lease)
                .with_ttl(self.quarantine);
            let outcome = self.store.begin(&req, now).await?;
            let BeginOutcome::Acquired(lease) = outcome else {
                continue; // held, or in quarantine
            };
            // From here until the generator is handed over, a claim that fails or is dropped
            // (its caller went away) gives the worker id back rather than leaving it held by
            // nobody until its lease runs out.
            let granted = Granted {
                store: self.store.clone(),
                clock: self.clock.clone(),
                key: key.clone(),
                lease,
                armed: true,
            };
            let last_use = previous.map_or(0, |r| r.lease_expires_at.max(r.updated_at).as_millis());
            let claimed = Claimed {
                worker,
                key,
                lease,
                claimed_at: now,
                floor_unix: time_floor.max(last_use),
            };
            return match self.open(layout, options, claimed).await {
                Ok(leased) => {
                    granted.keep();
                    Ok(Arc::new(leased))
                }
                Err(e) => {
                    granted.give_back().await;
                    Err(e)
                }
            };
        }
        Err(IdError::NoWorkerFree)
    }

    /// Makes the generator on a worker id just granted: reads how far earlier holders may
    /// stamp, sets where its ids start, records its own first window, and hands it over.
    async fn open(
        &self,
        layout: Layout,
        options: SnowflakeOptions,
        claimed: Claimed,
    ) -> Result<LeasedSnowflake, IdError> {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let wait = ms(ISSUE_WINDOW);
        let ceiling_key = self.ceiling_key(claimed.worker)?;
        // Read after the grant: it holds the end of every window an earlier holder opened by a
        // claim or a renewal the store applied before the grant.
        let reach = self.store.raise(&ceiling_key, 0).await?;
        // Read last: a store that forgot everything before either read shows this young.
        let kept_since = self.kept_since().await?;
        let now = self.clock.now().as_millis();
        // A reach further ahead than any window is a holder whose generator ran ahead of the
        // clock (after a rollback): starting above it beats waiting for the clock to get there.
        let (floor_unix, not_before_unix) = if reach > now.saturating_add(wait) {
            (claimed.floor_unix.max(reach), 0)
        } else {
            (claimed.floor_unix, reach)
        };
        // Strictly after: ids of that millisecond under other worker ids may sort higher.
        let floor_millis = floor_unix
            .saturating_sub(layout.epoch_ms())
            .saturating_add(1);
        let options = SnowflakeOptions {
            floor_millis: options.floor_millis.max(floor_millis),
            ..options
        };
        let generator = match &self.time {
            Some(time) => Snowflake::with_time(layout, claimed.worker, options, time.clone()),
            None => Snowflake::new(layout, claimed.worker, options),
        }?;
        let mut not_before = if not_before_unix == 0 {
            0
        } else {
            not_before_unix
                .saturating_sub(layout.epoch_ms())
                .saturating_add(1)
        };
        // The store may have forgotten a holder that renewed before its memory began (a
        // marker from a clock ahead of ours counts as beginning now); or the pool trusts no
        // record at all.
        let unknown_until = kept_since.min(now).saturating_add(wait);
        let full = if self.always_wait {
            wait
        } else {
            unknown_until.saturating_sub(now)
        };
        if full > 0 {
            not_before = not_before.max(generator.now_millis().saturating_add(full + 1));
        }
        generator.set_not_before(not_before);
        let leased = LeasedSnowflake {
            pool: self.clone(),
            key: claimed.key,
            time_floor_key: self.time_floor_key()?,
            ceiling_key,
            floor_written: AtomicU64::new(0),
            lease: Mutex::new(claimed.lease),
            generator,
        };
        // The claim's own window, recorded before any id is stamped in it.
        let until = leased.millis_at(claimed.claimed_at.saturating_add(self.window()));
        leased.raise_reach(until).await?;
        leased.generator.set_valid_until(until);
        Ok(leased)
    }
}

/// A worker id the store granted, before its generator is made.
struct Claimed {
    worker: u64,
    key: Key,
    lease: Lease,
    /// When the claim was sent, by the pool's clock.
    claimed_at: Timestamp,
    /// The time floor and the last holder's lease end (Unix milliseconds).
    floor_unix: u64,
}

/// A worker id granted to a claim that has not handed its generator over yet. Dropped armed
/// (the claim failed, or its caller went away mid-claim), it gives the worker id back.
struct Granted {
    store: SharedStore,
    clock: Arc<dyn Clock>,
    key: Key,
    lease: Lease,
    armed: bool,
}

impl Granted {
    /// The claim succeeded: the generator holds the worker id now.
    fn keep(mut self) {
        self.armed = false;
    }

    /// Gives the worker id back now.
    async fn give_back(mut self) {
        self.armed = false;
        give_back(&self.store, &self.key, &self.lease, self.clock.now()).await;
    }
}

impl Drop for Granted {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Dropped mid-claim: the store call cannot run here, so it runs in a task of its own.
        // Without a runtime, the lease runs out by itself.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (store, key, lease) = (self.store.clone(), self.key.clone(), self.lease);
            let now = self.clock.now();
            rt.spawn(async move { give_back(&store, &key, &lease, now).await });
        }
    }
}

/// Gives back a worker id under which no id was issued: its lease is cut to end now, so the
/// next claim may take it at once (and takes its end, now, as its time floor). Releasing the
/// record instead would keep the lease's end, up to a lease ahead, as the next holder's floor,
/// and push that holder's ids into the future. If the store cannot be reached, the lease runs
/// out by itself.
async fn give_back(store: &SharedStore, key: &Key, lease: &Lease, now: Timestamp) {
    let _ = store.renew(key, lease, MIN_DURATION, now).await;
}

/// A Snowflake generator on a leased worker id.
#[derive(Debug)]
pub struct LeasedSnowflake {
    pool: WorkerPool,
    key: Key,
    time_floor_key: Key,
    ceiling_key: Key,
    /// The last time (layout milliseconds) written to the time floor.
    floor_written: AtomicU64,
    lease: Mutex<Lease>,
    generator: Snowflake,
}

impl std::ops::Deref for LeasedSnowflake {
    type Target = Snowflake;
    fn deref(&self) -> &Snowflake {
        &self.generator
    }
}

impl LeasedSnowflake {
    /// When the lease ran out here without a renewal (the generator then refuses ids), or
    /// `None` while it runs.
    pub(crate) fn expired_at(&self) -> Option<Timestamp> {
        let g = &self.generator;
        let until = g.valid_until();
        (!g.is_lost() && g.now_millis() > until)
            .then(|| Timestamp::from_millis(g.layout().epoch_ms().saturating_add(until)))
    }

    /// When a new holder stamps its first id (see [`WorkerPool::claim`]), while that is still
    /// ahead; `None` after.
    pub(crate) fn starts_at(&self) -> Option<Timestamp> {
        let g = &self.generator;
        let left = g
            .not_before()
            .checked_sub(g.now_millis())
            .filter(|&l| l > 0)?;
        Some(
            self.pool
                .clock
                .now()
                .saturating_add(Duration::from_millis(left)),
        )
    }

    /// The current lease.
    pub fn lease(&self) -> Lease {
        *self
            .lease
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The generator's time (layout milliseconds) when the pool's clock reads `at`.
    fn millis_at(&self, at: Timestamp) -> u64 {
        let now = self.pool.clock.now();
        let g = self.generator.now_millis();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        if at >= now {
            g.saturating_add(ms(at.saturating_since(now)))
        } else {
            g.saturating_sub(ms(now.saturating_since(at)))
        }
    }

    /// Records in the worker id's reach that this generator may stamp ids up to `until`
    /// (layout milliseconds): done before the window opens, so a claim granted after it
    /// starts above it.
    async fn raise_reach(&self, until: u64) -> Result<(), IdError> {
        let until_unix = self.generator.layout().epoch_ms().saturating_add(until);
        self.pool.store.raise(&self.ceiling_key, until_unix).await?;
        Ok(())
    }

    /// Raises the id space's time floor to this generator's last id.
    async fn raise_time_floor(&self) -> Result<(), IdError> {
        let g = &self.generator;
        let last = g.last_millis();
        // Nothing issued since the last raise: no write.
        if last <= self.floor_written.load(Ordering::Acquire) {
            return Ok(());
        }
        self.pool
            .store
            .raise(
                &self.time_floor_key,
                g.layout().epoch_ms().saturating_add(last),
            )
            .await?;
        self.floor_written.fetch_max(last, Ordering::AcqRel);
        Ok(())
    }

    /// Renews the lease, and lets the generator stamp ids up to [`ISSUE_WINDOW`] (or the
    /// lease, if shorter) after the renewal was sent; then records the last id's time in the
    /// id space's time floor. A store failure leaves the window as it was (ids stop at its
    /// end until a renewal succeeds); a stale answer means another process holds the worker
    /// id now (or the store lost it), and the generator stops for good (a
    /// [`crate::ManagedSnowflake`] then claims another).
    ///
    /// Before the renewal is sent, the end of the window it opens (by this generator's time,
    /// which runs ahead of the clock after a rollback) is written to the worker id's reach, so
    /// a claim granted after the renewal starts above every id stamped in it.
    ///
    /// Dropped before it ends, it leaves nothing half-done: a renewal the store applied unseen
    /// extends the lease there while the generator keeps the earlier window, so it stops
    /// sooner, never later, and the next renewal goes on from there.
    pub async fn heartbeat(&self) -> Result<(), IdError> {
        if self.generator.is_lost() {
            return Err(IdError::WorkerLost);
        }
        let lease = self.lease();
        let sent = self.pool.clock.now();
        let until = self.millis_at(sent.saturating_add(self.pool.window()));
        self.raise_reach(until).await?;
        let renewed = self
            .pool
            .store
            .renew(&self.key, &lease, self.pool.lease, sent)
            .await;
        match renewed {
            Ok(new) => {
                *self
                    .lease
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = new;
                self.generator.extend_valid_until(until);
                self.raise_time_floor().await
            }
            Err(LeaseError::Stale(_)) => {
                self.generator.mark_lost();
                Err(IdError::WorkerLost)
            }
            Err(e) => Err(IdError::Store(e.to_string())),
        }
    }

    /// Renews the lease and records the last id's time every second (and at least every third
    /// of the lease) on the current Tokio runtime, until the worker id is lost or released.
    /// The task holds the generator until then; aborting it stops the renewals, and the lease
    /// then runs out by itself.
    pub fn spawn_heartbeat(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let every = this.pool.beat_every();
            loop {
                tokio::time::sleep(every).await;
                if matches!(this.heartbeat().await, Err(IdError::WorkerLost)) {
                    return;
                }
            }
        })
    }

    /// Gives the worker id back: no more ids are issued, and its record is kept for the
    /// quarantine (holding the time of the last id), so nobody reuses the id before then.
    ///
    /// Issuing stops before the first `.await`: dropped before it ends, no id is issued any
    /// more all the same, and the record stays held until its lease runs out instead of
    /// entering the quarantine (the time floor may then lag the last ids by up to a second, as
    /// after a crash).
    pub async fn release(&self) -> Result<(), IdError> {
        self.generator.mark_lost();
        let floor_raised = self.raise_time_floor().await;
        let lease = self.lease();
        let last = self.generator.last_millis();
        self.pool
            .store
            .complete(
                &self.key,
                &lease,
                Bytes::from(last.to_string()),
                self.pool.clock.now(),
            )
            .await
            .map_err(|e| IdError::Store(e.to_string()))?;
        floor_raised
    }
}
