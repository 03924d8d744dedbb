//! `idem gateway`: a reverse proxy that gives an existing HTTP API `Idempotency-Key`
//! semantics without touching its code.
//!
//! Every request is forwarded to the upstream; requests on guarded routes (POST and PATCH by
//! default) that carry a key go through [`idem_http::IdempotencyLayer`], so a retry gets the
//! first answer instead of reaching the upstream again. The gateway's own endpoints live under
//! one reserved prefix (`/_idem` by default), which is never forwarded:
//!
//! | path | what |
//! | --- | --- |
//! | `{prefix}/health` | 200 `{"status":"ok","store":KIND}`, 503 if the store fails |
//! | `{prefix}/metrics` | Prometheus text |
//! | `POST {prefix}/records/inspect` | what a record holds (admin token) |
//! | `POST {prefix}/records/reopen` | run an unknown outcome again on the next retry (admin token) |

pub mod admin;
pub mod config;
pub mod proxy;

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderName, Request, Response};
use idem_core::{BoxFuture, Clock, SharedStore, SystemClock};
use idem_http::{IdempotencyLayer, Idempotent, Policy, ResponseBody, ScopeSource};
use tower_layer::Layer;
use tower_service::Service;

use crate::metrics::Registry;
use admin::AdminState;
pub use admin::AdminToken;
pub use config::{FileConfig, PathPattern, RouteSettings};
pub use proxy::{Proxy, Upstream};

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
    /// Routes, first match wins.
    pub routes: Vec<(PathPattern, Policy)>,
    /// The policy of requests no route matches.
    pub default_policy: Policy,
    /// The operator's token for the record tools; `None` disables them.
    pub admin_token: Option<AdminToken>,
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
            routes: Vec::new(),
            default_policy: Policy::default(),
            admin_token: None,
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
        if let Some(prefix) = &file.admin_prefix {
            self.admin_prefix = admin_prefix(prefix)?;
        }
        if let Some(path) = &file.admin_token_file {
            self.admin_token = Some(AdminToken::from_file(path)?);
        }
        if let Some(name) = &file.scope_header {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("scope_header {name:?} is not a header name"))?;
            self.scope = ScopeSource::Header(name);
        }
        if file.defaults.path.is_some() {
            return Err("[defaults] takes no path; put it in a [[route]]".into());
        }
        let none = RouteSettings::default();
        self.default_policy = config::policy(&file.defaults, &none, self.upstream_timeout)
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
                let pattern = PathPattern::parse(path).map_err(|e| format!("{}: {e}", at()))?;
                let policy = config::policy(r, &file.defaults, self.upstream_timeout)
                    .map_err(|e| format!("{}: {e}", at()))?;
                Ok((pattern, policy))
            })
            .collect::<Result<_, String>>()?;
        Ok(self)
    }

    /// The gateway's routes: its own endpoints under the reserved prefix, everything else
    /// to the upstream.
    pub fn router(&self) -> Router {
        // The recorder first: descriptions sent before it is installed are lost.
        let registry = Registry::global();
        describe_metrics();
        let proxy = Proxy::new(self.upstream.clone(), self.upstream_timeout);
        let guard = |policy: &Policy| {
            IdempotencyLayer::new(self.store.clone(), policy.clone())
                .scope(self.scope.clone())
                .clock(self.clock.clone())
                .layer(proxy.clone())
        };
        let dispatch = Dispatch {
            routes: self
                .routes
                .iter()
                .map(|(pattern, policy)| (pattern.clone(), guard(policy)))
                .collect::<Vec<_>>()
                .into(),
            default: guard(&self.default_policy),
        };
        let namespaces = self
            .routes
            .iter()
            .map(|(pattern, policy)| (pattern.clone(), policy.namespace.clone()))
            .collect();
        let admin = admin::router(AdminState {
            store: self.store.clone(),
            clock: self.clock.clone(),
            registry,
            token: self.admin_token.clone(),
            scope: self.scope.clone(),
            namespaces: Arc::new((namespaces, self.default_policy.namespace.clone())),
        });
        Router::new()
            .nest(&self.admin_prefix, admin)
            .fallback_service(dispatch)
    }
}

/// Checks a reserved prefix: `/` and at least one segment, no trailing slash.
pub fn admin_prefix(prefix: &str) -> Result<String, String> {
    let trimmed = prefix.trim_end_matches('/');
    if !trimmed.starts_with('/') || trimmed.len() < 2 || trimmed.contains(['*', '{', '}']) {
        return Err(format!(
            "admin prefix {prefix:?} must be a path such as /_idem (not / and without wildcards)"
        ));
    }
    Ok(trimmed.to_owned())
}

/// Picks the first route whose pattern matches the path.
#[derive(Clone)]
struct Dispatch {
    routes: Arc<[(PathPattern, Idempotent<Proxy>)]>,
    default: Idempotent<Proxy>,
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<ResponseBody>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The proxy is always ready, and so is every layer over it.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let path = req.uri().path();
        let mut svc = self
            .routes
            .iter()
            .find(|(pattern, _)| pattern.matches(path))
            .map_or_else(|| self.default.clone(), |(_, svc)| svc.clone());
        Box::pin(svc.call(req))
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
}
