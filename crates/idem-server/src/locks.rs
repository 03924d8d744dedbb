//! Lock endpoints (see `idem::locks`), each caller's lock names its own:
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `POST /v1/locks/{name}/acquire` `{"lease_ms","wait_ms"?,"owner"?}` | 200 `{"lock","fence","expires_at"}`, or 409 `lock_held` (with `retry_after_ms`) |
//! | `POST /v1/locks/{name}/renew` `{"lock","lease_ms"}` | 200 `{"lock","fence","expires_at"}`, or 409 `not_owner` |
//! | `POST /v1/locks/{name}/release` `{"lock"}` | 200 `{"released":true}`, or 409 `not_owner` |
//!
//! `lock` is the holding's secret handle (`<owner>.<fence>`): whoever has it may renew and
//! release. `fence` goes with every write the lock protects, so the resource can refuse a
//! holder that lost its lock (see `idem_store::fenced`). A caller that may lose the answer of an
//! acquire sends its own `owner` id (16 to 64 characters of `A-Z a-z 0-9 - _`): repeating the
//! acquire with it returns the same holding instead of `lock_held`.
//!
//! `lease_ms` is 1 to 86400000 (24 h); `wait_ms` (default 0) at most 60000. A name is 1 to 128
//! visible ASCII characters.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use idem::{LockError, LockOwner, Locks};
use idem_core::{Held, Timestamp};
use idem_http::{Problem, ProblemCode, ToProblem};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

use crate::AppState;
use crate::answers::{Holding, LockReleased};
use crate::api::MAX_LEASE;
use crate::auth::Caller;
use idem_ops::json::rfc3339;
use idem_ops::json::{JsonBody, PathParams};

/// The longest a caller may wait for a lock in one request.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// The longest lock name, in bytes.
pub const MAX_NAME: usize = 128;

/// `POST /v1/locks/{name}/acquire`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireBody {
    /// The lease, in milliseconds (1 to 86400000).
    #[schema(minimum = 1, maximum = 86_400_000)]
    lease_ms: u64,
    /// How long to wait for the lock, in milliseconds (0 to 60000; default 0).
    #[schema(maximum = 60_000)]
    wait_ms: Option<u64>,
    /// The caller's own owner id (16 to 64 characters of `A-Z a-z 0-9 - _`): repeating the
    /// acquire with it returns the same holding.
    #[schema(pattern = "^[A-Za-z0-9_-]{16,64}$")]
    owner: Option<String>,
}

/// `POST /v1/locks/{name}/renew`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = LockRenewBody)]
pub struct RenewBody {
    /// The handle an acquire returned.
    lock: String,
    /// The new lease, in milliseconds (1 to 86400000).
    #[schema(minimum = 1, maximum = 86_400_000)]
    lease_ms: u64,
}

/// `POST /v1/locks/{name}/release`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = LockReleaseBody)]
pub struct ReleaseBody {
    /// The handle an acquire returned.
    lock: String,
}

fn locks(state: &AppState) -> Result<&Locks, Problem> {
    state.locks.as_ref().ok_or_else(|| {
        ProblemCode::LocksUnsupported
            .problem("This server's store does not keep locks; use SQLite, PostgreSQL or Redis.")
    })
}

/// The backend's name for the caller's lock: the caller's scope (hashed, so that any scope
/// fits) and the name.
fn scoped(caller: &Caller, name: &str) -> Result<String, Problem> {
    if name.is_empty() || name.len() > MAX_NAME || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ProblemCode::InvalidLockName
            .problem("A lock name is 1 to 128 visible ASCII characters."));
    }
    let scope = Sha256::digest(caller.scope.as_str().as_bytes());
    let mut out = String::with_capacity(17 + name.len());
    idem_core::push_hex(&mut out, &scope[..8]);
    out.push('/');
    out.push_str(name);
    Ok(out)
}

fn lease(ms: u64) -> Result<Duration, Problem> {
    let lease = Duration::from_millis(ms);
    if lease.is_zero() || lease > MAX_LEASE {
        return Err(
            ProblemCode::InvalidLease.problem("`lease_ms` must be from 1 to 86400000 (24 hours).")
        );
    }
    Ok(lease)
}

/// Splits a `lock` handle into its owner and fence.
fn handle(lock: &str) -> Result<(LockOwner, u64), Problem> {
    let bad = || ProblemCode::InvalidLock.problem("`lock` must be the handle an acquire returned.");
    let (owner, fence) = lock.rsplit_once('.').ok_or_else(bad)?;
    let owner = LockOwner::parse(owner).map_err(|_| bad())?;
    let fence = fence.parse().map_err(|_| bad())?;
    Ok((owner, fence))
}

fn held(owner: &LockOwner, held: Held) -> Json<Holding> {
    Json(Holding::new(owner.as_str(), held.fence, held.expires_at))
}

fn problem(e: &LockError) -> Problem {
    match e {
        LockError::Held { until } => ProblemCode::LockHeld
            .problem("Another owner holds the lock.")
            .retry_after(until.saturating_since(Timestamp::now()))
            .with("held_until", rfc3339(*until)),
        LockError::Timeout => ProblemCode::LockHeld
            .problem("Another owner held the lock for as long as the request waited."),
        LockError::NotOwner | LockError::Lost => ProblemCode::NotOwner.problem(
            "This handle does not hold the lock: it was released, its lease ran out, or \
             another owner has taken it since.",
        ),
        LockError::Invalid(e) => Problem::invalid_request(format!("{e}.")),
        LockError::Store(e) => Problem::store(e),
        _ => ProblemCode::LockError.problem("The lock operation failed."),
    }
}

/// Describes the lock endpoints' metrics.
pub fn describe_metrics() {
    metrics::describe_histogram!(
        "idem_lock_acquire_seconds",
        metrics::Unit::Seconds,
        "How long lock acquisitions over HTTP took, waiting for the holder included, by result (acquired, refused)."
    );
}

/// Acquires a lock, waiting up to `wait_ms`.
pub async fn acquire(
    State(state): State<AppState>,
    caller: Caller,
    PathParams(name): PathParams<String>,
    JsonBody(body): JsonBody<AcquireBody>,
) -> Result<Json<Holding>, Problem> {
    let locks = locks(&state)?;
    let name = scoped(&caller, &name)?;
    let lease = lease(body.lease_ms)?;
    let wait = Duration::from_millis(body.wait_ms.unwrap_or(0));
    if wait > MAX_WAIT {
        return Err(
            ProblemCode::InvalidWait.problem("`wait_ms` must be at most 60000 (one minute).")
        );
    }
    let started = std::time::Instant::now();
    let acquired = match &body.owner {
        Some(id) => {
            let owner = LockOwner::parse(id)
                .map_err(|e| ProblemCode::InvalidOwner.problem(format!("{e}.")))?;
            // A caller that hangs up keeps the holding: it knows the owner id and gets the
            // holding back by asking again.
            locks.acquire_as(&name, owner, lease, wait).await
        }
        // Nobody else knows this owner id: a lock granted after the caller hung up is
        // released for it, rather than held for its whole lease.
        None => locks.acquire(&name, lease, wait).await,
    };
    let result = if acquired.is_ok() {
        "acquired"
    } else {
        "refused"
    };
    metrics::histogram!("idem_lock_acquire_seconds", "result" => result)
        .record(started.elapsed().as_secs_f64());
    let guard = acquired.map_err(|e| problem(&e))?;
    // The caller holds the lock through its handle, not through this guard.
    let (owner, holding) = guard.detach();
    Ok(held(&owner, holding))
}

/// Renews a holding.
pub async fn renew(
    State(state): State<AppState>,
    caller: Caller,
    PathParams(name): PathParams<String>,
    JsonBody(body): JsonBody<RenewBody>,
) -> Result<Json<Holding>, Problem> {
    let locks = locks(&state)?;
    let name = scoped(&caller, &name)?;
    let lease = lease(body.lease_ms)?;
    let (owner, fence) = handle(&body.lock)?;
    let renewed = locks
        .renew(&name, &owner, fence, lease)
        .await
        .map_err(|e| problem(&e))?;
    Ok(held(&owner, renewed))
}

/// Releases a holding; repeating it succeeds.
pub async fn release(
    State(state): State<AppState>,
    caller: Caller,
    PathParams(name): PathParams<String>,
    JsonBody(body): JsonBody<ReleaseBody>,
) -> Result<Json<LockReleased>, Problem> {
    let locks = locks(&state)?;
    let name = scoped(&caller, &name)?;
    let (owner, fence) = handle(&body.lock)?;
    locks
        .release(&name, &owner, fence)
        .await
        .map_err(|e| problem(&e))?;
    Ok(Json(LockReleased::YES))
}
