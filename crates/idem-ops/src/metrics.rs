//! A `metrics` recorder that renders the Prometheus text format.
//!
//! Written here rather than taken from `metrics-exporter-prometheus`: that crate brings its
//! own listener, a clock library and two more versions of `hashbrown` into the build, while
//! idem needs only counters, gauges and fixed-bucket histograms rendered into a route of its
//! own. Label values come from the code (outcomes, results), never from requests.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock, RwLockReadGuard};

use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// Upper bounds of the histogram buckets, in the metric's unit (seconds for latencies).
const BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

#[derive(Default)]
struct Buckets {
    counts: [AtomicU64; BUCKETS.len() + 1],
    /// The sum, as f64 bits.
    sum: AtomicU64,
}

impl HistogramFn for Buckets {
    fn record(&self, value: f64) {
        let i = BUCKETS
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }
}

#[derive(Default)]
struct Families {
    counters: Family<AtomicU64>,
    gauges: Family<AtomicU64>,
    histograms: Family<Buckets>,
    help: BTreeMap<String, String>,
}

/// One kind of metric, by key.
type Family<T> = BTreeMap<Key, Arc<T>>;

/// The process's metrics. Clones share them.
///
/// The `metrics` macros register a handle on every call, so the lookup is the hot path: it
/// takes a shared read lock and clones nothing; only a key seen for the first time takes the
/// write lock.
#[derive(Clone, Default)]
pub struct Registry(Arc<RwLock<Families>>);

impl Registry {
    /// The registry installed as the process's `metrics` recorder (installed on first use).
    pub fn global() -> Self {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let r = Registry::default();
                // Fails only if another recorder was installed first; then this one stays
                // empty, which the rendered text shows.
                let _ = metrics::set_global_recorder(r.clone());
                r
            })
            .clone()
    }

    fn families(&self) -> RwLockReadGuard<'_, Families> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn handle<T: Default>(
        &self,
        key: &Key,
        family: fn(&Families) -> &Family<T>,
        family_mut: fn(&mut Families) -> &mut Family<T>,
    ) -> Arc<T> {
        if let Some(handle) = family(&self.families()).get(key) {
            return handle.clone();
        }
        let mut all = self.0.write().unwrap_or_else(PoisonError::into_inner);
        family_mut(&mut all).entry(key.clone()).or_default().clone()
    }

    /// The rendered text as an HTTP answer, with the Prometheus text format's content type.
    pub fn response(&self) -> axum::response::Response {
        use axum::response::IntoResponse as _;
        (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            self.render(),
        )
            .into_response()
    }
    /// Everything recorded so far, in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let f = self.families();
        let mut out = String::new();
        let header = |out: &mut String, name: &str, kind: &str, last: &mut String| {
            if *last != name {
                if let Some(help) = f.help.get(name) {
                    let _ = writeln!(out, "# HELP {name} {help}");
                }
                let _ = writeln!(out, "# TYPE {name} {kind}");
                name.clone_into(last);
            }
        };
        let mut seen = String::new();
        for (key, v) in &f.counters {
            header(&mut out, key.name(), "counter", &mut seen);
            let _ = writeln!(
                out,
                "{}{} {}",
                key.name(),
                labels(key, None),
                v.load(Ordering::Relaxed)
            );
        }
        for (key, v) in &f.gauges {
            header(&mut out, key.name(), "gauge", &mut seen);
            let value = f64::from_bits(v.load(Ordering::Relaxed));
            let _ = writeln!(out, "{}{} {value}", key.name(), labels(key, None));
        }
        for (key, h) in &f.histograms {
            header(&mut out, key.name(), "histogram", &mut seen);
            let mut cumulative = 0;
            for (i, count) in h.counts.iter().enumerate() {
                cumulative += count.load(Ordering::Relaxed);
                let le = BUCKETS.get(i).map_or("+Inf".to_owned(), f64::to_string);
                let _ = writeln!(
                    out,
                    "{}_bucket{} {cumulative}",
                    key.name(),
                    labels(key, Some(&le))
                );
            }
            let sum = f64::from_bits(h.sum.load(Ordering::Relaxed));
            let _ = writeln!(out, "{}_sum{} {sum}", key.name(), labels(key, None));
            let _ = writeln!(
                out,
                "{}_count{} {cumulative}",
                key.name(),
                labels(key, None)
            );
        }
        out
    }
}

fn labels(key: &Key, le: Option<&str>) -> String {
    let mut parts: Vec<String> = key
        .labels()
        .map(|l| format!("{}=\"{}\"", l.key(), escape(l.value())))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Recorder for Registry {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
    }
    fn describe_gauge(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
    }
    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
    }
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.handle(key, |f| &f.counters, |f| &mut f.counters))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.handle(key, |f| &f.gauges, |f| &mut f.gauges))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.handle(key, |f| &f.histograms, |f| &mut f.histograms))
    }
}

impl Registry {
    fn describe(&self, key: &KeyName, description: &SharedString) {
        self.0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .help
            .insert(key.as_str().to_owned(), description.replace('\n', " "));
    }
}

/// Publishes an in-memory store's size every 5 s as the gauges `idem_store_memory_records` and
/// `idem_store_memory_bytes`, beside its bounds (`idem_store_memory_max_records`,
/// `idem_store_memory_max_bytes`), so that an operator sees it fill up before it refuses new
/// keys with 503 `store_full`. Runs until its task is aborted or the runtime stops.
pub async fn watch_memory_store(store: idem_store::MemoryStore) {
    let limits = store.limits();
    loop {
        // Described and set on every pass: the store is opened before the recorder is
        // installed, and what reaches no recorder is lost.
        metrics::describe_gauge!(
            "idem_store_memory_records",
            "Records held by the in-memory store, live or not yet purged."
        );
        metrics::describe_gauge!(
            "idem_store_memory_bytes",
            "Bytes held by the in-memory store, as it estimates them."
        );
        metrics::describe_gauge!(
            "idem_store_memory_max_records",
            "The in-memory store's bound on records."
        );
        metrics::describe_gauge!(
            "idem_store_memory_max_bytes",
            "The in-memory store's bound on bytes."
        );
        metrics::gauge!("idem_store_memory_max_records").set(limits.max_records as f64);
        metrics::gauge!("idem_store_memory_max_bytes").set(limits.max_bytes as f64);
        let (records, bytes) = store.usage();
        metrics::gauge!("idem_store_memory_records").set(records as f64);
        metrics::gauge!("idem_store_memory_bytes").set(bytes as f64);
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    }
}

/// Publishes a replay cache's work every 5 s: `idem_replay_cache_hits_total` (replays answered
/// from memory), `idem_replay_cache_entries` and `idem_replay_cache_bytes`. Runs until its
/// task is aborted or the runtime stops.
pub async fn watch_replay_cache(cache: idem_store::ReplayCache<idem_core::SharedStore>) {
    metrics::describe_counter!(
        "idem_replay_cache_hits_total",
        "Replays answered from the in-process replay cache, without a store call."
    );
    metrics::describe_gauge!(
        "idem_replay_cache_entries",
        "Answers held by the replay cache."
    );
    metrics::describe_gauge!(
        "idem_replay_cache_bytes",
        metrics::Unit::Bytes,
        "Bytes the replay cache holds, as it weighs its entries."
    );
    loop {
        metrics::counter!("idem_replay_cache_hits_total").absolute(cache.hits());
        let (entries, bytes) = cache.size();
        metrics::gauge!("idem_replay_cache_entries").set(entries as f64);
        metrics::gauge!("idem_replay_cache_bytes").set(bytes as f64);
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_text_format() {
        let r = Registry::default();
        metrics::with_local_recorder(&r, || {
            metrics::describe_counter!("t_requests_total", "Requests.");
            metrics::counter!("t_requests_total", "outcome" => "replayed").increment(2);
            metrics::counter!("t_requests_total", "outcome" => "executed").increment(1);
            metrics::gauge!("t_open").set(3.0);
            metrics::histogram!("t_seconds").record(0.003);
            metrics::histogram!("t_seconds").record(7.0);
        });
        let text = r.render();
        assert!(
            text.contains("# HELP t_requests_total Requests.\n# TYPE t_requests_total counter\n")
        );
        assert_eq!(text.matches("# TYPE t_requests_total").count(), 1);
        assert!(text.contains("t_requests_total{outcome=\"replayed\"} 2\n"));
        assert!(text.contains("t_requests_total{outcome=\"executed\"} 1\n"));
        assert!(text.contains("t_open 3\n"));
        assert!(text.contains("t_seconds_bucket{le=\"0.0025\"} 0\n"));
        assert!(text.contains("t_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("t_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("t_seconds_count 2\n"));
    }
}
