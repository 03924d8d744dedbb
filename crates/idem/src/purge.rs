//! Deleting expired records.
//!
//! A store keeps every record until someone deletes it: an expired record no longer answers
//! (a `begin` on it acquires afresh), but its row stays until [`idem_core::Store::purge_expired`] removes
//! it. A process that owns a store runs [`purge_loop`] in the background; `idem serve` and
//! `idem gateway` do, and a service that uses the run-once API or the HTTP layer should too:
//!
//! ```no_run
//! # async fn demo(store: idem::SharedStore) {
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! tokio::spawn(idem::purge::purge_loop(store, Arc::new(idem::SystemClock), Duration::from_secs(60)));
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, DynStore, SharedStore, StoreError, Timestamp};
use tracing::{info, warn};

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

/// Runs [`purge_all`] every `every` (the first pass at once) until the task is dropped. A
/// failing store is logged and tried again at the next tick.
pub async fn purge_loop(store: SharedStore, clock: Arc<dyn Clock>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match purge_all(&*store, clock.now()).await {
            Ok(0) => {}
            Ok(n) => info!(purged = n, "purged expired records"),
            Err(e) => warn!(error = %e, "purging expired records failed; will try again"),
        }
    }
}
