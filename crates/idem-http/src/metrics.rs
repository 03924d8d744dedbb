//! The layer's metrics: what it did with each request, and how each record was settled.

/// Registers the help text of the layer's metrics with the installed `metrics` recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "idem_http_requests_total",
        "Guarded-route requests by what the layer did: passed_through, executed, replayed, or the problem code."
    );
    metrics::describe_counter!(
        "idem_http_settled_total",
        "Records settled after the handler ran: stored, released, unknown, too_large, overtaken, failed."
    );
    metrics::describe_gauge!(
        crate::unstored::KEPT_GAUGE,
        metrics::Unit::Bytes,
        "Bytes of answers the store did not take in time, kept to offer it again (within the unstored answers' budget)."
    );
}

/// Counts a request by what the layer did with it: `passed_through`, `executed`,
/// `replayed`, or the code of the problem it answered with.
pub(crate) fn count(outcome: &'static str) {
    metrics::counter!("idem_http_requests_total", "outcome" => outcome).increment(1);
}

/// Counts how records were settled, once each: `stored`, `released`, `unknown`,
/// `too_large`, `overtaken` when another attempt had taken the key, or `failed` when the store
/// could not be told.
pub(crate) fn count_settled(result: &'static str) {
    metrics::counter!("idem_http_settled_total", "result" => result).increment(1);
}
