//! Counts records by state now and then, for the gauges operators page on and the admin
//! page's chart.
//!
//! Counting may read every record (on stores with no index on state), so it runs on a timer
//! in the background, never per request: one count per [`SAMPLE_EVERY`], or less often when a
//! count takes long (never more than a tenth of the time), kept for the last [`HISTORY_LEN`]
//! samples.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{Clock, RecordFilter, RecordState, SharedStore, Store, Timestamp};
use idem_http::operator::{self, HttpCounts};

use super::answers::Sample;
use tracing::warn;

/// How often records are counted.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(30);

/// How many samples are kept (two hours at [`SAMPLE_EVERY`]).
pub const HISTORY_LEN: usize = 240;

/// Counts taken over time, newest last.
#[derive(Debug, Default)]
pub struct History(Mutex<VecDeque<(Timestamp, HttpCounts)>>);

impl History {
    /// Adds a sample, forgetting the oldest beyond [`HISTORY_LEN`].
    pub fn push(&self, at: Timestamp, counts: HttpCounts) {
        let mut samples = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if samples.len() == HISTORY_LEN {
            samples.pop_front();
        }
        samples.push_back((at, counts));
    }

    /// The samples, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        let samples = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        samples.iter().map(|(at, c)| Sample::new(*at, c)).collect()
    }
}

/// Describes the gauges [`publish`] sets.
pub fn describe_metrics() {
    metrics::describe_gauge!(
        "idem_records",
        "Records in the store by state (in_progress, stuck, completed, released, expired), as last counted."
    );
    metrics::describe_gauge!(
        "idem_records_unknown_outcomes",
        "Completed records holding an unknown outcome (retries get 409 outcome_unknown), as last counted."
    );
    metrics::describe_gauge!(
        "idem_records_oldest_in_progress_seconds",
        metrics::Unit::Seconds,
        "How long ago the oldest in-progress or stuck record's attempt started (0 when there is none)."
    );
    metrics::describe_counter!(
        "idem_records_count_errors_total",
        "Counts of the records that failed (the gauges keep their last values)."
    );
    metrics::describe_counter!(
        "idem_record_repairs_total",
        "Repairs operators asked for, by action (release, reopen, delete) and result (applied, skipped)."
    );
}

/// Sets the gauges from one count taken at `now`.
pub fn publish(c: &HttpCounts, now: Timestamp) {
    for state in RecordState::ALL {
        metrics::gauge!("idem_records", "state" => state.as_str()).set(c.records.get(state) as f64);
    }
    metrics::gauge!("idem_records_unknown_outcomes").set(c.unknown as f64);
    let oldest = c
        .records
        .oldest_in_progress
        .map_or(0.0, |t| now.saturating_since(t).as_secs_f64());
    metrics::gauge!("idem_records_oldest_in_progress_seconds").set(oldest);
}

/// Counts the store's records every `every`, publishing the gauges and keeping the history,
/// until its task is aborted. Does nothing on a store that cannot count.
pub async fn run(
    store: SharedStore,
    clock: Arc<dyn Clock>,
    history: Arc<History>,
    every: Duration,
) {
    describe_metrics();
    let Some(admin) = Store::admin(&store) else {
        return;
    };
    let all = RecordFilter::default();
    loop {
        let now = clock.now();
        let started = std::time::Instant::now();
        match operator::counts(admin, &all, now).await {
            Ok(c) => {
                publish(&c, now);
                history.push(now, c);
            }
            Err(e) => {
                metrics::counter!("idem_records_count_errors_total").increment(1);
                warn!(error = %e, "could not count the records; the gauges keep their last values");
            }
        }
        // A count that reads every record (Redis: several seconds for a million) keeps the
        // store busy at most a tenth of the time.
        tokio::time::sleep(every.max(started.elapsed() * 10)).await;
    }
}
