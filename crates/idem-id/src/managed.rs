//! A Snowflake generator that keeps itself on a worker id: it claims one, renews it, and when
//! the store no longer holds its lease (taken over, or forgotten by a store that restarted
//! empty) it claims another and resumes.
//!
//! A worker id is lost when a renewal answers stale. Either another process holds the id now
//! (this one paused past its lease), or the store forgot its records and counters. Either way
//! the claim rule of [`WorkerPool::claim`] keeps the next ids apart from every earlier
//! holder's: a new holder stamps nothing while a process whose renewal the store no longer
//! knows may still be stamping under its worker id (at most [`crate::ISSUE_WINDOW`]). So it
//! claims again at once, and its new ids also start above every id it issued before.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use idem_core::{Clock, Timestamp};

use crate::{Batch, IdError, Layout, LeasedSnowflake, SnowflakeOptions, WorkerPool};

/// What a [`ManagedSnowflake`] is doing, for health reports. Times are by the pool's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerStatus {
    /// Holding `worker`, claimed at `since`, and waiting until `ready_at` to issue its first
    /// id: until then an earlier holder of it may still be issuing (see
    /// [`WorkerPool::claim`]).
    Starting {
        /// The worker id.
        worker: u64,
        /// When it was claimed.
        since: Timestamp,
        /// When its first id may be issued.
        ready_at: Timestamp,
    },
    /// Issuing ids under `worker`, held since `since`.
    Holding {
        /// The worker id.
        worker: u64,
        /// When it was claimed.
        since: Timestamp,
    },
    /// Holding `worker`, but its lease ran out here at `since` before a renewal came through
    /// (the store is unreachable or failing): no ids until a renewal succeeds, or until the
    /// store answers that the lease is gone (then [`WorkerStatus::Claiming`]).
    Expired {
        /// The worker id.
        worker: u64,
        /// When its lease ran out.
        since: Timestamp,
        /// Why the renewals failed (the last failure).
        reason: String,
    },
    /// No worker id since `since`: the last one was lost (or none could be claimed at start),
    /// and one is claimed at `next_try`: at once after a loss; after a failed claim, after a
    /// backoff of up to a lease.
    Claiming {
        /// Since when there has been no worker id.
        since: Timestamp,
        /// When the next claim is tried.
        next_try: Timestamp,
        /// Why there is none.
        reason: String,
    },
    /// No ids, for good: released, or stopped by an error that no retry can fix (a layout
    /// whose time bits are used up, an invalid id space).
    Stopped {
        /// When it stopped.
        since: Timestamp,
        /// Why.
        reason: String,
    },
}

impl WorkerStatus {
    /// Whether ids are being issued.
    pub fn is_issuing(&self) -> bool {
        matches!(self, WorkerStatus::Holding { .. })
    }

    /// When the current state began.
    pub fn since(&self) -> Timestamp {
        match self {
            WorkerStatus::Starting { since, .. }
            | WorkerStatus::Holding { since, .. }
            | WorkerStatus::Expired { since, .. }
            | WorkerStatus::Claiming { since, .. }
            | WorkerStatus::Stopped { since, .. } => *since,
        }
    }
}

/// A Snowflake generator on a worker id leased from a [`WorkerPool`], kept by a task of its
/// own: it renews the lease every `min(lease / 3, 1 s)`, and when the lease is lost it claims a
/// new worker id and resumes, issuing ids above every id it issued before. A worker id's first
/// ids wait while an earlier holder of it may still issue, at most [`crate::ISSUE_WINDOW`]
/// (see [`WorkerPool::claim`]). Meanwhile it answers [`IdError::NoWorker`] or
/// [`IdError::Starting`], and [`ManagedSnowflake::status`] says why.
///
/// What it goes through is logged (with `tracing`) once when it begins and once when it ends:
/// a lease that ran out before its renewal, a lost worker id, a claim that keeps failing.
///
/// Ids are unique across processes sharing the pool, and strictly increasing for a caller of
/// this generator, across worker ids too. Dropping it stops the task; the worker id then stays
/// held until its lease runs out, as after a crash. [`ManagedSnowflake::release`] gives it
/// back at once.
pub struct ManagedSnowflake {
    shared: Arc<Shared>,
    keeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for ManagedSnowflake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedSnowflake")
            .field("pool", &self.shared.pool)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

struct Shared {
    pool: WorkerPool,
    layout: Layout,
    options: SnowflakeOptions,
    phase: Mutex<Phase>,
}

enum Phase {
    Holding {
        generator: Arc<LeasedSnowflake>,
        since: Timestamp,
        /// The last renewal's failure, cleared by a success.
        renewal_error: Option<String>,
    },
    Claiming {
        since: Timestamp,
        next_try: Timestamp,
        reason: String,
        /// No id below this (layout milliseconds).
        floor_millis: u64,
    },
    Stopped {
        since: Timestamp,
        reason: String,
        error: IdError,
    },
}

/// What the keeper does next.
enum Step {
    /// Renew the lease of the generator held (after a beat).
    Renew(Arc<LeasedSnowflake>),
    /// Claim a worker id once the pool's clock is at the first value, with ids above the
    /// second (layout milliseconds).
    Claim(Timestamp, u64),
}

/// The state as logged: a change of this is a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    Starting(u64),
    Holding(u64),
    Expired(u64),
    Claiming,
    Stopped,
}

impl ManagedSnowflake {
    /// Claims a worker id from `pool` and keeps it on the current Tokio runtime (which must be
    /// running). Fails only when no retry could succeed (an invalid id space, a layout that
    /// does not fit the clock); if no worker id is free or the store fails, it returns all the
    /// same, in [`WorkerStatus::Claiming`], and keeps trying.
    pub async fn start(
        pool: WorkerPool,
        layout: Layout,
        options: SnowflakeOptions,
    ) -> Result<Arc<Self>, IdError> {
        let now = pool.clock().now();
        let phase = match pool.claim(layout, options).await {
            Ok(generator) => Phase::Holding {
                generator,
                since: now,
                renewal_error: None,
            },
            Err(e) if is_final(&e) => return Err(e),
            Err(e) => Phase::Claiming {
                since: now,
                next_try: now.saturating_add(pool.beat_every()),
                reason: e.to_string(),
                floor_millis: options.floor_millis,
            },
        };
        let shared = Arc::new(Shared {
            pool,
            layout,
            options,
            phase: Mutex::new(phase),
        });
        let keeper = tokio::spawn(Arc::clone(&shared).keep());
        Ok(Arc::new(Self {
            shared,
            keeper: Mutex::new(Some(keeper)),
        }))
    }

    /// The next id, or why there is none. Never blocks.
    pub fn try_next(&self) -> Result<u64, IdError> {
        let generator = self.shared.generator()?;
        generator.try_next().map_err(|e| self.shared.explain(e))
    }

    /// `n` ids reserved in one step (see [`crate::Snowflake::try_next_batch`]); the batch
    /// says which worker id they carry.
    pub fn try_next_batch(&self, n: u32) -> Result<Batch, IdError> {
        let generator = self.shared.generator()?;
        generator
            .try_next_batch(n)
            .map_err(|e| self.shared.explain(e))
    }

    /// The worker id held now, if any.
    pub fn worker(&self) -> Option<u64> {
        match &*self.shared.lock() {
            Phase::Holding { generator, .. } => Some(generator.worker()),
            Phase::Claiming { .. } | Phase::Stopped { .. } => None,
        }
    }

    /// The layout of the ids.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// What it is doing: cheap (no store call), for health reports.
    pub fn status(&self) -> WorkerStatus {
        let status = self.shared.status();
        let keeper_ended = self
            .keeper
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished);
        match status {
            WorkerStatus::Stopped { .. } => status,
            // The task keeping the worker id ended without stopping it: it panicked.
            _ if keeper_ended => WorkerStatus::Stopped {
                since: self.shared.pool.clock().now(),
                reason: "the task keeping the worker id ended unexpectedly".to_owned(),
            },
            _ => status,
        }
    }

    /// Stops issuing and gives the worker id back (its record is kept for the pool's
    /// quarantine, see [`LeasedSnowflake::release`]). The status is then
    /// [`WorkerStatus::Stopped`] for good. If this future is dropped before it ends, no id is
    /// issued any more all the same, and the worker id stays held until its lease runs out.
    pub async fn release(&self) -> Result<(), IdError> {
        let now = self.shared.pool.clock().now();
        let previous = std::mem::replace(
            &mut *self.shared.lock(),
            Phase::Stopped {
                since: now,
                reason: "released".to_owned(),
                error: IdError::WorkerLost,
            },
        );
        self.stop_keeper();
        match previous {
            Phase::Holding { generator, .. } => {
                tracing::info!(
                    id_space = self.shared.pool.name(),
                    worker = generator.worker(),
                    "Snowflake worker id released"
                );
                generator.release().await
            }
            Phase::Claiming { .. } => Ok(()),
            // Already stopped: it stays stopped for its own reason.
            stopped @ Phase::Stopped { .. } => {
                *self.shared.lock() = stopped;
                Ok(())
            }
        }
    }
}

impl ManagedSnowflake {
    /// Stops the task keeping the worker id (at its next `.await`).
    fn stop_keeper(&self) {
        let keeper = self
            .keeper
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(keeper) = keeper {
            keeper.abort();
        }
    }
}

impl Drop for ManagedSnowflake {
    fn drop(&mut self) {
        self.stop_keeper();
    }
}

/// Whether a claim failed for good (retrying cannot help).
fn is_final(e: &IdError) -> bool {
    matches!(
        e,
        IdError::Layout(_) | IdError::LayoutExhausted | IdError::Space(_)
    )
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The generator to issue from, or why there is none.
    fn generator(&self) -> Result<Arc<LeasedSnowflake>, IdError> {
        match &*self.lock() {
            Phase::Holding { generator, .. } => Ok(Arc::clone(generator)),
            Phase::Claiming {
                next_try, reason, ..
            } => Err(IdError::NoWorker {
                reason: reason.clone(),
                retry_after: next_try
                    .saturating_since(self.pool.clock().now())
                    .max(Duration::from_secs(1)),
            }),
            Phase::Stopped { error, .. } => Err(error.clone()),
        }
    }

    /// A generator that was just found lost is being replaced: say so rather than "lost".
    fn explain(&self, e: IdError) -> IdError {
        match e {
            IdError::WorkerLost => match self.generator() {
                Err(e) => e,
                Ok(_) => IdError::NoWorker {
                    reason: "the worker id was lost".to_owned(),
                    retry_after: crate::ISSUE_WINDOW,
                },
            },
            e => e,
        }
    }

    fn status(&self) -> WorkerStatus {
        match &*self.lock() {
            Phase::Holding {
                generator,
                since,
                renewal_error,
            } => match (generator.starts_at(), generator.expired_at()) {
                (Some(ready_at), _) => WorkerStatus::Starting {
                    worker: generator.worker(),
                    since: *since,
                    ready_at,
                },
                (None, Some(at)) => WorkerStatus::Expired {
                    worker: generator.worker(),
                    since: at,
                    reason: renewal_error.clone().unwrap_or_else(|| {
                        "the lease ran out before a renewal came through".to_owned()
                    }),
                },
                (None, None) => WorkerStatus::Holding {
                    worker: generator.worker(),
                    since: *since,
                },
            },
            Phase::Claiming {
                since,
                next_try,
                reason,
                ..
            } => WorkerStatus::Claiming {
                since: *since,
                next_try: *next_try,
                reason: reason.clone(),
            },
            Phase::Stopped { since, reason, .. } => WorkerStatus::Stopped {
                since: *since,
                reason: reason.clone(),
            },
        }
    }

    /// Keeps a worker id until stopped: renews the one held, claims one when there is none.
    async fn keep(self: Arc<Self>) {
        let every = self.pool.beat_every();
        // A failed claim is tried again after this, doubling up to a lease.
        let mut backoff = every;
        let mut shown = None;
        loop {
            self.log_transition(&mut shown);
            let step = match &*self.lock() {
                Phase::Holding { generator, .. } => Step::Renew(Arc::clone(generator)),
                Phase::Claiming {
                    next_try,
                    floor_millis,
                    ..
                } => Step::Claim(*next_try, *floor_millis),
                Phase::Stopped { .. } => return,
            };
            match step {
                Step::Renew(generator) => {
                    tokio::time::sleep(every).await;
                    let beat = generator.heartbeat().await;
                    self.after_beat(&generator, beat);
                }
                Step::Claim(at, floor_millis) => {
                    let wait = at.saturating_since(self.pool.clock().now());
                    if wait.is_zero() {
                        self.claim(floor_millis, every, &mut backoff).await;
                    } else {
                        // In steps of a beat: the wait is by the pool's clock, which may jump.
                        tokio::time::sleep(wait.min(every)).await;
                    }
                }
            }
        }
    }

    /// Claims a worker id with ids above `floor_millis`; if that fails, the next try is after
    /// `backoff`, which doubles up to a lease.
    async fn claim(&self, floor_millis: u64, every: Duration, backoff: &mut Duration) {
        let options = SnowflakeOptions {
            floor_millis,
            ..self.options
        };
        let claimed = self.pool.claim(self.layout, options).await;
        let now = self.pool.clock().now();
        let e = match claimed {
            Ok(generator) => {
                *backoff = every;
                return self.hold(generator);
            }
            Err(e) => e,
        };
        let mut phase = self.lock();
        let Phase::Claiming {
            next_try, reason, ..
        } = &mut *phase
        else {
            return; // released meanwhile
        };
        if is_final(&e) {
            *phase = Phase::Stopped {
                since: now,
                reason: e.to_string(),
                error: e,
            };
        } else {
            *next_try = now.saturating_add(*backoff);
            *reason = e.to_string();
            *backoff = (*backoff * 2).min(self.pool.lease_length().max(every));
        }
    }

    /// Records a renewal's outcome; a lost worker id starts the wait for a new one.
    fn after_beat(&self, generator: &Arc<LeasedSnowflake>, beat: Result<(), IdError>) {
        let now = self.pool.clock().now();
        let mut phase = self.lock();
        let Phase::Holding {
            generator: held,
            renewal_error,
            ..
        } = &mut *phase
        else {
            return; // released meanwhile
        };
        if !Arc::ptr_eq(held, generator) {
            return;
        }
        match beat {
            Ok(()) => *renewal_error = None,
            Err(IdError::WorkerLost) => {
                // Claimed again at once: the claim's wait keeps the new ids apart from any
                // earlier holder's (see the module's notes); they start above this one's too.
                let floor_millis = self
                    .options
                    .floor_millis
                    .max(generator.last_millis().saturating_add(1));
                *phase = Phase::Claiming {
                    since: now,
                    next_try: now,
                    reason: format!(
                        "worker id {} was lost: the store no longer holds its lease (another \
                         process took it over, or the store lost its records)",
                        generator.worker()
                    ),
                    floor_millis,
                };
            }
            Err(e) => *renewal_error = Some(e.to_string()),
        }
    }

    /// Starts issuing from a freshly claimed generator, unless released meanwhile (then the
    /// worker id is given back).
    fn hold(&self, generator: Arc<LeasedSnowflake>) {
        let now = self.pool.clock().now();
        let mut phase = self.lock();
        if let Phase::Stopped { .. } = &*phase {
            drop(phase);
            // In a task of its own: this one is being stopped.
            tokio::spawn(async move {
                let _ = generator.release().await;
            });
            return;
        }
        *phase = Phase::Holding {
            generator,
            since: now,
            renewal_error: None,
        };
    }

    /// Logs the state if it changed since `shown`: each degraded state once as it begins, and
    /// once as it ends.
    fn log_transition(&self, shown: &mut Option<(Shown, Timestamp)>) {
        let status = self.status();
        let current = match &status {
            WorkerStatus::Starting { worker, .. } => Shown::Starting(*worker),
            WorkerStatus::Holding { worker, .. } => Shown::Holding(*worker),
            WorkerStatus::Expired { worker, .. } => Shown::Expired(*worker),
            WorkerStatus::Claiming { .. } => Shown::Claiming,
            WorkerStatus::Stopped { .. } => Shown::Stopped,
        };
        if shown.is_some_and(|(s, _)| s == current) {
            return;
        }
        let before = shown.replace((current, status.since()));
        // How long ids were refused, when they resume.
        let without = before.map_or(Duration::ZERO, |(_, since)| {
            status.since().saturating_since(since)
        });
        let before = before.map(|(s, _)| s);
        let space = self.pool.name();
        match (&status, before) {
            (
                WorkerStatus::Starting {
                    worker, ready_at, ..
                },
                _,
            ) => {
                let wait = ready_at.saturating_since(self.pool.clock().now());
                tracing::info!(
                    id_space = space,
                    worker,
                    first_ids_in = ?wait,
                    "claimed a Snowflake worker id; its ids begin once any earlier holder of it \
                     has stopped"
                );
            }
            (WorkerStatus::Holding { worker, .. }, None | Some(Shown::Starting(_))) => {
                tracing::info!(id_space = space, worker, "holding a Snowflake worker id");
            }
            (WorkerStatus::Holding { worker, .. }, Some(Shown::Expired(_))) => {
                tracing::info!(
                    id_space = space,
                    worker,
                    without = ?without,
                    "the Snowflake worker id's lease is renewed again; ids resume"
                );
            }
            (WorkerStatus::Holding { worker, .. }, Some(_)) => {
                tracing::info!(
                    id_space = space,
                    worker,
                    without = ?without,
                    "a new Snowflake worker id is held; ids resume"
                );
            }
            (WorkerStatus::Expired { worker, reason, .. }, _) => {
                tracing::warn!(
                    id_space = space,
                    worker,
                    error = %reason,
                    "the Snowflake worker id's lease ran out before it could be renewed; \
                     no Snowflake ids until it is"
                );
            }
            (
                WorkerStatus::Claiming {
                    next_try, reason, ..
                },
                _,
            ) => {
                let wait = next_try.saturating_since(self.pool.clock().now());
                tracing::warn!(
                    id_space = space,
                    reason = %reason,
                    next_claim_in = ?wait,
                    "no Snowflake worker id; no Snowflake ids until one is claimed"
                );
            }
            (WorkerStatus::Stopped { reason, .. }, _) => {
                tracing::error!(
                    id_space = space,
                    reason = %reason,
                    "Snowflake ids stopped for good"
                );
            }
        }
    }
}
