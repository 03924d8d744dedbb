//! The tower [`Layer`] that gives a route `Idempotency-Key` semantics.

use std::sync::Arc;

use idem_core::{Clock, SharedStore};
use tower_layer::Layer;

use crate::config::{Config, Protocol};
use crate::policy::Policy;
use crate::scope::ScopeSource;
use crate::service::IdempotencyService;

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
            cfg: Config::new(Protocol::Http, store, policy),
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
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.cfg.clone())
    }
}
