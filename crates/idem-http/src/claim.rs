//! Claiming a guarded request's key: a lease to run the handler, or an answer without running
//! it (the stored answer replayed, or a refusal saying why not).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use idem_claim::begin_waiting;
use idem_core::{BeginOutcome, BeginRequest, Lease, Store};

use crate::body::{ResponseBody, boxed};
use crate::header::IDEMPOTENT_REPLAYED;
use crate::layer::Config;
use crate::metrics::count;
use crate::problem::Problem;
use crate::problem_code::ProblemCode;
use crate::service::reject;
use crate::stored::Stored;

/// The `Retry-After` of a request refused because another with its key is in progress: the
/// first attempt may answer any moment, so a retry is worth making after a second rather than
/// at the end of its lease (the latest the key can be held), which would keep a client
/// waiting for as long as the lease runs (or make it give up) for an answer that was ready
/// long before.
const IN_PROGRESS_POLL: Duration = Duration::from_secs(1);

/// Begins the record: `Ok(lease)` to run the handler, `Err(answer)` for anything else.
pub(crate) async fn claim(
    cfg: &Config,
    begin: &BeginRequest,
) -> Result<Lease, Response<ResponseBody>> {
    let policy = &cfg.policy;
    let mut reopened = false;
    loop {
        let outcome = begin_waiting(&cfg.store, &*cfg.clock, begin, policy.in_flight)
            .await
            .map_err(|e| reject(Problem::store(&e)))?;
        let now = cfg.clock.now();
        let r = match outcome {
            BeginOutcome::Acquired(lease) => {
                count("executed");
                return Ok(lease);
            }
            BeginOutcome::Mismatch => {
                return Err(reject(
                    ProblemCode::IdempotencyKeyMismatch
                        .problem(
                            "This Idempotency-Key was used with a different request (method, \
                             path, query or body); use a new key for a new request.",
                        )
                        .with_status(policy.preset.mismatch_status()),
                ));
            }
            BeginOutcome::InProgress { lease_expires_at } => {
                return Err(reject(
                    ProblemCode::RequestInProgress
                        .problem(
                            "A request with this Idempotency-Key is still being processed; \
                             retry later.",
                        )
                        .retry_after(lease_expires_at.saturating_since(now).min(IN_PROGRESS_POLL)),
                ));
            }
            BeginOutcome::Replay(r) => r,
        };
        let stored = Stored::decode(r.response).map_err(|_| {
            reject(
                ProblemCode::RecordCorrupt
                    .problem("The stored answer for this Idempotency-Key could not be read."),
            )
        })?;
        match stored {
            Stored::Response {
                status,
                headers,
                body,
            } => return Err(replay(status, headers, body)),
            Stored::TooLarge { status } => {
                return Err(reject(
                    ProblemCode::ResponseNotReplayable
                        .problem(
                            "The request with this Idempotency-Key was processed, but its \
                             response was too large to store; it is not run again.",
                        )
                        .with("original_status", status.as_u16()),
                ));
            }
            Stored::Unknown { until: Some(until) } if until <= now && !reopened => {
                // The attempt's lease is over: run again (at-least-once). Once only: if
                // another retry reopened and completed it meanwhile, its answer stands.
                reopened = true;
                cfg.store
                    .reopen(&begin.key, r.fence, now)
                    .await
                    .map_err(|e| reject(Problem::store(&e)))?;
            }
            Stored::Unknown { until } => {
                return Err(reject(unknown(until.map(|u| u.saturating_since(now)))));
            }
        }
    }
}

fn unknown(retry_after: Option<Duration>) -> Problem {
    let p = ProblemCode::OutcomeUnknown.problem(
        "An earlier request with this Idempotency-Key may or may not have taken effect (its \
         upstream did not answer); it is not run again until the outcome is resolved.",
    );
    match retry_after {
        Some(d) => p.retry_after(d),
        None => p,
    }
}

fn replay(status: StatusCode, headers: HeaderMap, body: Bytes) -> Response<ResponseBody> {
    count("replayed");
    let mut res = Response::new(boxed(Full::new(body)));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}
