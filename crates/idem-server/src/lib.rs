//! The `idem` server: a JSON API over the idempotency record engine, so that services in any
//! language can claim a key, run their work, and store the answer every retry gets.
//!
//! The API (all errors are RFC 9457 problem+json with a stable `code`):
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `GET /healthz` | 200 `{"status":"ok"\|"degraded","store":KIND,"components":{…}}`; 503 if the store fails (see [`health`]) |
//! | `POST /v1/records/begin` | claim a key: `acquired` with a lease, `replay` with the stored response, 409 `in_progress`, 422 `fingerprint_mismatch` |
//! | `POST /v1/records/step` | record a finished step (or one whose outcome is unknown) under the lease; 409 `stale_lease`, `step_conflict`, `step_after_unknown`, `steps_full` |
//! | `POST /v1/records/complete` | store the response under the lease; 409 `stale_lease` |
//! | `POST /v1/records/release` | give the key back after a retryable failure; 409 `stale_lease` |
//! | `POST /v1/records/renew` | extend the lease of long work; 409 `stale_lease` once overtaken |
//! | `GET /v1/records/{namespace}/{key}` | the caller's record, or 404 |
//! | `POST /v1/tokens`, `POST /v1/tokens/consume` | one-time tokens (see [`tokens`]) |
//! | `POST /v1/locks/{name}/acquire`, `/renew`, `/release` | locks with fencing (see [`locks`]) |
//! | `GET /v1/ids/uuid7`, `/v1/ids/snowflake`, `/v1/ids/segment/{tag}` (`?count=N`) | ids (see [`ids`]) |
//! | `GET /openapi.json` | this API as an OpenAPI 3.1 document (see [`openapi`]) |
//! | `GET /_idem/health`, `/_idem/metrics` | health and metrics |
//!
//! The admin page and the record tools are served by [`admin_router`], on a listener of their
//! own.

pub mod answers;
pub mod api;
pub mod auth;
pub mod ids;
pub mod locks;
pub mod openapi;
pub mod tokens;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use idem_core::{Clock, DEFAULT_LEASE, DEFAULT_TTL, SharedStore, SystemClock};

use crate::auth::Auth;
use idem_http::{Problem, ProblemCode, ToProblem};
use idem_ops::health::Components;
use idem_ops::json::BodyLimit;
use idem_ops::{admin, health, metered, trace};

/// The default limit on request bodies: 1 MiB.
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// Where records live.
    pub store: SharedStore,
    /// The engine's clock.
    pub clock: Arc<dyn Clock>,
    /// How callers are told apart.
    pub auth: Arc<Auth>,
    /// The largest request body accepted, in bytes.
    pub max_body: usize,
    /// The lease when a `begin` does not give one.
    pub default_lease: Duration,
    /// The retention when a `begin` does not give one.
    pub default_ttl: Duration,
    /// The Snowflake generator, keeping a worker id leased from the store (none: this server
    /// issues no Snowflake ids).
    pub snowflake: Option<Arc<idem_id::ManagedSnowflake>>,
    /// Health by component, and the memory of what was logged about it.
    pub health: health::Monitor,
    /// Segment allocators by caller scope and tag, made on first use.
    pub segments: ids::SegmentTable,
    /// Locks, if the store keeps them.
    pub locks: Option<idem::Locks>,
    /// The token of the record tools under `/_idem/records`; `None` turns them off.
    pub admin_token: Option<admin::AdminToken>,
    /// Records counted in the background ([`admin::sampler::run`]), for the admin page.
    pub records_history: Arc<admin::History>,
    /// Whether `/_idem/metrics` needs the admin token too.
    pub metrics_require_token: bool,
}

impl AppState {
    /// A state over `store` with the system clock, anonymous callers and default limits.
    pub fn new(store: SharedStore) -> Self {
        Self {
            store,
            clock: Arc::new(SystemClock),
            auth: Arc::new(Auth::anonymous()),
            max_body: DEFAULT_MAX_BODY,
            default_lease: DEFAULT_LEASE,
            default_ttl: DEFAULT_TTL,
            snowflake: None,
            health: health::Monitor::default(),
            segments: ids::SegmentTable::default(),
            locks: None,
            admin_token: None,
            records_history: Arc::default(),
            metrics_require_token: false,
        }
    }

    /// What this server's health reports on: the store, Snowflake ids, segment ids, locks
    /// and (through its monitor) the purge loop.
    pub fn components(&self) -> Components {
        Components {
            store: self.store.clone(),
            clock: self.clock.clone(),
            snowflake: self.snowflake.clone(),
            segments: Some(Arc::new(self.segments.clone())),
            locks: Some(self.locks.is_some()),
        }
    }

    /// Serves locks from `locks` (usually the same store, opened with
    /// `StoreUrl::open_with_locks`).
    #[must_use]
    pub fn with_locks(mut self, locks: idem_core::SharedLockStore) -> Self {
        self.locks = Some(idem::Locks::shared(locks));
        self
    }
}

/// The reserved prefix of the server's own endpoints (health, metrics, record tools).
pub const ADMIN_PREFIX: &str = "/_idem";

/// What the API's listener answers under [`ADMIN_PREFIX`] for anything but health and metrics.
const ON_ADMIN_LISTENER: &str = "The admin page and the record tools are served on the admin \
                                 listener (--admin-listen), not on the API's.";

/// The API's routes, and under [`ADMIN_PREFIX`] health and metrics. The admin page and the
/// record tools are on [`admin_router`], for a listener of their own.
pub fn router(state: AppState) -> Router {
    api::describe_metrics();
    ids::describe_metrics();
    locks::describe_metrics();
    metered::describe_metrics();
    Router::new()
        .route("/healthz", get(api::health))
        .route("/v1/records/begin", post(api::begin))
        .route("/v1/records/step", post(api::step))
        .route("/v1/records/complete", post(api::complete))
        .route("/v1/records/release", post(api::release))
        .route("/v1/records/renew", post(api::renew))
        .route("/v1/records/{namespace}/{key}", get(api::get))
        .route("/v1/tokens", post(tokens::issue))
        .route("/v1/tokens/consume", post(tokens::consume))
        .route("/v1/locks/{name}/acquire", post(locks::acquire))
        .route("/v1/locks/{name}/renew", post(locks::renew))
        .route("/v1/locks/{name}/release", post(locks::release))
        .route("/v1/ids/uuid7", get(ids::uuid7))
        .route("/v1/ids/snowflake", get(ids::snowflake))
        .route("/v1/ids/segment/{tag}", get(ids::segment))
        .route("/openapi.json", get(openapi::serve))
        .with_state(state.clone())
        .nest(
            ADMIN_PREFIX,
            operator(state, false).fallback(|| async { Problem::not_found(ON_ADMIN_LISTENER) }),
        )
        .route(
            "/_idem/",
            axum::routing::any(|| async { Problem::not_found(ON_ADMIN_LISTENER) }),
        )
        .fallback(|| async { Problem::not_found("There is no such endpoint.") })
        .method_not_allowed_fallback(|| async {
            ProblemCode::MethodNotAllowed.problem("This endpoint does not take that method.")
        })
        .layer(trace::RequestSpanLayer)
}

/// The admin listener's routes, all under [`ADMIN_PREFIX`]: the admin page at the prefix
/// itself, the record tools (see [`admin::http`]), the segment tags and locks held, health and
/// metrics. Served on an address of its own, so that the page and the token it keeps share an
/// origin with nothing else.
pub fn admin_router(state: AppState) -> Router {
    Router::new()
        .nest(ADMIN_PREFIX, operator(state, true))
        // The page is the prefix itself; with a final slash too.
        .route(
            "/_idem/",
            get(|| async { axum::response::Redirect::permanent(ADMIN_PREFIX) }),
        )
        .fallback(|| async {
            Problem::not_found("There is no such endpoint; the admin page is at /_idem.")
        })
        .method_not_allowed_fallback(|| async {
            ProblemCode::MethodNotAllowed.problem("This endpoint does not take that method.")
        })
        .layer(trace::RequestSpanLayer)
}

/// The operator's routes under the prefix: health and metrics, and with `tools` the page, the
/// record tools, the segment tags and the locks held.
fn operator(state: AppState, tools: bool) -> Router {
    let routes = Router::new().route("/health", get(api::health)).route(
        "/metrics",
        get(
            |axum::extract::State(s): axum::extract::State<AppState>,
             req: axum::extract::Request| async move {
                admin::metrics_response(&s, s.metrics_require_token, &req.into_parts().0)
            },
        ),
    );
    if !tools {
        return routes.with_state(state);
    }
    let tools = admin::RecordTools {
        store: state.store.clone(),
        clock: state.clock.clone(),
        token: state.admin_token.clone(),
        history: state.records_history.clone(),
        prefix: ADMIN_PREFIX.into(),
    };
    routes
        .route("/segments", get(admin_segments))
        .route("/locks", get(admin_locks))
        .with_state(state)
        .merge(admin::router(tools))
}

impl BodyLimit for AppState {
    fn max_body(&self) -> usize {
        self.max_body
    }
}

impl admin::AdminAccess for AppState {
    fn admin_token(&self) -> Option<&admin::AdminToken> {
        self.admin_token.as_ref()
    }
}

/// `GET /_idem/segments`: the segment tags this server holds for its callers, with their
/// runway (admin token).
async fn admin_segments(
    axum::extract::State(state): axum::extract::State<AppState>,
    _: admin::Operator,
) -> axum::Json<answers::SegmentTags> {
    let segments = state
        .segments
        .views()
        .into_iter()
        .map(|v| answers::SegmentTag::new(v.scope, v.tag, v.remaining, v.step, v.runway, v.failing))
        .collect();
    axum::Json(answers::SegmentTags { segments })
}

/// The most locks `GET /_idem/locks` lists.
const MAX_LOCKS_LISTED: usize = 1000;

/// `GET /_idem/locks`: the locks held now, by name, with their fences and lease ends (admin
/// token); never their owners.
async fn admin_locks(
    axum::extract::State(state): axum::extract::State<AppState>,
    _: admin::Operator,
) -> Result<axum::Json<answers::LocksHeld>, Problem> {
    let unsupported = || {
        ProblemCode::LocksUnsupported
            .problem("This server's store keeps no locks, or cannot list them.")
    };
    let locks = state.locks.as_ref().ok_or_else(unsupported)?;
    let held = locks
        .store()
        .held(MAX_LOCKS_LISTED)
        .await
        .map_err(|e| Problem::store(&e))?
        .ok_or_else(unsupported)?;
    let locks = held.iter().map(Into::into).collect();
    Ok(axum::Json(answers::LocksHeld { locks }))
}

pub use idem::purge::purge_loop;
