//! The tower layer and its service.

use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use idem::claim::{begin_waiting, settle_retrying};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use idem_core::{
    BeginOutcome, BeginRequest, BoxFuture, ClientKey, Clock, Fingerprint, Key, Lease, SharedStore,
    Store, SystemClock,
};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{BoxError, Collected, Prefixed, ResponseBody, boxed, collect_limited};
use crate::header::{IDEMPOTENT_REPLAYED, KeyHeaderError, key_from_headers};
use crate::policy::{KeyRequirement, OnUnknown, Policy, ReplayHeaders, remove_hop_by_hop};
use crate::problem::Problem;
use crate::scope::ScopeSource;
use crate::stored::Stored;

/// How a handler's answer settles its record. By default the layer decides from the status
/// and the [`Preset`](crate::Preset); a handler (or a proxy) that knows better puts one of
/// these in the response's extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settle {
    /// Store the answer and replay it to every retry.
    Store,
    /// Do not store it: release the key so that a retry runs again (nothing took effect).
    Release,
    /// The request may or may not have taken effect: record the outcome as unknown (see
    /// [`OnUnknown`]).
    Unknown,
}

/// Put in the extensions of every guarded request that reaches the handler: the fence of
/// its lease, strictly greater than that of any earlier attempt with the same key, for
/// fenced writes downstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guarded {
    /// The lease's fence.
    pub fence: u64,
}

#[derive(Clone)]
struct Config {
    store: SharedStore,
    clock: Arc<dyn Clock>,
    policy: Policy,
    scope: ScopeSource,
}

/// A [`Layer`] that gives a route `Idempotency-Key` semantics.
///
/// ```no_run
/// use std::sync::Arc;
/// use axum::{Router, routing::post};
/// use idem_http::{IdempotencyLayer, KeyRequirement, Policy};
///
/// let store = Arc::new(idem_store::MemoryStore::new());
/// let app: Router = Router::new().route(
///     "/orders",
///     post(|| async { "created" })
///         .layer(IdempotencyLayer::new(store, Policy::default().key(KeyRequirement::Required))),
/// );
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    cfg: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer over `store` with `policy`, scoping keys by the hashed `Authorization` header.
    pub fn new(store: SharedStore, policy: Policy) -> Self {
        Self {
            cfg: Arc::new(Config {
                store,
                clock: Arc::new(SystemClock),
                policy,
                scope: ScopeSource::default(),
            }),
        }
    }

    /// Where each request's scope comes from.
    #[must_use]
    pub fn scope(mut self, source: ScopeSource) -> Self {
        Arc::make_mut(&mut self.cfg).scope = source;
        self
    }

    /// The clock for leases and expiry (the system clock by default).
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        Arc::make_mut(&mut self.cfg).clock = Arc::new(clock);
        self
    }

    /// The route's policy.
    pub fn policy(&self) -> &Policy {
        &self.cfg.policy
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around a handler.
///
/// The request body type must be constructible from [`Bytes`] (axum's `Body` and
/// `Full<Bytes>` are): a guarded request's body is read, fingerprinted, and handed on whole.
#[derive(Clone)]
pub struct Idempotent<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotent<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone that was made ready is the one that handles this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        if !cfg.policy.guards(req.method()) {
            let fut = pass_through(inner, req);
            return Box::pin(fut);
        }
        Box::pin(guarded(cfg, inner, req))
    }
}

async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    count("passed_through");
    Ok(inner.call(req).await?.map(boxed))
}

/// Registers the help text of the layer's metrics with the installed `metrics` recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "idem_http_requests_total",
        "Guarded-route requests by what the layer did: passed_through, executed, replayed, or the problem code."
    );
    metrics::describe_counter!(
        "idem_http_settled_total",
        "Records settled after the handler ran: stored, released, unknown, too_large, failed."
    );
}

/// Counts a request by what the layer did with it: `passed_through`, `executed`,
/// `replayed`, or the code of the problem it answered with.
fn count(outcome: &'static str) {
    metrics::counter!("idem_http_requests_total", "outcome" => outcome).increment(1);
}

/// Counts how records were settled, once each: `stored`, `released`, `unknown`,
/// `too_large`, or `failed` when the store could not be told.
fn count_settled(result: &'static str) {
    metrics::counter!("idem_http_settled_total", "result" => result).increment(1);
}

fn reject(problem: Problem) -> Response<ResponseBody> {
    count(problem.code());
    problem.into_http::<Full<Bytes>>().map(boxed)
}

async fn guarded<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let policy = &cfg.policy;
    let client_key = match key_from_headers(req.headers()) {
        Ok(Some(k)) => k,
        Ok(None) if policy.key == KeyRequirement::Optional => {
            return pass_through(inner, req).await;
        }
        Ok(None) => return Ok(reject(problems::missing_key())),
        Err(e) => return Ok(reject(problems::invalid_key(e))),
    };
    let (parts, body) = req.into_parts();
    let key = match ClientKey::new(client_key) {
        Ok(ck) => Key::new(cfg.scope.scope_of(&parts), policy.namespace.clone(), ck),
        Err(_) => return Ok(reject(problems::invalid_key(KeyHeaderError::Malformed))),
    };
    let body = match read_body(&parts.headers, body, policy.max_body).await {
        Ok(b) => b,
        Err(p) => return Ok(reject(p)),
    };
    let begin = BeginRequest::new(key, fingerprint(policy, &parts, &body))
        .with_lease(policy.lease)
        .with_ttl(policy.ttl);
    // Claiming the key and running the handler happen in a task of its own: a client that
    // hangs up cancels neither half way. The work does not stop half done, and its answer is
    // stored for the client's retry. (A claim dropped on its own would leave nothing held:
    // `begin_waiting` gives back a key taken for a caller that left.)
    let task = tokio::spawn(async move {
        let lease = match claim(&cfg, &begin).await {
            Ok(lease) => lease,
            Err(answer) => return Ok(answer),
        };
        let mut req = Request::from_parts(parts, ReqBody::from(body));
        req.extensions_mut().insert(Guarded { fence: lease.fence });
        run_and_settle(cfg, inner, req, begin.key, lease).await
    });
    match task.await {
        Ok(result) => result,
        // The handler panicked; the settler released the key as it unwound.
        Err(_) => Ok(reject(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler_failed",
            "Handler failed",
            "The handler failed before answering; the key was released, so a retry runs again.",
        ))),
    }
}

/// Reads a guarded request's body, refusing one over `max` before reading it if its length
/// is declared.
async fn read_body<B>(headers: &HeaderMap, body: B, max: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(problems::too_large(max));
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(problems::too_large(max)),
        Err(_) => Err(
            Problem::invalid_request("The request body could not be read to its end.")
                .with_code("request_body_unreadable"),
        ),
    }
}

/// Method, path, query, the selected headers, and the body: canonical JSON when it is JSON
/// (so key order and spacing do not matter), only the selected fields if the policy names
/// some, the raw bytes otherwise.
fn fingerprint(policy: &Policy, parts: &http::request::Parts, body: &Bytes) -> Fingerprint {
    let mut fp = Fingerprint::builder()
        .part(b"idem-http/2")
        .part(parts.method.as_str().as_bytes())
        .part(parts.uri.path().as_bytes())
        .part(parts.uri.query().unwrap_or("").as_bytes());
    for name in &policy.fingerprint_headers {
        let values = parts.headers.get_all(name);
        // The count frames the values, so no split of values between headers collides.
        let count = values.iter().count() as u64;
        fp = fp.part(name.as_str().as_bytes()).part(&count.to_be_bytes());
        for value in values {
            fp = fp.part(value.as_bytes());
        }
    }
    let json = parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|ct| is_json(ct.as_bytes()))
        .then(|| serde_json::from_slice::<serde_json::Value>(body).ok())
        .flatten();
    fp = match (json, &policy.fingerprint_json_fields) {
        (Some(v), Some(fields)) => {
            let pointers: Vec<&str> = fields.iter().map(String::as_str).collect();
            fp.part(b"json-fields").part(
                Fingerprint::of_json_fields(&v, &pointers)
                    .to_hex()
                    .as_bytes(),
            )
        }
        (Some(v), None) => fp.part(b"json").json(&v),
        (None, _) => fp.part(b"bytes").part(body),
    };
    fp.finish()
}

/// `application/json`, or any `+json` type, with or without parameters.
pub(crate) fn is_json(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    essence.eq_ignore_ascii_case(b"application/json")
        || essence.len() >= 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json")
}

/// Begins the record: `Ok(lease)` to run the handler, `Err(answer)` for anything else.
async fn claim(cfg: &Config, begin: &BeginRequest) -> Result<Lease, Response<ResponseBody>> {
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
            BeginOutcome::Mismatch => return Err(reject(problems::mismatch(policy))),
            BeginOutcome::InProgress { lease_expires_at } => {
                return Err(reject(problems::in_progress(
                    lease_expires_at.saturating_since(now),
                )));
            }
            BeginOutcome::Replay(r) => r,
        };
        match Stored::decode(r.response).map_err(|_| reject(problems::corrupt()))? {
            Stored::Response {
                status,
                headers,
                body,
            } => return Err(replay(status, headers, body)),
            Stored::TooLarge { status } => {
                return Err(reject(problems::not_replayable(status)));
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
                return Err(reject(problems::unknown(
                    until.map(|u| u.saturating_since(now)),
                )));
            }
        }
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

/// Runs the handler and settles the record by what it answered.
async fn run_and_settle<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    mut inner: S,
    req: Request<ReqBody>,
    key: Key,
    lease: Lease,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let settler = Settler {
        cfg: cfg.clone(),
        key,
        lease,
        settled: false,
    };
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    let res = match inner.call(req).await {
        Ok(res) => res,
        Err(e) => {
            settler.release().await;
            return Err(e);
        }
    };
    let policy = &cfg.policy;
    let (parts, body) = res.into_parts();
    let settle = parts
        .extensions
        .get::<Settle>()
        .copied()
        .unwrap_or_else(|| {
            if policy.preset.stores(parts.status) {
                Settle::Store
            } else {
                Settle::Release
            }
        });
    let body = boxed(body);
    match settle {
        Settle::Release => {
            settler.release().await;
            Ok(Response::from_parts(parts, body))
        }
        Settle::Unknown => {
            settler.unknown().await;
            Ok(Response::from_parts(parts, body))
        }
        Settle::Store => match collect_limited(body, policy.max_response).await {
            Collected::Full(bytes) => {
                let stored = Stored::Response {
                    status: parts.status,
                    headers: stored_headers(&parts.headers, &policy.replay_headers),
                    body: bytes.clone(),
                };
                settler.complete(stored).await;
                Ok(Response::from_parts(parts, boxed(Full::new(bytes))))
            }
            Collected::TooLarge(prefix, rest) => {
                let status = parts.status;
                settler.complete(Stored::TooLarge { status }).await;
                Ok(Response::from_parts(
                    parts,
                    boxed(Prefixed::new(prefix, rest)),
                ))
            }
            Collected::Failed => {
                settler.unknown().await;
                Ok(reject(problems::response_failed()))
            }
        },
    }
}

/// The response headers kept for replay: the policy's choice, never a hop-by-hop field.
fn stored_headers(headers: &HeaderMap, keep: &ReplayHeaders) -> HeaderMap {
    let mut out = headers.clone();
    remove_hop_by_hop(&mut out);
    let dropped: Vec<HeaderName> = out.keys().filter(|n| !keep.keeps(n)).cloned().collect();
    for name in dropped {
        out.remove(name);
    }
    out
}

/// Settles a record once. If dropped unsettled (the handler panicked), releases the key from
/// a task of its own.
struct Settler {
    cfg: Arc<Config>,
    key: Key,
    lease: Lease,
    settled: bool,
}

impl Settler {
    async fn complete(mut self, stored: Stored) {
        self.settled = true;
        let kind = match stored {
            Stored::Response { .. } => "stored",
            Stored::Unknown { .. } => "unknown",
            Stored::TooLarge { .. } => "too_large",
        };
        let response = stored.encode();
        let (cfg, key, lease) = (&self.cfg, &self.key, &self.lease);
        let result = settle_retrying(|| {
            cfg.store
                .complete(key, lease, response.clone(), cfg.clock.now())
        })
        .await;
        match result {
            Ok(()) => count_settled(kind),
            Err(e) => {
                count_settled("failed");
                // The answer still goes to the caller; the record stays in progress until
                // its lease ends, after which a retry may run again.
                tracing::warn!(key = %key.log_tag(), error = %e, "could not store the answer");
            }
        }
    }

    async fn unknown(self) {
        let until = match self.cfg.policy.on_unknown {
            OnUnknown::Hold => None,
            OnUnknown::ReleaseAfterLease => Some(self.lease.expires_at),
        };
        // Scope and namespace (never the client's key) let an operator find the record
        // (`records::reopen_unknown`) once the caller reports its key.
        tracing::warn!(
            key = %self.key.log_tag(),
            scope = %self.cfg.scope.log_form(self.key.scope()),
            namespace = %self.key.namespace(),
            fence = self.lease.fence,
            "outcome unknown; held until resolved"
        );
        self.complete(Stored::Unknown { until }).await;
    }

    async fn release(mut self) {
        self.settled = true;
        release(&self.cfg, &self.key, &self.lease).await;
    }
}

async fn release(cfg: &Config, key: &Key, lease: &Lease) {
    let result = settle_retrying(|| cfg.store.release(key, lease, cfg.clock.now())).await;
    match result {
        Ok(()) => count_settled("released"),
        Err(e) => {
            count_settled("failed");
            // The key stays held until the lease ends; then a retry takes over.
            tracing::warn!(key = %key.log_tag(), error = %e, "could not release the key");
        }
    }
}

impl Drop for Settler {
    fn drop(&mut self) {
        if !self.settled {
            let (cfg, key, lease) = (self.cfg.clone(), self.key.clone(), self.lease);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { release(&cfg, &key, &lease).await });
            }
        }
    }
}

/// The problems the layer answers with; each code is stable.
mod problems {
    use super::*;

    pub(super) fn missing_key() -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            "Idempotency-Key required",
            "This route requires an Idempotency-Key header.",
        )
    }

    pub(super) fn invalid_key(e: KeyHeaderError) -> Problem {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency_key_invalid",
            "Invalid Idempotency-Key",
            e.to_string(),
        )
    }

    pub(super) fn too_large(max: usize) -> Problem {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "Request body too large",
            format!("The request body exceeds the limit of {max} bytes."),
        )
        .with("max_body", max)
    }

    pub(super) fn mismatch(policy: &Policy) -> Problem {
        Problem::new(
            policy.preset.mismatch_status(),
            "idempotency_key_mismatch",
            "Idempotency-Key reused",
            "This Idempotency-Key was used with a different request (method, path, query or \
             body); use a new key for a new request.",
        )
    }

    pub(super) fn in_progress(retry_after: Duration) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "request_in_progress",
            "Request in progress",
            "A request with this Idempotency-Key is still being processed; retry later.",
        )
        .retry_after(retry_after)
    }

    pub(super) fn unknown(retry_after: Option<Duration>) -> Problem {
        let p = Problem::new(
            StatusCode::CONFLICT,
            "outcome_unknown",
            "Outcome unknown",
            "An earlier request with this Idempotency-Key may or may not have taken effect \
             (its upstream did not answer); it is not run again until the outcome is resolved.",
        );
        match retry_after {
            Some(d) => p.retry_after(d),
            None => p,
        }
    }

    pub(super) fn not_replayable(status: StatusCode) -> Problem {
        Problem::new(
            StatusCode::CONFLICT,
            "response_not_replayable",
            "Response not replayable",
            "The request with this Idempotency-Key was processed, but its response was too \
             large to store; it is not run again.",
        )
        .with("original_status", status.as_u16())
    }

    pub(super) fn response_failed() -> Problem {
        Problem::new(
            StatusCode::BAD_GATEWAY,
            "response_failed",
            "Response failed",
            "The handler's response broke off; the outcome is recorded as unknown.",
        )
    }

    pub(super) fn corrupt() -> Problem {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "record_corrupt",
            "Stored record unreadable",
            "The stored answer for this Idempotency-Key could not be read.",
        )
    }
}
