//! Deleting expired records.
//!
//! A store keeps every record until someone deletes it: an expired record no longer answers
//! (a `begin` on it acquires afresh), but its row stays until [`idem_core::Store::purge_expired`] removes
//! it. A process that owns a store runs [`purge_loop`] in the background; `idem serve` and
//! `idem gateway` do, and a service that uses the run-once API or the HTTP layer should too:
//!
//! ```no_run
//! # async fn demo(store: idem::SharedStore) {
//! use std::sync::{Arc, Mutex, PoisonError};
//! use std::time::Duration;
//!
//! tokio::spawn(idem::purge::purge_loop(store, Arc::new(idem::SystemClock), Duration::from_secs(60)));
//! # }
//! ```

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{Clock, DynStore, SharedStore, StoreError, Timestamp};
use tracing::{debug, info, warn};

/// How many records one store call deletes at most; a pass makes as many calls as it needs,
/// yielding between them so a large backlog never holds the store for long.
pub const BATCH: usize = 10_000;

/// Deletes every record expired at `now`, in batches of [`BATCH`]; returns how many it deleted.
pub async fn purge_all(store: &dyn DynStore, now: Timestamp) -> Result<u64, StoreError> {
    let mut total = 0u64;
    loop {
        let n = store.purge_expired(now, BATCH).await?;
        total += n;
        if n < BATCH as u64 {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

/// Runs [`purge_all`] every `every` (the first pass at once; an interval under a second is
/// taken as a second) until the task is dropped. A failing store is logged and tried again at
/// the next tick. [`purge_loop_reporting`] does the
/// same and says how its passes went.
pub async fn purge_loop(store: SharedStore, clock: Arc<dyn Clock>, every: Duration) {
    purge_loop_reporting(store, clock, every, PurgeStatus::default()).await;
}

/// The shortest interval between two purge passes.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// [`purge_loop`], recording each pass in `status` for health reports. A run of failed passes
/// is logged once as it begins (a warning) and once as it ends.
pub async fn purge_loop_reporting(
    store: SharedStore,
    clock: Arc<dyn Clock>,
    every: Duration,
    status: PurgeStatus,
) {
    // `interval` panics on zero; a purge more often than every second only loads the store.
    let mut tick = tokio::time::interval(every.max(MIN_INTERVAL));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = purge_all(&*store, clock.now()).await;
        let was_failing = status.get().failing_since.is_some();
        match &result {
            Ok(0) => {}
            Ok(n) => info!(purged = n, "purged expired records"),
            Err(e) if was_failing => debug!(error = %e, "purging expired records failed again"),
            Err(e) => warn!(error = %e, "purging expired records failed; will try again"),
        }
        if was_failing && result.is_ok() {
            info!("purging expired records works again");
        }
        status.record(clock.now(), result.map_err(|e| e.to_string()));
    }
}

/// How the purge loop's passes went, shared between the loop that writes it and whoever reads
/// it (a health report). Cloning gives another handle on the same state.
#[derive(Debug, Clone, Default)]
pub struct PurgeStatus(Arc<Mutex<PurgeState>>);

/// What [`PurgeStatus::get`] answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeState {
    /// When the last pass ended (`None` before the first).
    pub last_run: Option<Timestamp>,
    /// Why the last pass failed, if it did.
    pub last_error: Option<String>,
    /// When the first of the passes failing since the last success ended.
    pub failing_since: Option<Timestamp>,
    /// How many records the last successful pass deleted.
    pub purged: u64,
}

impl PurgeStatus {
    /// The state now.
    pub fn get(&self) -> PurgeState {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records a pass that ended at `at`.
    pub fn record(&self, at: Timestamp, result: Result<u64, String>) {
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        s.last_run = Some(at);
        match result {
            Ok(n) => {
                s.purged = n;
                s.last_error = None;
                s.failing_since = None;
            }
            Err(e) => {
                s.last_error = Some(e);
                s.failing_since.get_or_insert(at);
            }
        }
    }
}
