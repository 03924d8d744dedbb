//! What every request on a guarded route shares, as the layer hands it to each request.

use std::sync::Arc;

use idem_core::{Clock, SharedStore};

use crate::policy::Policy;
use crate::scope::ScopeSource;

/// What every request on a guarded route shares: where records live, the clock, the route's
/// policy, where a request's scope comes from, and the answers still being stored.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: SharedStore,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) policy: Policy,
    pub(crate) scope: ScopeSource,
    /// One permit for each answer whose storing is retried in the background
    /// ([`LATE_ANSWERS`](crate::settle::LATE_ANSWERS) at most).
    pub(crate) late: Arc<tokio::sync::Semaphore>,
}
