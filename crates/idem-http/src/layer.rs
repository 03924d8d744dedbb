//! The tower [`Layer`] that gives a route `Idempotency-Key` semantics.

use std::sync::Arc;

use idem_core::{Clock, SharedStore};
use tower_layer::Layer;

use crate::config::{Config, Protocol};
use crate::policy::Policy;
use crate::scope::ScopeSource;
use crate::service::IdempotencyService;
use crate::unstored::UnstoredAnswers;

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

    /// The memory answers the store has not taken yet may hold (64 MiB by default, each
    /// layer its own): give several layers one to bound them together. An answer that finds no
    /// room within the store timeout is not kept; its record is marked an unknown outcome, so
    /// it is never run again unasked.
    #[must_use]
    pub fn unstored_answers(mut self, budget: UnstoredAnswers) -> Self {
        Arc::make_mut(&mut self.cfg).unstored = budget;
        self
    }

    /// The longest a store call settling a request (storing its answer, releasing its key) is
    /// waited for, 5 s by default: a store that stalls answers nothing, and the caller is
    /// answered `answer_not_stored` (or, for a release, given the handler's answer) by then.
    #[must_use]
    pub fn store_timeout(mut self, timeout: std::time::Duration) -> Self {
        Arc::make_mut(&mut self.cfg).store_timeout =
            timeout.max(std::time::Duration::from_millis(1));
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
