//! The same rules for gRPC: a [`Layer`] for tonic servers (feature `grpc`).
//!
//! A gRPC call is an HTTP/2 POST to `/<package>.<Service>/<Method>` whose body is the request
//! message (a 5-byte frame head, then the message) and whose answer ends with trailers holding
//! `grpc-status`. So the layer is the HTTP layer's claim, settle and replay, with four
//! differences:
//!
//! - **Which calls.** Only the methods listed ([`GrpcIdempotencyLayer::method`],
//!   [`GrpcIdempotencyLayer::service`]) are guarded; every other call passes through, but for
//!   another spelling of a listed one (letter case, percent-encoded bytes), which a server
//!   that does not match paths exactly could run around the guard: it is refused with
//!   `INVALID_ARGUMENT` (`ambiguous_path`). List
//!   unary methods (server-streaming ones work too: the whole answer stream is kept and
//!   replayed). A guarded call whose body is not exactly one message is refused with
//!   `INVALID_ARGUMENT`: client-streaming and bidirectional methods cannot be guarded.
//! - **The key** is the `idempotency-key` request metadata (the name is configurable), or
//!   else what [`GrpcIdempotencyLayer::key_from_message`] reads from the request message
//!   (a `request_id` field, as Google's API design guide asks for).
//! - **Refusals** are gRPC statuses, trailers-only, with the problem's detail as the message
//!   and `google.rpc.ErrorInfo` (reason: the catalogue code, domain `idem`) and, when there is
//!   a delay to wait, `google.rpc.RetryInfo` in `grpc-status-details-bin`:
//!   see [`grpc_code`] for the mapping.
//! - **What is kept** is decided by the answer's `grpc-status` ([`stores`]), not by the
//!   [`Preset`](crate::Preset): `OK` and the statuses that say the request itself was at
//!   fault are kept and replayed with their trailers; the ones that say it may succeed if
//!   sent again (`UNAVAILABLE`, `ABORTED`, `INTERNAL`, …) release the key.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Body;
use idem_core::{BeginRequest, BoxFuture, ClientKey, Clock, Key, SharedStore};
use tonic::Code;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{BoxError, ResponseBody, boxed, read_body};
use crate::claim::reject;
use crate::config::{Config, Protocol};
use crate::fingerprint::grpc_fingerprint;
use crate::header::{IDEMPOTENCY_KEY, KeyHeaderError, parse_key};
use crate::metrics::count;
use crate::policy::{KeyRequirement, Policy};
use crate::problem::{Problem, ToProblem};
use crate::scope::ScopeSource;
use crate::service::{claim_and_run, invalid_key};
use crate::settle::Settle;
use idem_wire::ProblemCode;

/// Reads a key from a request message's bytes (uncompressed, without the frame head): for
/// example `|m| Transfer::decode(m).ok().map(|t| t.request_id)`. `None`: the message has none.
pub type KeyFromMessage = Arc<dyn Fn(&[u8]) -> Option<String> + Send + Sync>;

/// A [`Layer`] that gives the listed methods of a tonic server idempotency keys, with the
/// rules of the HTTP layer ([`IdempotencyLayer`](crate::IdempotencyLayer)).
///
/// ```no_run
/// use std::sync::Arc;
/// use idem_http::{GrpcIdempotencyLayer, KeyRequirement, Policy};
///
/// let store = Arc::new(idem_store::MemoryStore::new());
/// let layer = GrpcIdempotencyLayer::new(store, Policy::default().key(KeyRequirement::Required))
///     .method("/bank.v1.Bank/Transfer");
/// // tonic::transport::Server::builder().layer(layer).add_service(…)
/// ```
///
/// The policy's `methods`, `preset` and `fingerprint_json_fields` are HTTP's and not used
/// here; the rest (key requirement, namespace, TTL, lease, in-flight waiting, body and answer
/// limits, fingerprinted metadata, what an unknown outcome answers) is. Keys are scoped to the
/// caller by [`ScopeSource`], read from the request metadata as the HTTP layer reads headers.
#[derive(Clone)]
pub struct GrpcIdempotencyLayer {
    cfg: Arc<Config>,
    grpc: Arc<Grpc>,
}

/// What only the gRPC layer has: which calls it guards and where their key is.
#[derive(Clone)]
struct Grpc {
    /// Full method paths (`/pkg.Service/Method`) and whole services (`/pkg.Service/`).
    methods: Vec<String>,
    key_metadata: HeaderName,
    key_from_message: Option<KeyFromMessage>,
}

impl Grpc {
    fn guards(&self, path: &str) -> bool {
        self.methods.iter().any(|m| listed(m, path, str::eq))
    }

    /// Whether `path`, not guarded itself, is another spelling of a guarded method: the same
    /// but for letter case, or for percent-encoded bytes (`/bank.v1.Bank/%54ransfer`). gRPC
    /// matches paths exactly, but a hand-written or generic server may not, and would run the
    /// method around the guard.
    fn spells_guarded(&self, path: &str) -> bool {
        // Borrowed, not copied, when nothing is encoded.
        let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
        self.methods
            .iter()
            .any(|m| listed(m, &decoded, str::eq_ignore_ascii_case))
    }
}

/// Whether `path` is the listed method `m`, or a method of the listed service `m`
/// (`/pkg.Service/`), comparing by `same`.
fn listed(m: &str, path: &str, same: fn(&str, &str) -> bool) -> bool {
    match m.strip_suffix('/') {
        Some(_) => {
            path.get(..m.len()).is_some_and(|head| same(head, m)) && {
                let rest = &path[m.len()..];
                !rest.is_empty() && !rest.contains('/')
            }
        }
        None => same(path, m),
    }
}

impl GrpcIdempotencyLayer {
    /// A layer over `store` with `policy` that guards nothing until methods are listed.
    pub fn new(store: SharedStore, policy: Policy) -> Self {
        Self {
            cfg: Config::new(Protocol::Grpc, store, policy),
            grpc: Arc::new(Grpc {
                methods: Vec::new(),
                key_metadata: IDEMPOTENCY_KEY,
                key_from_message: None,
            }),
        }
    }

    /// Guards the method at `path`: `/<package>.<Service>/<Method>`, as in the request's
    /// `:path` (`/bank.v1.Bank/Transfer`).
    #[must_use]
    pub fn method(mut self, path: impl Into<String>) -> Self {
        self.grpc_mut().methods.push(path.into());
        self
    }

    /// Guards every method of a service: `<package>.<Service>` (`bank.v1.Bank`). Only for a
    /// service whose methods all take one request message.
    #[must_use]
    pub fn service(mut self, name: &str) -> Self {
        self.grpc_mut().methods.push(format!("/{name}/"));
        self
    }

    /// The request metadata that carries the key (`idempotency-key` by default).
    #[must_use]
    pub fn key_metadata(mut self, name: HeaderName) -> Self {
        self.grpc_mut().key_metadata = name;
        self
    }

    /// Reads the key from the request message when the metadata has none. A compressed
    /// message is not read (its key must come in the metadata).
    #[must_use]
    pub fn key_from_message(
        mut self,
        read: impl Fn(&[u8]) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.grpc_mut().key_from_message = Some(Arc::new(read));
        self
    }

    /// Where each call's scope comes from (the hashed `authorization` metadata by default).
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

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.cfg.policy
    }

    fn grpc_mut(&mut self) -> &mut Grpc {
        Arc::make_mut(&mut self.grpc)
    }
}

impl<S> Layer<S> for GrpcIdempotencyLayer {
    type Service = GrpcIdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcIdempotencyService {
            inner,
            cfg: self.cfg.clone(),
            grpc: self.grpc.clone(),
        }
    }
}

/// The service [`GrpcIdempotencyLayer`] wraps around a tonic server (or one of its services).
/// The inner service takes tonic's request body; a guarded call's is read whole (within the
/// policy's `max_body`), fingerprinted, and handed on.
#[derive(Clone)]
pub struct GrpcIdempotencyService<S> {
    inner: S,
    cfg: Arc<Config>,
    grpc: Arc<Grpc>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for GrpcIdempotencyService<S>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
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
        let req = req.map(tonic::body::Body::new);
        let path = req.uri().path();
        if !self.grpc.guards(path) {
            if self.grpc.spells_guarded(path) {
                let refused = reject(
                    &self.cfg,
                    ProblemCode::AmbiguousPath.problem(
                        "The method is a guarded one spelled otherwise (letter case, or \
                         percent-encoded bytes); call it by its exact path.",
                    ),
                );
                return Box::pin(std::future::ready(Ok(refused)));
            }
            return Box::pin(pass_through(inner, req));
        }
        Box::pin(guarded(self.cfg.clone(), self.grpc.clone(), inner, req))
    }
}

async fn pass_through<S, ResBody>(
    mut inner: S,
    req: Request<tonic::body::Body>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    count("passed_through");
    Ok(inner.call(req).await?.map(boxed))
}

async fn guarded<S, ResBody>(
    cfg: Arc<Config>,
    grpc: Arc<Grpc>,
    inner: S,
    req: Request<tonic::body::Body>,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let policy = &cfg.policy;
    // tonic serves any content type; a guarded method must not be reachable around the
    // guard by another one (gRPC-Web keeps its status in the body, where the layer would
    // not find it).
    if !is_grpc(req.headers()) {
        return Ok(reject(
            &cfg,
            Problem::invalid_request(
                "A guarded method takes gRPC (`content-type: application/grpc`); gRPC-Web \
                 must be turned into gRPC before it reaches the layer.",
            ),
        ));
    }
    let (parts, body) = req.into_parts();
    let body = match read_body(&parts.headers, body, policy.max_body).await {
        Ok(b) => b,
        Err(p) => return Ok(reject(&cfg, p)),
    };
    let Some((compressed, message)) = one_message(&body) else {
        return Ok(reject(
            &cfg,
            Problem::invalid_request(
                "A guarded method takes exactly one request message; client-streaming and \
                 bidirectional methods cannot be guarded.",
            ),
        ));
    };
    let client_key = match key_of(&grpc, &parts.headers, compressed, message) {
        Ok(Some(k)) => k,
        Ok(None) if policy.key == KeyRequirement::Optional => {
            let req = Request::from_parts(parts, tonic::body::Body::new(full(body)));
            return pass_through(inner, req).await;
        }
        Ok(None) => {
            return Ok(reject(
                &cfg,
                ProblemCode::IdempotencyKeyMissing.problem(format!(
                    "This method requires an idempotency key in the `{}` metadata.",
                    grpc.key_metadata
                )),
            ));
        }
        Err(e) => return Ok(reject(&cfg, invalid_key(&e))),
    };
    let key = match ClientKey::new(client_key) {
        Ok(ck) => Key::new(cfg.scope.scope_of(&parts), policy.namespace.clone(), ck),
        Err(_) => return Ok(reject(&cfg, invalid_key(&KeyHeaderError::Malformed))),
    };
    let begin = BeginRequest::new(key, grpc_fingerprint(policy, &parts, &body))
        .with_lease(policy.lease)
        .with_ttl(policy.ttl);
    let req = Request::from_parts(parts, tonic::body::Body::new(full(body)));
    claim_and_run(cfg, inner, req, begin).await
}

fn full(body: Bytes) -> http_body_util::Full<Bytes> {
    http_body_util::Full::new(body)
}

/// The call's key: from the metadata, else from the message (if it is not compressed).
fn key_of(
    grpc: &Grpc,
    metadata: &HeaderMap,
    compressed: bool,
    message: &[u8],
) -> Result<Option<String>, KeyHeaderError> {
    let mut values = metadata.get_all(&grpc.key_metadata).iter();
    if let Some(first) = values.next() {
        if values.next().is_some() {
            return Err(KeyHeaderError::Repeated);
        }
        return parse_key(first.as_bytes()).map(Some);
    }
    match &grpc.key_from_message {
        // Its key cannot be read: refused rather than passed through unguarded.
        Some(_) if compressed => Err(KeyHeaderError::Malformed),
        Some(read) => Ok(read(message)),
        None => Ok(None),
    }
}

/// `application/grpc`, or `application/grpc+<codec>`, in any letter case (not gRPC-Web,
/// whose trailers are in its body: put the layer inside `tonic-web`'s, which turns it into
/// gRPC).
fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    headers.get(http::header::CONTENT_TYPE).is_some_and(|ct| {
        let ct = ct.as_bytes();
        ct.len() >= GRPC.len()
            && ct[..GRPC.len()].eq_ignore_ascii_case(GRPC)
            && matches!(ct.get(GRPC.len()), None | Some(b'+' | b';'))
    })
}

/// The one length-prefixed message of a request body: whether it is compressed, and its bytes.
/// `None` for no message, more than one, or a broken frame.
fn one_message(body: &Bytes) -> Option<(bool, &[u8])> {
    let mut head = body.get(..5)?;
    let compressed = head.get_u8() != 0;
    let len = usize::try_from(head.get_u32()).ok()?;
    let message = body.get(5..)?;
    (message.len() == len).then_some((compressed, message))
}

/// How a gRPC answer with this status settles its record: `OK` and the statuses that say the
/// request itself was at fault are kept (a retry would be refused the same way); those that
/// say it may succeed if sent again release the key.
///
/// Kept: `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`,
/// `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`, `UNAUTHENTICATED`. Released:
/// `CANCELLED`, `UNKNOWN`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`,
/// `UNAVAILABLE`, `DATA_LOSS`. A handler that knows better puts a [`Settle`] in the
/// response's extensions.
pub fn stores(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::Unauthenticated
    )
}

/// How an answer settles by the `grpc-status` among `fields` (`None` without one).
pub(crate) fn settle_by_status(fields: &HeaderMap) -> Option<Settle> {
    let code = Code::from_bytes(fields.get("grpc-status")?.as_bytes());
    Some(settle_by_code(code))
}

/// How an answer settles by the head alone: a trailers-only answer by its `grpc-status`; an
/// answer that is not HTTP 200 and has none (a plain HTTP answer from a layer inside this
/// one) by the code gRPC clients read from its HTTP status; `None` when the status is to come
/// in the trailers.
pub(crate) fn settle_by_head(status: StatusCode, headers: &HeaderMap) -> Option<Settle> {
    settle_by_status(headers)
        .or_else(|| (status != StatusCode::OK).then(|| settle_by_code(code_of_http(status))))
}

fn settle_by_code(code: Code) -> Settle {
    if stores(code) {
        Settle::Store
    } else {
        Settle::Release
    }
}

/// The code a gRPC client gives an answer with this HTTP status and no `grpc-status` (gRPC's
/// "HTTP to gRPC status code mapping").
fn code_of_http(status: StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

/// Whether a response field is kept for replay whatever the policy's `replay_headers` say:
/// without them a replay is not a gRPC answer.
pub(crate) fn always_kept(name: &HeaderName) -> bool {
    name == http::header::CONTENT_TYPE || name.as_str().starts_with("grpc-")
}

/// The gRPC status code of a problem: by its catalogue code where gRPC has a closer word than
/// the HTTP status, else by the HTTP status.
///
/// | problem | gRPC |
/// |---|---|
/// | `request_in_progress`, `stale_lease` | `ABORTED` (with RetryInfo) |
/// | `idempotency_key_mismatch`, `outcome_unknown`, `response_not_replayable` | `FAILED_PRECONDITION` |
/// | `idempotency_key_missing`, `idempotency_key_invalid`, `invalid_request` | `INVALID_ARGUMENT` |
/// | `body_too_large` | `RESOURCE_EXHAUSTED` |
/// | `store_unavailable`, `store_full`, `answer_not_stored` | `UNAVAILABLE` |
/// | `store_error`, `record_corrupt`, `handler_failed`, `response_failed` | `INTERNAL` |
pub fn grpc_code(code: &str, status: StatusCode) -> Code {
    use ProblemCode as P;
    match P::ALL.iter().copied().find(|c| c.as_str() == code) {
        Some(P::RequestInProgress | P::StaleLease) => return Code::Aborted,
        Some(P::IdempotencyKeyMismatch | P::OutcomeUnknown | P::ResponseNotReplayable) => {
            return Code::FailedPrecondition;
        }
        Some(P::BodyTooLarge) => return Code::ResourceExhausted,
        Some(P::StoreUnavailable | P::StoreFull | P::AnswerNotStored) => return Code::Unavailable,
        // Not one that passes by itself: a gRPC client retries UNAVAILABLE on its own.
        Some(P::StoreError) => return Code::Internal,
        _ => {}
    }
    match status.as_u16() {
        400 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        409 => Code::Aborted,
        412 | 422 => Code::FailedPrecondition,
        413 | 429 => Code::ResourceExhausted,
        501 => Code::Unimplemented,
        503 => Code::Unavailable,
        504 => Code::DeadlineExceeded,
        500..=599 => Code::Internal,
        _ => Code::Unknown,
    }
}

impl Problem {
    /// The problem as a gRPC status: the code by [`grpc_code`], the detail as the message, and
    /// `google.rpc.ErrorInfo` (reason: the problem's code, domain `idem`, and its extension
    /// members as metadata) and `google.rpc.RetryInfo` (if it has a retry delay) as details.
    pub fn into_grpc(self) -> tonic::Status {
        use tonic_types::{ErrorDetails, StatusExt};
        let metadata: std::collections::HashMap<String, String> = self
            .extra
            .iter()
            .map(|(name, value)| {
                let value = match value {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (name.clone(), value)
            })
            .collect();
        let mut details = ErrorDetails::with_error_info(self.code, "idem", metadata);
        if let Some(delay) = self.retry_after {
            details.set_retry_info(Some(delay));
        }
        tonic::Status::with_error_details(grpc_code(self.code, self.status), self.detail, details)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_reads_exactly_one_frame() {
        let frame = |flag: u8, m: &[u8]| {
            let mut b = vec![flag];
            b.extend_from_slice(&u32::try_from(m.len()).unwrap().to_be_bytes());
            b.extend_from_slice(m);
            b
        };
        let one = Bytes::from(frame(0, b"abc"));
        assert_eq!(one_message(&one), Some((false, &b"abc"[..])));
        let empty = Bytes::from(frame(1, b""));
        assert_eq!(one_message(&empty), Some((true, &b""[..])));
        let mut two = frame(0, b"a");
        two.extend(frame(0, b"b"));
        for bad in [
            Bytes::new(),
            Bytes::from_static(b"\0\0\0"),
            Bytes::from(two),
            Bytes::from(frame(0, b"abc")[..7].to_vec()),
        ] {
            assert_eq!(one_message(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn methods_and_services_are_matched_whole() {
        let grpc = Grpc {
            methods: vec!["/bank.Bank/Transfer".into(), "/shop.Orders/".into()],
            key_metadata: IDEMPOTENCY_KEY,
            key_from_message: None,
        };
        assert!(grpc.guards("/bank.Bank/Transfer"));
        assert!(grpc.guards("/shop.Orders/Create"));
        for path in [
            "/bank.Bank/TransferAll",
            "/bank.Bank/Balance",
            "/shop.Orders/",
            "/shop.Orders/a/b",
            "/shop.OrdersX/Create",
        ] {
            assert!(!grpc.guards(path), "{path}");
        }
    }

    #[test]
    fn only_grpc_content_types_are_guarded() {
        for (ct, yes) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("application/grpc;charset=utf-8", true),
            ("Application/gRPC", true),
            ("application/grpcx", false),
            ("application/grpc-web", false),
            ("application/grpc-web+proto", false),
            ("application/json", false),
        ] {
            let mut h = HeaderMap::new();
            h.insert(http::header::CONTENT_TYPE, ct.parse().unwrap());
            assert_eq!(is_grpc(&h), yes, "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn every_catalogue_code_the_layer_answers_has_a_grpc_code() {
        use ProblemCode as P;
        for (code, want) in [
            (P::RequestInProgress, Code::Aborted),
            (P::StaleLease, Code::Aborted),
            (P::IdempotencyKeyMismatch, Code::FailedPrecondition),
            (P::OutcomeUnknown, Code::FailedPrecondition),
            (P::ResponseNotReplayable, Code::FailedPrecondition),
            (P::IdempotencyKeyMissing, Code::InvalidArgument),
            (P::IdempotencyKeyInvalid, Code::InvalidArgument),
            (P::InvalidRequest, Code::InvalidArgument),
            (P::RequestBodyUnreadable, Code::InvalidArgument),
            (P::BodyTooLarge, Code::ResourceExhausted),
            (P::StoreUnavailable, Code::Unavailable),
            (P::StoreFull, Code::Unavailable),
            (P::AnswerNotStored, Code::Unavailable),
            (P::StoreError, Code::Internal),
            (P::RecordCorrupt, Code::Internal),
            (P::HandlerFailed, Code::Internal),
            (P::ResponseFailed, Code::Internal),
        ] {
            assert_eq!(grpc_code(code.as_str(), code.status()), want, "{code:?}");
        }
    }

    #[test]
    fn statuses_that_may_pass_release_the_key() {
        let kept = [
            Code::Ok,
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::FailedPrecondition,
            Code::OutOfRange,
            Code::Unimplemented,
            Code::Unauthenticated,
        ];
        for n in 0..=16 {
            let code = Code::from(n);
            assert_eq!(stores(code), kept.contains(&code), "{code:?}");
        }
        let mut h = HeaderMap::new();
        assert_eq!(settle_by_status(&h), None);
        h.insert("grpc-status", "14".parse().unwrap());
        assert_eq!(settle_by_status(&h), Some(Settle::Release));
        h.insert("grpc-status", "5".parse().unwrap());
        assert_eq!(settle_by_status(&h), Some(Settle::Store));
        h.insert("grpc-status", "x".parse().unwrap());
        assert_eq!(settle_by_status(&h), Some(Settle::Release));
        // No grpc-status: by the HTTP status, as gRPC clients read it; an HTTP 200 waits for
        // its trailers.
        let none = HeaderMap::new();
        assert_eq!(settle_by_head(StatusCode::OK, &none), None);
        assert_eq!(
            settle_by_head(StatusCode::SERVICE_UNAVAILABLE, &none),
            Some(Settle::Release)
        );
        assert_eq!(
            settle_by_head(StatusCode::NOT_FOUND, &none),
            Some(Settle::Store)
        );
        assert_eq!(
            settle_by_head(StatusCode::PAYLOAD_TOO_LARGE, &none),
            Some(Settle::Release)
        );
    }
}
