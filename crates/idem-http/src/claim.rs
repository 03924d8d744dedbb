//! Claiming a guarded request's key: a lease to run the handler, or an answer without running
//! it (the stored answer replayed, or a refusal saying why not).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use idem_claim::begin_waiting;
use idem_core::{BeginOutcome, BeginRequest, Lease, Store, Timestamp};

use crate::body::{ResponseBody, boxed, full_with_trailers};
use crate::config::{Config, Protocol};
use crate::header::IDEMPOTENT_REPLAYED;
use crate::metrics::count;
use crate::problem::Problem;
use crate::problem::ToProblem;
use crate::stored::Stored;
use idem_wire::ProblemCode;

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
    let mut reopened = false;
    loop {
        let outcome = begin_waiting(&cfg.store, &*cfg.clock, begin, cfg.policy.in_flight)
            .await
            .map_err(|e| reject(cfg, Problem::store(&e)))?;
        let now = cfg.clock.now();
        match decide(cfg, outcome, now, reopened) {
            Next::Run(lease) => return Ok(lease),
            Next::Answer(answer) => return Err(answer),
            Next::Reopen { fence } => {
                // The attempt's lease is over: run again (at-least-once). Once only: if
                // another retry reopened and completed it meanwhile, its answer stands.
                reopened = true;
                cfg.store
                    .reopen(&begin.key, fence, now)
                    .await
                    .map_err(|e| reject(cfg, Problem::store(&e)))?;
            }
        }
    }
}

/// The answer to `begin` from what the store keeps in memory (a replay, a mismatch), if it
/// has one: no claim is made, so the caller's own task may ask, and a caller that leaves
/// abandons nothing. `None` sends the request on to [`claim`].
pub(crate) fn answer_from_memory(
    cfg: &Config,
    begin: &BeginRequest,
) -> Option<Response<ResponseBody>> {
    let now = cfg.clock.now();
    // Only a replay or a mismatch is a memory answer; anything else (a store breaking that
    // contract) goes to `claim`, and so does a stored unknown outcome whose lease is over,
    // which `claim` reopens.
    let outcome @ (BeginOutcome::Replay(_) | BeginOutcome::Mismatch) =
        cfg.store.begin_from_memory(begin, now)?
    else {
        return None;
    };
    match decide(cfg, outcome, now, false) {
        Next::Answer(answer) => Some(answer),
        Next::Run(_) | Next::Reopen { .. } => None,
    }
}

/// What a `begin`'s outcome means for the request.
enum Next {
    /// The key is claimed: run the handler.
    Run(Lease),
    /// Answer without running it.
    Answer(Response<ResponseBody>),
    /// The outcome was left unknown and its attempt's lease is over: reopen the record with
    /// this fence and begin again.
    Reopen { fence: u64 },
}

fn decide(cfg: &Config, outcome: BeginOutcome, now: Timestamp, reopened: bool) -> Next {
    let policy = &cfg.policy;
    let r = match outcome {
        BeginOutcome::Acquired(lease) => {
            count("executed");
            return Next::Run(lease);
        }
        BeginOutcome::Mismatch => {
            return Next::Answer(reject(
                cfg,
                ProblemCode::IdempotencyKeyMismatch
                    .problem(match cfg.protocol {
                        Protocol::Http => {
                            "This Idempotency-Key was used with a different request (method, \
                             path, query or body); use a new key for a new request."
                        }
                        #[cfg(feature = "grpc")]
                        Protocol::Grpc => {
                            "This idempotency key was used with a different call (method or \
                             request message); use a new key for a new call."
                        }
                    })
                    .with_status(policy.preset.mismatch_status()),
            ));
        }
        BeginOutcome::InProgress { lease_expires_at } => {
            return Next::Answer(reject(
                cfg,
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
    let Ok(stored) = Stored::decode(r.response) else {
        return Next::Answer(reject(
            cfg,
            ProblemCode::RecordCorrupt
                .problem("The stored answer for this Idempotency-Key could not be read."),
        ));
    };
    match stored {
        Stored::Response {
            status,
            headers,
            body,
            trailers,
        } => Next::Answer(replay(status, headers, body, trailers)),
        Stored::TooLarge { status } => Next::Answer(reject(
            cfg,
            ProblemCode::ResponseNotReplayable
                .problem(
                    "The request with this Idempotency-Key was processed, but its response \
                     was too large to store; it is not run again.",
                )
                .with("original_status", status.as_u16()),
        )),
        Stored::Unknown { until: Some(until) } if until <= now && !reopened => {
            Next::Reopen { fence: r.fence }
        }
        Stored::Unknown { until } => {
            Next::Answer(reject(cfg, unknown(until.map(|u| u.saturating_since(now)))))
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

fn replay(
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: HeaderMap,
) -> Response<ResponseBody> {
    count("replayed");
    let mut res = Response::new(full_with_trailers(body, trailers));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}

/// Answers with `problem` as the route speaks (problem+json, or a gRPC status), counted by
/// its code.
pub(crate) fn reject(cfg: &Config, problem: Problem) -> Response<ResponseBody> {
    count(problem.code());
    match cfg.protocol {
        Protocol::Http => problem.into_http::<Full<Bytes>>().map(boxed),
        #[cfg(feature = "grpc")]
        Protocol::Grpc => problem.into_grpc().into_http(),
    }
}
