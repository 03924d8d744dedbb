//! The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around a handler: what
//! happens to each request, from its `Idempotency-Key` to the answer.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use idem_core::{BeginRequest, BoxFuture, ClientKey, Key};
use tower_service::Service;

use crate::body::{BoxError, ResponseBody, boxed, read_body};
use crate::claim::{answer_from_memory, claim, reject};
use crate::config::Config;
use crate::fingerprint::fingerprint;
use crate::header::{KeyHeaderError, key_from_headers};
use crate::metrics::count;
use crate::policy::KeyRequirement;
use crate::problem::Problem;
use crate::problem::ToProblem;
use crate::settle::run_and_settle;
use idem_wire::ProblemCode;

/// Put in the extensions of every guarded request that reaches the handler: the fence of
/// its lease, strictly greater than that of any earlier attempt with the same key, for
/// fenced writes downstream. A request without it was not guarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseFence {
    /// The lease's fence.
    pub fence: u64,
}

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around a handler.
///
/// The request body type must be constructible from [`Bytes`] (axum's `Body` and
/// `Full<Bytes>` are): a guarded request's body is read, fingerprinted, and handed on whole.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, cfg: Arc<Config>) -> Self {
        Self { inner, cfg }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S>
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
        Ok(None) => {
            return Ok(reject(
                &cfg,
                ProblemCode::IdempotencyKeyMissing
                    .problem("This route requires an Idempotency-Key header."),
            ));
        }
        Err(e) => return Ok(reject(&cfg, invalid_key(&e))),
    };
    let (parts, body) = req.into_parts();
    let key = match ClientKey::new(client_key) {
        Ok(ck) => Key::new(cfg.scope.scope_of(&parts), policy.namespace.clone(), ck),
        Err(_) => return Ok(reject(&cfg, invalid_key(&KeyHeaderError::Malformed))),
    };
    let body = match read_body(&parts.headers, body, policy.max_body).await {
        Ok(b) => b,
        Err(p) => return Ok(reject(&cfg, p)),
    };
    let fingerprint = match fingerprint(policy, &parts, &body) {
        Ok(fp) => fp,
        Err(p) => return Ok(reject(&cfg, p)),
    };
    let begin = BeginRequest::new(key, fingerprint)
        .with_lease(policy.lease)
        .with_ttl(policy.ttl);
    let req = Request::from_parts(parts, ReqBody::from(body));
    claim_and_run(cfg, inner, req, begin).await
}

/// Answers a guarded request from memory, or claims its key and runs it, in a task of its own.
pub(crate) async fn claim_and_run<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    inner: S,
    mut req: Request<ReqBody>,
    begin: BeginRequest,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // A replay the store answers from memory claims nothing: answered here, with no task.
    if let Some(answer) = answer_from_memory(&cfg, &begin) {
        return Ok(answer);
    }
    // Claiming the key and running the handler happen in a task of its own: a client that
    // hangs up cancels neither half way. The work does not stop half done, and its answer is
    // stored for the client's retry. (A claim dropped on its own would leave nothing held:
    // `begin_waiting` gives back a key taken for a caller that left.)
    let task_cfg = cfg.clone();
    let task = tokio::spawn(async move {
        let cfg = task_cfg;
        let lease = match claim(&cfg, &begin).await {
            Ok(lease) => lease,
            Err(answer) => return Ok(answer),
        };
        req.extensions_mut()
            .insert(LeaseFence { fence: lease.fence });
        run_and_settle(cfg, inner, req, begin.key, lease).await
    });
    match task.await {
        Ok(result) => result,
        // The handler panicked; the settler released the key as it unwound.
        Err(_) => Ok(reject(
            &cfg,
            ProblemCode::HandlerFailed.problem(
                "The handler failed before answering; the key was released, so a retry runs \
                 again.",
            ),
        )),
    }
}

pub(crate) fn invalid_key(e: &KeyHeaderError) -> Problem {
    ProblemCode::IdempotencyKeyInvalid.problem(e.to_string())
}
