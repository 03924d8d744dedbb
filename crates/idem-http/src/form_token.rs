//! A layer that lets a request through only if it carries an unused one-time token
//! (`idem::Tokens`) for the route's purpose: the seeds' double-submit guard for forms.
//!
//! The service issues a token when it renders the form (`Tokens::issue` with the scope
//! [`ScopeSource::scope_of`] gives for that request, and the route's purpose) and the page sends
//! it back in the `Form-Token` header (configurable). The first request with it reaches the
//! handler; every other one is refused with 409 and a code saying why (`already_used`,
//! `expired`, `wrong_purpose`, `unknown`). A request without one is 400 `token_missing`.
//! The token is used up before the handler runs, whatever the handler then answers: a form
//! whose submission failed needs a new token (render the form again), which is what keeps a
//! second submission from slipping in while the first one runs. Spending the token and the
//! handler run in a task of their own, so a client that hangs up after the token was spent
//! (a double click aborts the first submission) does not cancel the handler: the first
//! submission is made, and the second is told the token was used.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderName, Request, Response};
use http_body::Body;
use http_body_util::Full;
use idem_core::BoxFuture;
use idem_core::{TokenError, Tokens};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{BoxError, ResponseBody, boxed};
use crate::problem::Problem;
use crate::problem::ToProblem;
use crate::scope::ScopeSource;
use idem_wire::ProblemCode;

/// The default header carrying the token.
pub const FORM_TOKEN: HeaderName = HeaderName::from_static("form-token");

/// Checks and consumes a one-time token on every request.
#[derive(Clone, Debug)]
pub struct FormTokenLayer {
    tokens: Tokens,
    purpose: String,
    header: HeaderName,
    scope: ScopeSource,
}

impl FormTokenLayer {
    /// Tokens issued for `purpose` by `tokens`, in the `Form-Token` header, scoped by the
    /// hashed `Authorization` header.
    pub fn new(tokens: Tokens, purpose: impl Into<String>) -> Self {
        Self {
            tokens,
            purpose: purpose.into(),
            header: FORM_TOKEN,
            scope: ScopeSource::default(),
        }
    }

    /// The header carrying the token.
    #[must_use]
    pub fn header(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }

    /// Where the caller's scope comes from (the one the token was issued to).
    #[must_use]
    pub fn scope(mut self, scope: ScopeSource) -> Self {
        self.scope = scope;
        self
    }
}

impl<S> Layer<S> for FormTokenLayer {
    type Service = FormToken<S>;

    fn layer(&self, inner: S) -> FormToken<S> {
        FormToken {
            inner,
            cfg: Arc::new(self.clone()),
        }
    }
}

/// The service [`FormTokenLayer`] makes.
#[derive(Clone, Debug)]
pub struct FormToken<S> {
    inner: S,
    cfg: Arc<FormTokenLayer>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for FormToken<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        // Spending the token and running the handler happen in a task of its own, as the
        // idempotency layer's claim and handler do: a client that hangs up (a double click
        // aborts the first submission) cancels neither half way, so a spent token always
        // reached the handler, which finishes.
        let work = async move {
            let (parts, body) = req.into_parts();
            let Some(token) = parts.headers.get(&cfg.header).and_then(|v| v.to_str().ok()) else {
                return Ok(ProblemCode::TokenMissing
                    .problem(format!(
                        "This request needs a one-time token in the {} header.",
                        cfg.header
                    ))
                    .into_http::<Full<bytes::Bytes>>()
                    .map(boxed));
            };
            let scope = cfg.scope.scope_of(&parts);
            if let Err(e) = cfg
                .tokens
                .consume(scope.as_str(), token, &cfg.purpose)
                .await
            {
                return Ok(token_problem(&e)
                    .into_http::<Full<bytes::Bytes>>()
                    .map(boxed));
            }
            let req = Request::from_parts(parts, body);
            Ok(inner.call(req).await?.map(boxed))
        };
        Box::pin(async move {
            match tokio::spawn(work).await {
                Ok(result) => result,
                Err(_) => Ok(ProblemCode::HandlerFailed
                    .problem("The handler failed before answering; the token was spent.")
                    .into_http::<Full<bytes::Bytes>>()
                    .map(boxed)),
            }
        })
    }
}

/// The problem answering a refused token: 409 `already_used`, `expired`, `wrong_purpose` or
/// `unknown` (also for another caller's token, so that its existence is not revealed), 400 for
/// an invalid purpose or scope, 503 for a store failure.
pub fn token_problem(e: &TokenError) -> Problem {
    match e {
        TokenError::AlreadyUsed => {
            ProblemCode::TokenAlreadyUsed.problem("The token was already used.")
        }
        TokenError::Expired => ProblemCode::TokenExpired.problem("The token expired."),
        TokenError::WrongPurpose => {
            ProblemCode::TokenWrongPurpose.problem("The token was issued for another purpose.")
        }
        TokenError::WrongScope | TokenError::Unknown => {
            ProblemCode::TokenUnknown.problem("There is no such token.")
        }
        TokenError::Invalid(what) => Problem::invalid_request(format!(
            "`{what}` must be 1 to 128 visible ASCII characters."
        )),
        TokenError::Store(e) => Problem::store(e),
    }
}
