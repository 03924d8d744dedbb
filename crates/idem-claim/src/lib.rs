//! The two steps every front end of the engine takes around its work: claiming a key (waiting
//! for an attempt in flight, if asked), and settling the record while the store may be briefly
//! unavailable. The run-once API (`idem`, which re-exports them as `idem::claim`), the HTTP
//! layer (`idem-http`) and the server all use them.
//!
//! Below both the facade and the HTTP layer, above the record model ([`idem_core`]): it needs
//! a Tokio runtime (for timers and for finishing calls whose caller left) and no store.

pub mod cancel;

use std::future::Future;
use std::time::Duration;

use crate::cancel::finishing;
use idem_core::{
    BeginOutcome, BeginRequest, Clock, DynStore, LeaseError, StepError, Store, StoreError,
    Timestamp,
};

/// What to do when another attempt holds the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlight {
    /// Answer "in progress" at once.
    #[default]
    Reject,
    /// Wait up to this long for the other attempt to finish and replay its result. If it
    /// releases the key, or its lease runs out, meanwhile, this attempt takes the key over and
    /// runs the work itself. A bound too large to represent is no bound.
    Wait(Duration),
}

/// `begin`, repeated with backoff (5 ms doubling to 200 ms, never past the bound) while
/// another attempt holds the key and `in_flight` says to wait. Answers the store's last
/// outcome: [`BeginOutcome::InProgress`] only once the wait is over.
///
/// Safe to drop at any point: a `begin` already on its way to the store is carried on in a
/// task of its own, and if it takes the key, the key is released at once, so that nobody is
/// told "in progress" for a lease held on behalf of a caller who is gone.
pub async fn begin_waiting<S: Store + Clone>(
    store: &S,
    clock: &dyn Clock,
    req: &BeginRequest,
    in_flight: InFlight,
) -> Result<BeginOutcome, StoreError> {
    let deadline = match in_flight {
        InFlight::Reject => None,
        InFlight::Wait(max) => Some(
            tokio::time::Instant::now()
                .checked_add(max)
                .unwrap_or_else(far_future),
        ),
    };
    let mut pause = Duration::from_millis(5);
    // Owned, so that a `begin` can outlive this future; handed from attempt to attempt.
    let mut owned = (store.clone(), req.clone());
    loop {
        let (outcome, back) = begin_to_the_end(owned, clock.now()).await;
        owned = back;
        let outcome = outcome?;
        let left = deadline.map_or(Duration::ZERO, |d| {
            d.saturating_duration_since(tokio::time::Instant::now())
        });
        if !matches!(outcome, BeginOutcome::InProgress { .. }) || left.is_zero() {
            return Ok(outcome);
        }
        tokio::time::sleep(pause.min(left)).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// One `begin`, finished in the background if its caller stops waiting; a key it takes then
/// is released (at the same `now`, so a released record expires as the caller's would). Hands
/// the store and request back with the outcome.
///
/// Through [`DynStore`], whose futures are boxed and named `Send`: a future that awaits a
/// generic `Store` method of `Arc<dyn DynStore>` cannot be proven `Send` by the compiler
/// ("implementation of `Store` is not general enough").
fn begin_to_the_end<S: Store + Clone>(
    (store, req): (S, BeginRequest),
    now: Timestamp,
) -> impl Future<Output = (Result<BeginOutcome, StoreError>, (S, BeginRequest))> + Send + 'static {
    let call = async move {
        let outcome = DynStore::begin(&store, &req, now).await;
        (outcome, (store, req))
    };
    finishing(call, move |(outcome, (store, req))| async move {
        if let Ok(BeginOutcome::Acquired(lease)) = outcome {
            let store: &dyn DynStore = &store;
            // If this fails too, the key frees itself when the lease runs out.
            let _ = settle_retrying(|| store.release(&req.key, &lease, now)).await;
        }
    })
}

fn far_future() -> tokio::time::Instant {
    // About 30 years: tokio's own "far future".
    tokio::time::Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// How many times a settling operation is tried while the store is unavailable.
const SETTLE_ATTEMPTS: u32 = 3;

/// The error of an operation under a lease, which may be the store's own failure.
pub trait UnderLease {
    /// The store's failure, if that is what this is.
    fn store_error(&self) -> Option<&StoreError>;
}

impl UnderLease for LeaseError {
    fn store_error(&self) -> Option<&StoreError> {
        match self {
            LeaseError::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl UnderLease for StepError {
    fn store_error(&self) -> Option<&StoreError> {
        match self {
            StepError::Store(e) => Some(e),
            _ => None,
        }
    }
}

/// Runs `op` (a `complete`, `release` or `record_step`, each idempotent for one lease, so
/// repeating them is safe) up to three times while it fails with a transient store error,
/// backing off 40 then 80 ms. Any other answer is returned at once.
pub async fn settle_retrying<T, E, F, Fut>(mut op: F) -> Result<T, E>
where
    E: UnderLease,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Err(e)
                if e.store_error().is_some_and(StoreError::is_transient)
                    && attempt < SETTLE_ATTEMPTS =>
            {
                tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}
