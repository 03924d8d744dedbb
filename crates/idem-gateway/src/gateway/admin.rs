//! The gateway's own endpoints, under its reserved prefix: health, metrics, and the operator's
//! record tools.
//!
//! The record tools resolve outcomes the gateway could not know: after an upstream timeout the
//! record is held as unknown (`outcome_unknown` to every retry). An operator who has checked
//! the upstream's data and found the request did *not* take effect reopens the record, and the
//! client's next retry runs it. They need an admin token (`admin_token_file`); without one
//! they answer 403.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, Request};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use idem_core::{ClientKey, Clock, Key, Namespace, Scope, SharedStore};
use idem_http::operator::{self, RecordState, RecordView, Reopened};
use idem_http::{Problem, ProblemCode, ScopeSource, ToProblem};
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::info;

use super::PathPattern;
use idem_ops::admin::{AdminAccess, AdminToken, Operator};
use idem_ops::json::rfc3339;
use idem_ops::json::{BodyLimit, JsonBody};
use idem_ops::metrics::Registry;

/// The largest body the record tools accept.
const MAX_ADMIN_BODY: usize = 16 * 1024;

/// What the admin endpoints share.
#[derive(Clone)]
pub(super) struct AdminState {
    pub(super) store: SharedStore,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) registry: Registry,
    pub(super) token: Option<AdminToken>,
    pub(super) metrics_require_token: bool,
    pub(super) history: Arc<idem_ops::admin::History>,
    pub(super) health: idem_ops::health::Monitor,
    /// The reserved prefix, in normal form.
    pub(super) prefix: Arc<str>,
    pub(super) scope: ScopeSource,
    /// Each route's pattern and key namespace, then the namespace of requests no route matches.
    pub(super) namespaces: Arc<(Vec<(PathPattern, Namespace)>, Namespace)>,
}

impl AdminAccess for AdminState {
    fn admin_token(&self) -> Option<&AdminToken> {
        self.token.as_ref()
    }
}

impl BodyLimit for AdminState {
    fn max_body(&self) -> usize {
        MAX_ADMIN_BODY
    }
}

/// The endpoints under the prefix: health and metrics, and with `tools` (the admin listener)
/// the admin page and the record tools.
pub(super) fn router(state: AdminState, tools: bool) -> Router {
    use axum::routing::{get, post};
    let routes = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    let routes = if tools {
        let tools = idem_ops::admin::RecordTools {
            store: state.store.clone(),
            clock: state.clock.clone(),
            token: state.token.clone(),
            history: state.history.clone(),
            prefix: state.prefix.clone(),
        };
        routes
            .route("/records/inspect", post(inspect))
            .route("/records/reopen", post(reopen))
            .with_state(state)
            .merge(idem_ops::admin::router(tools))
            .fallback(|| async { Problem::not_found("There is no such gateway endpoint.") })
    } else {
        routes.with_state(state).fallback(|| async {
            Problem::not_found(
                "There is no such gateway endpoint here: the admin page and the record tools \
                 are served on the admin listener (--admin-listen).",
            )
        })
    };
    routes
        // The `Allow` header is still added by the router.
        .method_not_allowed_fallback(|| async {
            ProblemCode::MethodNotAllowed.problem(
                "This gateway endpoint does not take this method; the Allow header lists those \
                 it takes.",
            )
        })
}

async fn health(State(s): State<AdminState>) -> Response {
    let components = idem_ops::health::Components::store_only(s.store.clone(), s.clock.clone());
    s.health.check(&components).await.into_response()
}

async fn metrics(State(s): State<AdminState>, req: axum::extract::Request) -> Response {
    if s.metrics_require_token {
        return idem_ops::admin::metrics_response(&s, true, &req.into_parts().0);
    }
    s.registry.response()
}

/// Names a record the way its client made it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordRef {
    /// The request's path; its route gives the key namespace.
    path: String,
    /// The client's `Idempotency-Key` value (unquoted).
    key: String,
    /// The caller's scope as logged (`cred-…`, or `anonymous`; with a scope secret only).
    scope: Option<String>,
    /// Or the caller's credential header value, hashed here as on a request.
    credential: Option<String>,
}

impl AdminState {
    fn key_of(&self, r: RecordRef) -> Result<Key, Problem> {
        if !r.path.starts_with('/') {
            return Err(Problem::invalid_request("`path` must start with /."));
        }
        // The path as the request's was: in normal form, which is what routes match.
        let path = super::path::normalize(&r.path).map_err(super::path_problem)?;
        let scope = match (r.scope, r.credential) {
            (Some(scope), None) if scope == idem_http::scope::WITHHELD => {
                return Err(Problem::invalid_request(
                    "The log withholds callers' scopes on this gateway (it has no \
                     scope_secret_file); give the caller's `credential` instead.",
                ));
            }
            (Some(scope), None) => Scope::new(scope).map_err(|e| {
                Problem::invalid_request(format!("`scope` is not a valid scope: {e}."))
            })?,
            (None, Some(credential)) => self.scope_of_credential(&credential)?,
            _ => {
                return Err(Problem::invalid_request(
                    "Give exactly one of `scope` (as logged with the outcome) and `credential` \
                     (the caller's credential header value).",
                ));
            }
        };
        let client_key =
            ClientKey::new(r.key).map_err(|e| ProblemCode::InvalidKey.problem(format!("{e}.")))?;
        let (routes, default) = &*self.namespaces;
        let namespace = routes
            .iter()
            .find(|(pattern, _)| pattern.matches(&path))
            .map_or(default, |(_, ns)| ns);
        Ok(Key::new(scope, namespace.clone(), client_key))
    }

    /// The scope a request carrying `credential` in the scope header gets: the same hash,
    /// keyed or not, and the same reading of the auth scheme.
    fn scope_of_credential(&self, credential: &str) -> Result<Scope, Problem> {
        let Some(name) = self.scope.header_name() else {
            return Err(Problem::invalid_request(
                "This gateway does not scope by a header; give `scope`.",
            ));
        };
        let value = HeaderValue::from_str(credential)
            .map_err(|_| Problem::invalid_request("`credential` is not a valid header value."))?;
        let mut parts = Request::new(()).into_parts().0;
        parts.headers.insert(name.clone(), value);
        Ok(self.scope.scope_of(&parts))
    }
}

fn view_json(view: &RecordView) -> Value {
    let mut v = json!({
        "state": view.state.name(),
        "fence": view.fence,
        "created_at": rfc3339(view.created_at),
        "expires_at": rfc3339(view.expires_at),
    });
    match &view.state {
        RecordState::InProgress { lease_expires_at } | RecordState::Stuck { lease_expires_at } => {
            v["lease_expires_at"] = rfc3339(*lease_expires_at).into();
        }
        RecordState::Stored { status } | RecordState::TooLarge { status } => {
            v["status"] = status.as_u16().into();
        }
        RecordState::Unknown { until } => {
            v["until"] = until.map(rfc3339).into();
        }
        _ => {}
    }
    v
}

fn not_found() -> Problem {
    ProblemCode::RecordNotFound.problem("There is no live record for this path, key and scope.")
}

async fn inspect(
    State(s): State<AdminState>,
    _: Operator,
    JsonBody(r): JsonBody<RecordRef>,
) -> Result<Json<Value>, Problem> {
    let key = s.key_of(r)?;
    match operator::inspect(&*s.store, &key, s.clock.now()).await {
        Ok(Some(view)) => Ok(Json(view_json(&view))),
        Ok(None) => Err(not_found()),
        Err(e) => Err(Problem::store(&e)),
    }
}

async fn reopen(
    State(s): State<AdminState>,
    _: Operator,
    JsonBody(r): JsonBody<RecordRef>,
) -> Result<Json<Value>, Problem> {
    let key = s.key_of(r)?;
    match operator::reopen_unknown(&*s.store, &key, s.clock.now()).await {
        Ok(Reopened::Reopened { fence }) => {
            info!(
                key = %key.log_tag(),
                scope = %s.scope.log_form(key.scope()),
                namespace = %key.namespace(),
                fence,
                "an operator reopened an unknown outcome; the next retry runs it"
            );
            Ok(Json(json!({"reopened": true, "fence": fence})))
        }
        Ok(Reopened::NotFound) => Err(not_found()),
        Ok(Reopened::NotUnknown(view)) => Err(ProblemCode::NotUnknown
            .problem(format!(
                "The record is {}, not an unknown outcome; only unknown outcomes are reopened.",
                view.state.name()
            ))
            .with("record", view_json(&view))),
        Err(e) => Err(Problem::store(&e)),
    }
}
