//! The record API: begin, step, renew, complete, release and get of idempotency records, for
//! services in any language.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use idem_core::step::{MAX_STEPS, step_key};
use idem_core::{
    BeginOutcome, BeginRequest, Bytes, ClientKey, Clock, Fingerprint, InvalidStep, Key, KeyError,
    Lease, LeaseError, LeaseId, Namespace, Step, StepError, StepName, StepRefused, Store,
    Timestamp,
};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;
use tracing::{debug, warn};
use utoipa::ToSchema;

use idem::InFlight;
use idem::claim::cancel::finishing;
use idem::claim::settle_retrying;

use crate::AppState;
use crate::answers::{Acquired, BeginAnswer, RecordView, Renewed, Settled, StepRecorded};
use crate::auth::Caller;
use idem_http::{Problem, ProblemCode, ToProblem};
use idem_ops::json::{JsonBody, PathParams};

/// The longest `fingerprint` string accepted.
pub const MAX_FINGERPRINT_LEN: usize = 1024;
pub use idem_core::record::{MAX_LEASE, MAX_TTL};

pub(crate) fn key_problem(e: &KeyError) -> Problem {
    ProblemCode::InvalidKey.problem(format!("{e}."))
}

fn record_key(caller: &Caller, namespace: &str, key: &str) -> Result<Key, Problem> {
    Ok(Key::new(
        caller.scope.clone(),
        Namespace::new(namespace).map_err(|e| key_problem(&e))?,
        ClientKey::new(key).map_err(|e| key_problem(&e))?,
    ))
}

/// A duration in milliseconds from a request: `default` when absent; 400 `invalid_duration`
/// when zero or past `max`.
pub(crate) fn duration_ms(
    name: &str,
    value: Option<u64>,
    default: Duration,
    max: Duration,
) -> Result<Duration, Problem> {
    let Some(ms) = value else {
        return Ok(default);
    };
    let d = Duration::from_millis(ms);
    if ms == 0 || d > max {
        return Err(ProblemCode::InvalidDuration.problem(format!(
            "{name} must be between 1 and {} milliseconds.",
            max.as_millis()
        )));
    }
    Ok(d)
}

/// The lease as the API shows it: `"<fence>.<id>"`, one opaque token that `complete` and
/// `release` take back.
fn lease_token(lease: &Lease) -> String {
    format!("{}.{}", lease.fence, lease.id)
}

fn parse_lease(token: &str) -> Result<Lease, Problem> {
    let invalid = || {
        ProblemCode::InvalidLease
            .problem("lease must be the token returned by begin (as in \"3.9f86d081884c7d65…\").")
    };
    let (fence, id) = token.split_once('.').ok_or_else(invalid)?;
    Ok(Lease {
        id: LeaseId::parse(id).ok_or_else(invalid)?,
        fence: fence.parse().map_err(|_| invalid())?,
        // Stores match a lease by id and fence; its expiry is not part of its identity.
        expires_at: Timestamp::EPOCH,
    })
}

/// `POST /v1/records/begin`: exactly one of `fingerprint` and `request`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BeginBody {
    /// The namespace of the key: 1 to 128 ASCII letters, digits, `.`, `_`, `:` or `-`.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The idempotency key: 1 to 255 visible ASCII characters.
    #[schema(pattern = "^[!-~]{1,255}$")]
    key: String,
    /// A string that identifies the request (1 to 1024 bytes).
    fingerprint: Option<String>,
    /// The request as JSON, fingerprinted in canonical form (`null` is a request too).
    // `Some` whenever the member is present, even as `null` (a valid request to fingerprint).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Value)]
    request: Option<Box<RawValue>>,
    /// The lease, in milliseconds (1 to 86400000); the server's default without it.
    #[schema(minimum = 1, maximum = 86_400_000)]
    lease_ms: Option<u64>,
    /// How long the record is kept, in milliseconds (1 to 31536000000); the server's default
    /// without it.
    #[schema(minimum = 1, maximum = 31_536_000_000_u64)]
    ttl_ms: Option<u64>,
    /// Names of steps whose step keys to return with a lease (at most 64): the idempotency
    /// keys to send to the services those steps call, the same on every attempt.
    #[serde(default)]
    #[schema(max_items = 64, required = false)]
    step_keys: Vec<String>,
}

fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

pub(crate) async fn begin(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<BeginBody>,
) -> Result<Response, Problem> {
    let key = record_key(&caller, &body.namespace, &body.key)?;
    let fingerprint = match (&body.fingerprint, &body.request) {
        (Some(fp), None) if !fp.is_empty() && fp.len() <= MAX_FINGERPRINT_LEN => {
            Fingerprint::of_bytes(fp.as_bytes())
        }
        (Some(_), None) => {
            return Err(ProblemCode::InvalidFingerprint.problem(format!(
                "fingerprint must be 1 to {MAX_FINGERPRINT_LEN} bytes long."
            )));
        }
        // Read exactly: every number as written; a member named twice has no one meaning.
        (None, Some(request)) => Fingerprint::of_json_str(request.get()).map_err(|e| {
            ProblemCode::MalformedJson.problem(match e {
                idem_core::json::JsonError::DuplicateMember { .. } => {
                    "`request` has an object that names one member twice, which servers read \
                     differently; send each member once."
                }
                _ => {
                    "`request` is JSON that cannot be fingerprinted exactly (a number's \
                      exponent longer than 15 digits, or nesting deeper than 128)."
                }
            })
        })?,
        _ => {
            return Err(Problem::invalid_request(
                "Give exactly one of `fingerprint` (a string that identifies the request) or \
                 `request` (the request as JSON, fingerprinted in canonical form).",
            ));
        }
    };
    let step_names = step_names(body.step_keys)?;
    let req = BeginRequest::new(key, fingerprint)
        .with_lease(duration_ms(
            "lease_ms",
            body.lease_ms,
            state.default_lease,
            MAX_LEASE,
        )?)
        .with_ttl(duration_ms(
            "ttl_ms",
            body.ttl_ms,
            state.default_ttl,
            MAX_TTL,
        )?);
    let now = state.clock.now();
    // Through the engine's claim, which is safe to drop: a client that hangs up while the
    // store takes the key does not leave it held for the whole lease (a key taken for a
    // caller who left is released). Problem::store logs a failure.
    let outcome = idem::claim::begin_waiting(&state.store, &*state.clock, &req, InFlight::Reject)
        .await
        .map_err(|e| Problem::store(&e))?;
    let name = outcome_name(&outcome);
    debug!(key = %req.key.log_tag(), outcome = name, "begin");
    let count = || metrics::counter!("idem_api_begins_total", "outcome" => name).increment(1);
    if !matches!(outcome, BeginOutcome::Acquired(_)) {
        count();
    }
    match outcome {
        BeginOutcome::Acquired(lease) => {
            // Counted once the caller is told: a lease given back is not an acquisition.
            let steps = resumed(&state, &req, lease).await?;
            count();
            let step_keys = (!step_names.is_empty()).then(|| {
                step_names
                    .iter()
                    .map(|n| (n.to_string(), step_key(&req.key, &req.fingerprint, n)))
                    .collect()
            });
            let body = Acquired::new(
                &lease,
                lease_token(&lease),
                &steps,
                &req.key,
                &req.fingerprint,
                step_keys,
            );
            Ok(Json(BeginAnswer::Acquired(body)).into_response())
        }
        BeginOutcome::Replay(replay) => {
            Ok(Json(BeginAnswer::Replay((&replay).into())).into_response())
        }
        BeginOutcome::InProgress { lease_expires_at } => Err(in_progress(lease_expires_at, now)),
        BeginOutcome::Mismatch => Err(ProblemCode::FingerprintMismatch.problem(
            "This key was used with a different request; use a new key for a new request.",
        )),
    }
}

/// 409 `in_progress`: another attempt holds the key until `until`.
fn in_progress(until: Timestamp, now: Timestamp) -> Problem {
    ProblemCode::InProgress
        .problem("Another attempt with this key is running; retry after it finishes.")
        .retry_after(until.saturating_since(now))
}

fn step_names(names: Vec<String>) -> Result<Vec<StepName>, Problem> {
    if names.len() > MAX_STEPS {
        return Err(Problem::invalid_request(format!(
            "step_keys names at most {MAX_STEPS} steps."
        )));
    }
    names
        .into_iter()
        .map(|n| StepName::new(n).map_err(|e| invalid_step(&e)))
        .collect()
}

fn invalid_step(e: &InvalidStep) -> Problem {
    match e {
        InvalidStep::Name => ProblemCode::InvalidStep.problem(format!("{e}.")),
        InvalidStep::TooLarge => ProblemCode::StepsFull.problem(format!("{e}.")),
    }
}

/// The steps recorded by earlier attempts of a key this attempt has just taken: none on the
/// lease that created the record, else read from the store.
///
/// A lease is granted before its steps are read: if the read fails, or the caller leaves
/// while it runs, the key is given back (as a claim whose caller left is), so that nobody
/// waits out a lease held for a caller who never learnt of it.
async fn resumed(state: &AppState, req: &BeginRequest, lease: Lease) -> Result<Vec<Step>, Problem> {
    if !lease.may_resume() {
        return Ok(Vec::new());
    }
    let (store, key, now) = (&state.store, &req.key, state.clock.now());
    let give_back = {
        let (store, key) = (store.clone(), key.clone());
        // If this fails too, the key frees itself when the lease runs out.
        move || async move {
            let _ = settle_retrying(|| store.release(&key, &lease, now)).await;
        }
    };
    let read = {
        let (store, key) = (store.clone(), key.clone());
        async move { store.get(&key, now).await }
    };
    let orphan = give_back.clone();
    let read = finishing(read, move |_| orphan()).await;
    match read {
        Ok(Some(record)) if record.holds(&lease) => Ok(record.steps),
        // Taken over already (the lease was shorter than the way back from the store), or
        // deleted by an operator meanwhile.
        Ok(record) => Err(in_progress(record.map_or(now, |r| r.lease_expires_at), now)),
        Err(e) => {
            // In a task of its own: a client that hangs up now must not stop the release.
            let _ = tokio::spawn(give_back()).await;
            Err(Problem::store(&e))
        }
    }
}

/// Describes the record API's metrics.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "idem_api_begins_total",
        "Claims over the JSON API by outcome (acquired, replay, in_progress, mismatch)."
    );
}

fn outcome_name(o: &BeginOutcome) -> &'static str {
    match o {
        BeginOutcome::Acquired(_) => "acquired",
        BeginOutcome::Replay(_) => "replay",
        BeginOutcome::InProgress { .. } => "in_progress",
        BeginOutcome::Mismatch => "mismatch",
    }
}
/// `POST /v1/records/complete`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompleteBody {
    /// The namespace of the key.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The idempotency key.
    #[schema(pattern = "^[!-~]{1,255}$")]
    key: String,
    /// The lease token `begin` returned (`lease.id`).
    lease: String,
    /// The response to store: every retry gets it back, byte for byte.
    #[schema(value_type = Value)]
    response: Box<RawValue>,
}

/// `POST /v1/records/release`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RecordReleaseBody)]
pub(crate) struct ReleaseBody {
    /// The namespace of the key.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The idempotency key.
    #[schema(pattern = "^[!-~]{1,255}$")]
    key: String,
    /// The lease token `begin` returned (`lease.id`).
    lease: String,
}

/// `POST /v1/records/renew`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RecordRenewBody)]
pub(crate) struct RenewBody {
    /// The namespace of the key.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The idempotency key.
    #[schema(pattern = "^[!-~]{1,255}$")]
    key: String,
    /// The lease token `begin` returned (`lease.id`).
    lease: String,
    /// The lease's new length from now, in milliseconds (1 to 86400000); the server's default
    /// lease without it.
    #[schema(minimum = 1, maximum = 86_400_000)]
    lease_ms: Option<u64>,
}

/// `POST /v1/records/step`: exactly one of `output` and `"unknown": true`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct StepBody {
    /// The namespace of the key.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The idempotency key.
    #[schema(pattern = "^[!-~]{1,255}$")]
    key: String,
    /// The lease token `begin` returned (`lease.id`).
    lease: String,
    /// The step's name: 1 to 64 ASCII letters, digits, `.`, `_`, `-` or `:`, unique within
    /// the record.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,64}$")]
    step: String,
    /// The finished step's output (any JSON, `null` too), handed back to an attempt that
    /// resumes after this one.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Value)]
    output: Option<Value>,
    /// `true` instead of `output`: the step sent a request and got no answer, so its effect
    /// may or may not have happened. The next attempt runs it again under its step key.
    #[serde(default)]
    unknown: bool,
}

/// Records a finished step (or one whose outcome is unknown) under the lease.
pub(crate) async fn step(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<StepBody>,
) -> Result<Response, Problem> {
    let key = record_key(&caller, &body.namespace, &body.key)?;
    let lease = parse_lease(&body.lease)?;
    let name = StepName::new(body.step).map_err(|e| invalid_step(&e))?;
    let step = match (body.output, body.unknown) {
        (Some(output), false) => {
            let output = serde_json::to_vec(&output).unwrap_or_default();
            Step::done(name, output).map_err(|e| invalid_step(&e))?
        }
        (None, true) => Step::unknown(name),
        _ => {
            return Err(Problem::invalid_request(
                "Give exactly one of `output` (the finished step's output, as JSON) or \
                 `\"unknown\": true` (the step sent a request and got no answer).",
            ));
        }
    };
    state
        .store
        .record_step(&key, &lease, &step, state.clock.now())
        .await
        .map_err(|e| step_problem(&e, &key))?;
    debug!(key = %key.log_tag(), step = %step.name, "step recorded");
    Ok(Json(StepRecorded::new(&step, lease.fence)).into_response())
}

fn step_problem(e: &StepError, key: &Key) -> Problem {
    let refused = match e {
        StepError::Refused(refused) => refused,
        StepError::Store(e) => return Problem::store(e),
        other => {
            warn!(key = %key.log_tag(), error = %other, "step not recorded");
            return ProblemCode::StoreError.problem(other.to_string());
        }
    };
    match refused {
        StepRefused::Stale(_) => stale_lease(),
        StepRefused::Conflict(_) => ProblemCode::StepConflict
            .problem(format!("{refused}; the first stays. Nothing was changed.")),
        StepRefused::AfterUnknown(_) => ProblemCode::StepAfterUnknown.problem(format!(
            "{refused}: run it again under its step key and record its output. Nothing was \
             changed."
        )),
        StepRefused::Full => ProblemCode::StepsFull.problem(format!("{refused}.")),
        other => ProblemCode::StoreError.problem(other.to_string()),
    }
}

fn stale_lease() -> Problem {
    ProblemCode::StaleLease.problem(
        "This lease no longer holds the record: another attempt took it over, or the record \
         was released, forgotten, or completed with another response. Nothing was changed.",
    )
}

fn lease_problem(e: &LeaseError, key: &Key, op: &str) -> Problem {
    match e {
        LeaseError::Stale(_) => stale_lease(),
        LeaseError::Store(e) => Problem::store(e),
        other => {
            warn!(key = %key.log_tag(), error = %other, "record not {op}");
            ProblemCode::StoreError.problem(other.to_string())
        }
    }
}

/// Extends the lease of long work, so that no other attempt takes the key over while it runs.
pub(crate) async fn renew(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<RenewBody>,
) -> Result<Response, Problem> {
    let key = record_key(&caller, &body.namespace, &body.key)?;
    let lease = parse_lease(&body.lease)?;
    let length = duration_ms("lease_ms", body.lease_ms, state.default_lease, MAX_LEASE)?;
    let renewed = state
        .store
        .renew(&key, &lease, length, state.clock.now())
        .await
        .map_err(|e| lease_problem(&e, &key, "renewed"))?;
    debug!(key = %key.log_tag(), fence = renewed.fence, "renewed");
    Ok(Json(Renewed::new(&renewed, lease_token(&renewed))).into_response())
}

pub(crate) async fn complete(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<CompleteBody>,
) -> Result<Response, Problem> {
    let response = Bytes::copy_from_slice(body.response.get().as_bytes());
    settle(
        &state,
        &caller,
        &body.namespace,
        &body.key,
        &body.lease,
        Some(response),
    )
    .await
}

pub(crate) async fn release(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<ReleaseBody>,
) -> Result<Response, Problem> {
    settle(
        &state,
        &caller,
        &body.namespace,
        &body.key,
        &body.lease,
        None,
    )
    .await
}

/// Completes the record with `response`, or releases it when there is none.
async fn settle(
    state: &AppState,
    caller: &Caller,
    namespace: &str,
    client_key: &str,
    lease: &str,
    response: Option<Bytes>,
) -> Result<Response, Problem> {
    let key = record_key(caller, namespace, client_key)?;
    let lease = parse_lease(lease)?;
    let now = state.clock.now();
    let (op, result, answer) = match response {
        Some(response) => (
            "completed",
            state.store.complete(&key, &lease, response, now).await,
            Settled::completed(lease.fence),
        ),
        None => (
            "released",
            state.store.release(&key, &lease, now).await,
            Settled::released(lease.fence),
        ),
    };
    result.map_err(|e| lease_problem(&e, &key, op))?;
    debug!(key = %key.log_tag(), "{op}");
    Ok(Json(answer).into_response())
}

pub(crate) async fn get(
    State(state): State<AppState>,
    caller: Caller,
    PathParams((namespace, client_key)): PathParams<(String, String)>,
) -> Result<Response, Problem> {
    let key = record_key(&caller, &namespace, &client_key)?;
    let record = state
        .store
        .get(&key, state.clock.now())
        .await
        .map_err(|e| Problem::store(&e))?
        .ok_or_else(|| Problem::not_found("There is no live record with this key."))?;
    Ok(Json(RecordView::from(&record)).into_response())
}

/// `GET /healthz`: each component's health (see [`idem_ops::health`]); 503 if the store fails.
pub(crate) async fn health(State(state): State<AppState>) -> Response {
    let components = state.components();
    state.health.check(&components).await.into_response()
}
