//! `idem gateway`: a reverse proxy that gives an existing HTTP API `Idempotency-Key`
//! semantics without touching its code.
//!
//! Every request is forwarded to the upstream; requests on guarded routes (POST and PATCH by
//! default) that carry a key go through [`idem_http::IdempotencyLayer`], so a retry gets the
//! first answer instead of reaching the upstream again. Before anything else the path is
//! brought to its normal form ([`path`]), which is what routes match and what the upstream
//! receives; a path servers read differently is refused with 400 `ambiguous_path`. A guarded
//! request without the scope header is refused with 401 `credential_required` unless its route
//! says `anonymous = "shared"`.
//!
//! The gateway's own endpoints live under one reserved prefix (`/_idem` by default); nothing
//! under it, in any spelling or case, is forwarded:
//!
//! | path | what |
//! | --- | --- |
//! | `{prefix}/health` | 200 `{"status":"ok"\|"degraded","store":KIND,"components":{…}}`, 503 if the store fails (see [`idem_ops::health`]) |
//! | `{prefix}/metrics` | Prometheus text |
//!
//! The admin page and the record tools (see [`idem_ops::admin::http`]), with
//! `POST {prefix}/records/inspect` (what a record holds) and `POST {prefix}/records/reopen` (run
//! an unknown outcome again on the next retry), are served by [`Gateway::admin_router`], on a
//! listener of its own: on the gateway's address they would share an origin with the
//! upstream, whose scripts could then read the admin token the page keeps.

pub mod admin;
pub mod config;
pub mod path;
pub mod proxy;
pub mod resolve;

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::uri::PathAndQuery;
use axum::http::{HeaderName, Request, Uri};
use axum::response::{IntoResponse, Response};
use idem_core::{BoxFuture, Clock, SharedStore, SystemClock};
use idem_http::{
    IDEMPOTENCY_KEY, IdempotencyLayer, IdempotencyService, KeyRequirement, Problem, ProblemCode,
    ScopeSecret, ScopeSource, ToProblem, UnstoredAnswers,
};
use tower_layer::Layer;
use tower_service::Service;
use tracing::warn;

use admin::AdminState;
pub use config::{Anonymous, FileConfig, PathPattern, Route, RouteSettings};
pub use idem_ops::admin::AdminToken;
use idem_ops::metrics::Registry;
pub use path::AmbiguousPath;
pub use proxy::{Proxy, TrustedProxies, Upstream};

/// The default reserved prefix.
pub const DEFAULT_ADMIN_PREFIX: &str = "/_idem";

/// Everything the gateway needs, validated.
#[derive(Clone)]
pub struct Gateway {
    /// Where requests go.
    pub upstream: Upstream,
    /// How long to wait for the upstream.
    pub upstream_timeout: Duration,
    /// Where records live.
    pub store: SharedStore,
    /// The engine's clock.
    pub clock: Arc<dyn Clock>,
    /// The reserved prefix, such as `/_idem`.
    pub admin_prefix: String,
    /// Where each caller's scope comes from.
    pub scope: ScopeSource,
    /// The proxies in front whose forwarding headers are believed.
    pub trusted_proxies: TrustedProxies,
    /// Routes, first match wins.
    pub routes: Vec<(PathPattern, Route)>,
    /// The rules of requests no route matches.
    pub default_route: Route,
    /// The operator's token for the record tools; `None` disables them.
    pub admin_token: Option<AdminToken>,
    /// Health (`{prefix}/health`), and the purge loop's status it reports.
    pub health: idem_ops::health::Monitor,
    /// Records counted in the background, for the admin page.
    pub records_history: Arc<idem_ops::admin::History>,
    /// Whether `{prefix}/metrics` needs the admin token too.
    pub metrics_require_token: bool,
    /// The memory answers the store has not taken yet may hold, all routes together.
    pub unstored_answers: UnstoredAnswers,
    /// How long a request waits for the store to take its answer (and for room in
    /// `unstored_answers`) before it is answered 503 `answer_not_stored`.
    pub store_timeout: Duration,
}

impl Gateway {
    /// A gateway to `upstream` with default settings.
    pub fn new(upstream: Upstream, store: SharedStore) -> Self {
        Self {
            upstream,
            upstream_timeout: Duration::from_secs(30),
            store,
            clock: Arc::new(SystemClock),
            admin_prefix: DEFAULT_ADMIN_PREFIX.to_owned(),
            scope: ScopeSource::default(),
            trusted_proxies: TrustedProxies::default(),
            routes: Vec::new(),
            default_route: Route::default(),
            admin_token: None,
            health: idem_ops::health::Monitor::default(),
            records_history: Arc::default(),
            metrics_require_token: false,
            unstored_answers: UnstoredAnswers::default(),
            store_timeout: idem_http::DEFAULT_STORE_TIMEOUT,
        }
    }

    /// Applies a configuration file's settings (other than upstream, listen, store and
    /// purge_interval, which the command line resolves). An `upstream_timeout` set before
    /// (from the command line) stays unless the file gives one.
    pub fn configure(mut self, file: &FileConfig) -> Result<Self, String> {
        if let Some(t) = &file.upstream_timeout {
            self.upstream_timeout =
                config::bounded("upstream_timeout", t, config::MAX_UPSTREAM_TIMEOUT)?;
        }
        if let Some(t) = &file.store_timeout {
            self.store_timeout = config::bounded("store_timeout", t, config::MAX_STORE_TIMEOUT)?;
        }
        if let Some(prefix) = &file.admin_prefix {
            self.admin_prefix = admin_prefix(prefix)?;
        }
        if let Some(path) = &file.admin_token_file {
            self.admin_token = Some(AdminToken::from_file(path)?);
        }
        if let Some(require) = file.metrics_require_token {
            if require && self.admin_token.is_none() {
                return Err("metrics_require_token needs admin_token_file".to_owned());
            }
            self.metrics_require_token = require;
        }
        let header = match &file.scope_header {
            Some(name) => HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("scope_header {name:?} is not a header name"))?,
            None => axum::http::header::AUTHORIZATION,
        };
        self.scope = match &file.scope_secret_file {
            Some(path) => ScopeSource::KeyedHeader(header, scope_secret(path)?),
            None => ScopeSource::Header(header),
        };
        if let Some(entries) = &file.trusted_proxies {
            self.trusted_proxies = TrustedProxies::parse(entries)?;
        }
        if file.defaults.path.is_some() {
            return Err("[defaults] takes no path; put it in a [[route]]".into());
        }
        let none = RouteSettings::default();
        self.default_route = config::route(&file.defaults, &none, self.upstream_timeout)
            .map_err(|e| format!("[defaults]: {e}"))?;
        self.routes = file
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let at = || format!("[[route]] #{}", i + 1);
                let path = r
                    .path
                    .as_deref()
                    .ok_or_else(|| format!("{}: needs a path", at()))?;
                let case = r.case_sensitive.or(file.defaults.case_sensitive);
                let pattern = PathPattern::parse(path)
                    .map_err(|e| format!("{}: {e}", at()))?
                    .case_sensitive(case.unwrap_or(true));
                // Folded here as ASCII only, while an upstream that routes without regard to
                // case may fold `Ä` to `ä` too: the route would miss requests it serves.
                if case == Some(false) && pattern.has_non_ascii() {
                    return Err(format!(
                        "{}: case_sensitive = false folds ASCII letters only, and path {path:?} \
                         has other characters; keep such routes case-sensitive",
                        at()
                    ));
                }
                let route = config::route(r, &file.defaults, self.upstream_timeout)
                    .map_err(|e| format!("{}: {e}", at()))?;
                Ok((pattern, route))
            })
            .collect::<Result<_, String>>()?;
        Ok(self)
    }

    /// What an operator should know about this configuration before it serves: routes whose
    /// anonymous callers share one scope, and scopes kept out of the log.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let header = self.scope.header_name();
        if let Some(name) = header {
            let shared = self
                .routes
                .iter()
                .map(|(p, r)| (p.as_str(), r))
                .chain([("requests no route matches", &self.default_route)])
                .filter(|(_, r)| r.anonymous == Anonymous::Shared);
            for (what, _) in shared {
                out.push(format!(
                    "{what}: guarded requests without the {name} header share one scope \
                     (anonymous = \"shared\"), so any such caller can replay another's stored \
                     answer by reusing its key"
                ));
            }
        }
        if let ScopeSource::Header(name) = &self.scope {
            out.push(format!(
                "no scope_secret_file: callers' scopes (hashes of their {name} header) are \
                 withheld from the log, so the record tools need the caller's credential \
                 rather than the scope"
            ));
        }
        if !self.trusted_proxies.is_empty() {
            out.push(format!(
                "X-Forwarded-* and Forwarded headers are believed from {}; make sure only \
                 those proxies can reach the gateway",
                self.trusted_proxies
            ));
        }
        out
    }

    /// The gateway's routes: its own endpoints under the reserved prefix, everything else
    /// to the upstream. Logs [`Gateway::warnings`], once, since a gateway builds its router
    /// once.
    pub fn router(&self) -> Router {
        for w in self.warnings() {
            warn!("{w}");
        }
        // The recorder first: descriptions sent before it is installed are lost.
        let registry = Registry::global();
        describe_metrics();
        let proxy = Proxy::new(self.upstream.clone(), self.upstream_timeout)
            .trusting(self.trusted_proxies.clone());
        let guard = |route: &Route| Guard {
            anonymous: route.anonymous,
            key: route.policy.key,
            methods: route.policy.methods.clone().into(),
            svc: IdempotencyLayer::new(self.store.clone(), route.policy.clone())
                .scope(self.scope.clone())
                .clock(self.clock.clone())
                .unstored_answers(self.unstored_answers.clone())
                .store_timeout(self.store_timeout)
                .layer(proxy.clone()),
        };
        let dispatch = Dispatch {
            routes: self
                .routes
                .iter()
                .map(|(pattern, route)| (pattern.clone(), guard(route)))
                .collect::<Vec<_>>()
                .into(),
            default: guard(&self.default_route),
            scope: self.scope.clone(),
        };
        Router::new()
            .fallback_service(Front {
                prefix: self.admin_prefix.as_str().into(),
                admin: admin::router(self.admin_state(registry), false),
                dispatch: Some(dispatch),
            })
            .layer(idem_ops::trace::RequestSpanLayer)
    }

    /// The admin listener's routes: under the reserved prefix the admin page, the record tools,
    /// health and metrics; nothing else, and nothing forwarded. Served on an address of its
    /// own, so that the page, and the admin token it keeps, share no origin with the upstream,
    /// whose scripts could otherwise read the token.
    pub fn admin_router(&self) -> Router {
        let registry = Registry::global();
        Router::new()
            .fallback_service(Front {
                prefix: self.admin_prefix.as_str().into(),
                admin: admin::router(self.admin_state(registry), true),
                dispatch: None,
            })
            .layer(idem_ops::trace::RequestSpanLayer)
    }

    fn admin_state(&self, registry: Registry) -> AdminState {
        let namespaces = self
            .routes
            .iter()
            .map(|(pattern, route)| (pattern.clone(), route.policy.namespace.clone()))
            .collect();
        AdminState {
            store: self.store.clone(),
            clock: self.clock.clone(),
            registry,
            token: self.admin_token.clone(),
            metrics_require_token: self.metrics_require_token,
            history: self.records_history.clone(),
            health: self.health.clone(),
            prefix: self.admin_prefix.as_str().into(),
            scope: self.scope.clone(),
            namespaces: Arc::new((namespaces, self.default_route.policy.namespace.clone())),
        }
    }
}

/// Checks a reserved prefix: `/` and at least one segment, no trailing slash; written in
/// normal form ([`path::normalize`]).
pub fn admin_prefix(prefix: &str) -> Result<String, String> {
    let bad = || {
        format!(
            "admin prefix {prefix:?} must be a path such as /_idem (not / and without wildcards)"
        )
    };
    let normal = path::normalize(prefix).map_err(|_| bad())?;
    let trimmed = normal.trim_end_matches('/');
    if trimmed.len() < 2 || trimmed.contains(['*', '{', '}']) {
        return Err(bad());
    }
    Ok(trimmed.to_owned())
}

fn scope_secret(path: &std::path::Path) -> Result<ScopeSecret, String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read scope secret file {}: {e}", path.display()))?;
    ScopeSecret::new(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// The whole gateway: brings the path to its normal form (or refuses it), answers under the
/// reserved prefix itself, and hands everything else to [`Dispatch`] (none: the admin
/// listener, which serves the prefix only).
#[derive(Clone)]
struct Front {
    prefix: Arc<str>,
    admin: Router,
    dispatch: Option<Dispatch>,
}

impl Service<Request<Body>> for Front {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        if let Some(standard) = standard_in_other_case(req.method()) {
            return ready(refuse(ProblemCode::AmbiguousMethod.problem(format!(
                "Refused: the method is {standard} in other letter case. Methods are \
                 case-sensitive, and servers differ on this one; send {standard}."
            ))));
        }
        let normal = match path::normalize(req.uri().path()) {
            Ok(normal) => normal,
            Err(e) => return ready(refuse(path_problem(e))),
        };
        if normal != req.uri().path() {
            let Some(uri) = with_path(req.uri(), &normal) else {
                return ready(refuse(path_problem(AmbiguousPath::NotAbsolute)));
            };
            *req.uri_mut() = uri;
        }
        if !path::under_prefix(&normal, &self.prefix) {
            let Some(dispatch) = &mut self.dispatch else {
                return ready(
                    Problem::not_found(format!(
                        "The admin listener serves only {}, the admin page, and what is under it.",
                        self.prefix
                    ))
                    .into_response(),
                );
            };
            // Always ready, and its future owns what it needs: called here, not cloned.
            return dispatch.call(req);
        }
        // Every spelling of the prefix is reserved; only the exact one is served.
        let Some(rest) = normal.strip_prefix(&*self.prefix) else {
            return ready(Problem::not_found("There is no such gateway endpoint.").into_response());
        };
        // The gateway's endpoints take no final slash: `/_idem/health/` is `/_idem/health`.
        let rest = rest.trim_end_matches('/');
        let inner = if rest.is_empty() { "/" } else { rest };
        let Some(uri) = with_path(req.uri(), inner) else {
            return ready(Problem::not_found("There is no such gateway endpoint.").into_response());
        };
        *req.uri_mut() = uri;
        let mut admin = self.admin.clone();
        Box::pin(async move { admin.call(req).await })
    }
}

fn ready(res: Response) -> BoxFuture<'static, Result<Response, Infallible>> {
    Box::pin(std::future::ready(Ok(res)))
}

/// `uri` with another path, the query kept.
fn with_path(uri: &Uri, path: &str) -> Option<Uri> {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(pq).ok()?);
    Uri::from_parts(parts).ok()
}

/// The standard method (RFC 9110, and PATCH) that `method` spells in other letter case, if
/// any: `post` is not POST to the gateway, so no route guards it, while Django, Flask and
/// ASP.NET run it as POST.
fn standard_in_other_case(method: &axum::http::Method) -> Option<&'static str> {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    let m = method.as_str();
    STANDARD
        .into_iter()
        .find(|s| s.eq_ignore_ascii_case(m) && *s != m)
}

/// 400 `ambiguous_path` (`invalid_request` for a target that is not a path at all).
pub(crate) fn path_problem(e: AmbiguousPath) -> Problem {
    if e == AmbiguousPath::NotAbsolute {
        return Problem::invalid_request(format!("{e}."));
    }
    ProblemCode::AmbiguousPath.problem(format!("Refused: {e}; send the path in plain form."))
}

/// Counts a request the gateway refused before any route saw it, then answers.
fn refuse(problem: Problem) -> Response {
    metrics::counter!("idem_gateway_refused_total", "code" => problem.code()).increment(1);
    problem.into_response()
}

/// One route's guarded service, and what the gateway checks before it.
#[derive(Clone)]
struct Guard {
    anonymous: Anonymous,
    key: KeyRequirement,
    methods: Arc<[axum::http::Method]>,
    svc: IdempotencyService<Proxy>,
}

impl Guard {
    /// Whether the layer would guard `req` (a guarded method, with a key or on a route that
    /// requires one) while the route refuses it without a credential and it has none.
    fn refuses(&self, req: &Request<Body>, scope: &ScopeSource) -> bool {
        self.anonymous == Anonymous::Refuse
            && self.methods.contains(req.method())
            && (self.key == KeyRequirement::Required || req.headers().contains_key(IDEMPOTENCY_KEY))
            && scope.credential_missing(req.headers())
    }
}

/// Picks the first route whose pattern matches the (normal) path.
#[derive(Clone)]
struct Dispatch {
    routes: Arc<[(PathPattern, Guard)]>,
    default: Guard,
    scope: ScopeSource,
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The proxy is always ready, and so is every layer over it.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let path = req.uri().path();
        let guard = self
            .routes
            .iter()
            .find(|(pattern, _)| pattern.matches(path))
            .map_or(&self.default, |(_, guard)| guard);
        if guard.refuses(&req, &self.scope) {
            let name = self.scope.header_name().map_or("", HeaderName::as_str);
            return ready(refuse(ProblemCode::CredentialRequired.problem(format!(
                "This route keeps each caller's stored answers apart by the {name} header; \
                 send it with an Idempotency-Key."
            ))));
        }
        let answer = guard.svc.clone().call(req);
        Box::pin(async move { Ok(answer.await?.into_response()) })
    }
}

/// Registers the help text of the gateway's metrics (and the layer's) with the recorder.
fn describe_metrics() {
    idem_http::describe_metrics();
    metrics::describe_counter!(
        "idem_gateway_upstream_total",
        "Exchanges with the upstream, by outcome: answered, unreachable, timeout, failed."
    );
    metrics::describe_histogram!(
        "idem_gateway_upstream_seconds",
        "Time until the upstream's answer head (or the failure), in seconds."
    );
    metrics::describe_counter!(
        "idem_gateway_refused_total",
        "Requests the gateway refused before any route: ambiguous_method, ambiguous_path, invalid_request, credential_required."
    );
}
