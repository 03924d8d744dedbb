//! A store that measures itself: every call's latency goes to the histogram
//! `idem_store_call_seconds{store, operation}`, and runs in a `store` tracing span (a child of
//! the request's), with its outcome.
//!
//! The histogram handles are taken once, when the store is wrapped, so a call pays two clock
//! reads and one atomic add, not a lookup of its metric.

use std::future::Future;
use std::time::{Duration, Instant};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Counters, Key, Lease, LeaseError, Record, RecordAdmin,
    SharedStore, Step, StepError, Store, StoreError, Timestamp,
};
use metrics::Histogram;
use tracing::Instrument;

/// The operations measured, in the order of [`Metered`]'s handles.
const OPERATIONS: [&str; 10] = [
    "begin",
    "complete",
    "release",
    "renew",
    "reopen",
    "get",
    "raise",
    "advance",
    "purge",
    "record_step",
];

/// Describes the histogram [`Metered`] records into.
pub fn describe_metrics() {
    metrics::describe_histogram!(
        "idem_store_call_seconds",
        metrics::Unit::Seconds,
        "How long each call to the record store took, by store and operation, failures included."
    );
}

/// `store`, measured. Install the metrics recorder before wrapping: handles taken before it
/// record nothing.
pub struct Metered {
    inner: SharedStore,
    histograms: Vec<Histogram>,
}

impl Metered {
    /// Wraps `inner`.
    pub fn new(inner: SharedStore) -> Self {
        describe_metrics();
        let kind = Store::kind(&inner);
        let histograms = OPERATIONS
            .iter()
            .map(|op| metrics::histogram!("idem_store_call_seconds", "store" => kind, "operation" => *op))
            .collect();
        Self { inner, histograms }
    }

    async fn timed<T, E: std::fmt::Display>(
        &self,
        op: usize,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let span = tracing::debug_span!(
            "store",
            operation = OPERATIONS[op],
            error = tracing::field::Empty
        );
        let started = Instant::now();
        let out = call.instrument(span.clone()).await;
        self.histograms[op].record(started.elapsed().as_secs_f64());
        if let Err(e) = &out {
            span.record("error", tracing::field::display(e));
        }
        out
    }
}

impl Store for Metered {
    fn kind(&self) -> &'static str {
        Store::kind(&self.inner)
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        self.timed(0, Store::begin(&self.inner, req, now)).await
    }

    /// Not timed: no store operation runs (the replay cache counts its own hits).
    fn begin_from_memory(&self, req: &BeginRequest, now: Timestamp) -> Option<BeginOutcome> {
        Store::begin_from_memory(&self.inner, req, now)
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.timed(1, Store::complete(&self.inner, key, lease, response, now))
            .await
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.timed(2, Store::release(&self.inner, key, lease, now))
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        self.timed(3, Store::renew(&self.inner, key, lease, length, now))
            .await
    }

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        self.timed(9, Store::record_step(&self.inner, key, lease, step, now))
            .await
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        self.timed(4, Store::reopen(&self.inner, key, fence, now))
            .await
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.timed(5, Store::get(&self.inner, key, now)).await
    }

    async fn purge_expired(&self, now: Timestamp, limit: usize) -> Result<u64, StoreError> {
        self.timed(8, Store::purge_expired(&self.inner, now, limit))
            .await
    }

    /// Operators' calls are rare and not on a request's path: not measured.
    fn admin(&self) -> Option<&dyn RecordAdmin> {
        Store::admin(&self.inner)
    }
}

impl Counters for Metered {
    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        self.timed(6, Counters::raise(&self.inner, key, to)).await
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        self.timed(7, Counters::advance(&self.inner, key, by)).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use idem_core::Fingerprint;

    use super::*;
    use crate::metrics::Registry;

    #[tokio::test]
    async fn every_call_is_timed_by_operation() {
        let registry = Registry::default();
        let store = metrics::with_local_recorder(&registry, || {
            Metered::new(Arc::new(idem_store::MemoryStore::new()))
        });
        let req = BeginRequest::new(
            Key::parse("s", "n", "k").unwrap(),
            Fingerprint::of_bytes(b"x"),
        );
        let now = Timestamp::now();
        store.begin(&req, now).await.unwrap();
        store.begin(&req, now).await.unwrap();
        store.get(&req.key, now).await.unwrap();
        assert!(
            store.admin().is_some(),
            "the operator's view passes through"
        );
        let text = registry.render();
        assert!(
            text.contains(r#"idem_store_call_seconds_count{store="memory",operation="begin"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"idem_store_call_seconds_count{store="memory",operation="get"} 1"#),
            "{text}"
        );
    }

    /// A memory answer passes through untimed: the wrapped cache gives it and counts the hit,
    /// and no store call is recorded for it.
    #[tokio::test]
    async fn a_memory_answer_passes_through_untimed() {
        let registry = Registry::default();
        let cache = Arc::new(idem_store::ReplayCache::new(
            idem_store::MemoryStore::new(),
            idem_store::ReplayCacheLimits::default(),
        ));
        let store = metrics::with_local_recorder(&registry, || Metered::new(cache.clone()));
        let req = BeginRequest::new(
            Key::parse("s", "n", "k").unwrap(),
            Fingerprint::of_bytes(b"x"),
        );
        let now = Timestamp::now();
        assert!(
            store.begin_from_memory(&req, now).is_none(),
            "nothing kept yet"
        );
        let Ok(BeginOutcome::Acquired(lease)) = store.begin(&req, now).await else {
            panic!("not acquired")
        };
        let done = Bytes::from_static(b"done");
        store.complete(&req.key, &lease, done, now).await.unwrap();
        // The first replay comes from the store, which the cache then keeps.
        let replayed = store.begin(&req, now).await.unwrap();
        assert!(matches!(replayed, BeginOutcome::Replay(_)), "{replayed:?}");
        assert_eq!(cache.hits(), 0);

        let from_memory = store.begin_from_memory(&req, now);
        assert!(
            matches!(&from_memory, Some(BeginOutcome::Replay(r)) if &r.response[..] == b"done"),
            "{from_memory:?}"
        );
        assert_eq!(cache.hits(), 1, "answered by the cache");
        let text = registry.render();
        assert!(
            text.contains(r#"idem_store_call_seconds_count{store="memory",operation="begin"} 2"#),
            "the memory answer is not timed as a store call: {text}"
        );
    }
}
