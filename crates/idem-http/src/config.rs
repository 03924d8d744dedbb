//! What every request on a guarded route shares, as the layer hands it to each request.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, SharedStore, SystemClock};

use crate::policy::Policy;
use crate::scope::ScopeSource;
use crate::unstored::UnstoredAnswers;

/// How a guarded route speaks: what its refusals look like and what in an answer says whether
/// it is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Refusals are problem+json; the status (and the [`Preset`](crate::Preset)) decides.
    Http,
    /// Refusals are gRPC statuses; the `grpc-status` (in the trailers, or the headers of a
    /// trailers-only answer) decides.
    #[cfg(feature = "grpc")]
    Grpc,
}

/// What every request on a guarded route shares: where records live, the clock, the route's
/// policy, where a request's scope comes from, and the answers still being stored.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) protocol: Protocol,
    pub(crate) store: SharedStore,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) policy: Policy,
    pub(crate) scope: ScopeSource,
    /// The memory answers the store has not taken yet may hold.
    pub(crate) unstored: UnstoredAnswers,
    /// The longest a settling store call is waited for before the caller is answered
    /// `answer_not_stored` (a stalled store answers nothing, not even an error).
    pub(crate) store_timeout: Duration,
}

/// The default store timeout
/// ([`IdempotencyLayer::store_timeout`](crate::IdempotencyLayer::store_timeout)): 5 s, the
/// stores' own response timeout.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);

impl Config {
    /// A route's shared settings, on the system clock, scoping keys by the hashed
    /// `Authorization` header.
    pub(crate) fn new(protocol: Protocol, store: SharedStore, policy: Policy) -> Arc<Self> {
        Arc::new(Self {
            protocol,
            store,
            clock: Arc::new(SystemClock),
            policy,
            scope: ScopeSource::default(),
            unstored: UnstoredAnswers::default(),
            store_timeout: DEFAULT_STORE_TIMEOUT,
        })
    }
}
