//! Counts of outcomes, and the metrics that go with them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_core::{Clock, Store};

use super::{Consumer, Outcome};

/// Counts of outcomes since the consumer was built (shared by its clones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Deliveries received.
    pub received: u64,
    /// Handled and acked.
    pub handled: u64,
    /// Acked without running.
    pub replayed: u64,
    /// Requeued.
    pub requeued: u64,
    /// Dead-lettered.
    pub dead_lettered: u64,
    /// Run without a record (no key, [`MissingKey::RunUnguarded`](crate::MissingKey::RunUnguarded)).
    pub unguarded: u64,
    /// Not settled with the broker.
    pub unsettled: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    received: AtomicU64,
    handled: AtomicU64,
    replayed: AtomicU64,
    requeued: AtomicU64,
    dead_lettered: AtomicU64,
    unguarded: AtomicU64,
    unsettled: AtomicU64,
}

impl Counters {
    /// Counts a delivery received from `source`.
    pub(super) fn note_received(&self, source: &Arc<str>) {
        self.received.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("idem_mq_received_total", "source" => source.clone()).increment(1);
    }

    /// Counts a message run without a record.
    pub(super) fn note_unguarded(&self) {
        self.unguarded.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts how a delivery of `source` ended.
    pub(super) fn note_settled(&self, source: &Arc<str>, outcome: Outcome) {
        let counter = match outcome {
            Outcome::Handled => &self.handled,
            Outcome::Replayed => &self.replayed,
            Outcome::Requeued => &self.requeued,
            Outcome::DeadLettered(_) => &self.dead_lettered,
            Outcome::Unsettled => &self.unsettled,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let reason = match outcome {
            Outcome::DeadLettered(r) => r.code(),
            _ => "",
        };
        metrics::counter!("idem_mq_messages_total", "source" => source.clone(),
            "outcome" => outcome.label(), "reason" => reason)
        .increment(1);
    }
}

impl<S: Store + Clone, C: Clock + Clone> Consumer<S, C> {
    /// Counts of outcomes so far.
    pub fn counts(&self) -> Counts {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            received: get(&c.received),
            handled: get(&c.handled),
            replayed: get(&c.replayed),
            requeued: get(&c.requeued),
            dead_lettered: get(&c.dead_lettered),
            unguarded: get(&c.unguarded),
            unsettled: get(&c.unsettled),
        }
    }
}
