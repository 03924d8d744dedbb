//! The record tools over HTTP, the same on `idem serve` and `idem gateway` (under `/_idem`),
//! each behind the admin token:
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `GET /records?scope=&namespace=&state=&older_than=&after=&limit=` | one page of records (`state`: `in_progress`, `stuck`, `completed`, `released`, `expired` or `unknown`; `older_than`: `10m`), with `next`, the cursor of the page after it |
//! | `GET /records/counts?scope=&namespace=` | records by state, unknown outcomes, the oldest attempt's age |
//! | `GET /records/show?scope=&namespace=&key=` | one live record, with the answer it replays |
//! | `GET /records/history` | the counts taken in the background, oldest first |
//! | `POST /records/repair` | `{"action": "release"\|"reopen"\|"delete", "records": [{"scope", "namespace", "key", "state", "fence"}, …], "force": false}`: each record is repaired only if it is still in the state and fence given (as it was shown); answers `{"applied": N, "skipped": M}`. Refused whole, before anything is touched, when it names idem's own records (403 `internal_record`) or, without `"force": true`, attempts shown `in_progress` (409 `force_required`) |
//!
//! `reopen` is `release` for unknown outcomes only; `release` gives back the key of an attempt
//! that is gone (or of a completed record whose answer must not stand); `delete` forgets a
//! record. Every repair is logged (action, key tag, fence, the operator's address) and counted
//! in `idem_record_repairs_total{action, result}`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, FromRequestParts, Query, State};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_core::{Clock, Cursor, Key, RecordAdmin, RecordState, SharedStore, Shown, Store};
use idem_http::operator;
use idem_http::{Problem, ProblemCode, ToProblem};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};

use super::answers::{Counts, CountsHistory, RecordPage, ShownRecordView};
use super::records::{self, Action, MAX_BULK, Refused, Selector, Target, apply};
use super::{AdminAccess, AdminToken, Operator};
use crate::json::{BodyLimit, JsonBody};

/// The records shown on a page when the request does not say.
pub const DEFAULT_PAGE: usize = 50;

/// What the record tools need: the store, the clock its records are judged by, and the token.
#[derive(Clone)]
pub struct RecordTools {
    /// The store.
    pub store: SharedStore,
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// The admin token; `None` turns the tools off (403 `admin_disabled`).
    pub token: Option<AdminToken>,
    /// The counts taken in the background ([`super::sampler`]).
    pub history: Arc<super::History>,
    /// The prefix the tools are served under, in normal form (`/_idem`): the page names its
    /// assets from it, never from the request's path.
    pub prefix: Arc<str>,
}

impl AdminAccess for RecordTools {
    fn admin_token(&self) -> Option<&AdminToken> {
        self.token.as_ref()
    }
}

impl BodyLimit for RecordTools {
    fn max_body(&self) -> usize {
        // A full bulk repair: MAX_BULK records of a few hundred bytes each.
        MAX_BULK * 1024
    }
}

impl RecordTools {
    fn admin(&self) -> Result<&dyn RecordAdmin, Problem> {
        Store::admin(&self.store).ok_or_else(|| {
            ProblemCode::RecordToolsUnsupported.problem(format!(
                "The {} store does not list, count or repair records.",
                Store::kind(&self.store)
            ))
        })
    }
}

/// The record tools' routes, relative to the prefix they are nested under, with the admin
/// page at `/` and its assets.
pub fn router(tools: RecordTools) -> Router {
    Router::new()
        .route("/", get(super::page::index))
        .route("/assets/app.js", get(super::page::script))
        .route("/assets/app.css", get(super::page::style))
        .route("/records", get(list))
        .route("/records/counts", get(counts))
        .route("/records/show", get(show))
        .route("/records/repair", post(repair))
        .route("/records/history", get(history))
        .with_state(tools)
}

/// A listing's query.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only records of this scope.
    #[param(pattern = "^[!-~]{1,255}$")]
    scope: Option<String>,
    /// Only records of this namespace.
    #[param(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: Option<String>,
    /// Only records in this state: `in_progress`, `stuck`, `completed`, `released`, `expired`
    /// or `unknown`.
    #[param(pattern = "^(in_progress|stuck|completed|released|expired|unknown)$")]
    state: Option<String>,
    /// Only records whose latest attempt started at least this long ago (as in `10m`).
    older_than: Option<String>,
    /// The cursor a previous page gave as `next`.
    after: Option<String>,
    /// The most records on the page (1 to 1000; default 50).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
}

fn invalid(detail: impl std::fmt::Display) -> Problem {
    Problem::invalid_request(format!("{detail}."))
}

/// A query string read into `T`, or a 400 that says what is wrong with it.
fn query<T: serde::de::DeserializeOwned>(
    q: Result<Query<T>, impl std::fmt::Display>,
) -> Result<T, Problem> {
    q.map(|Query(q)| q).map_err(invalid)
}

async fn list(
    State(t): State<RecordTools>,
    _: Operator,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let q = query(q)?;
    let now = t.clock.now();
    let state = q
        .state
        .as_deref()
        .map(Selector::parse)
        .transpose()
        .map_err(invalid)?;
    let older_than = q
        .older_than
        .as_deref()
        .map(|s| humantime::parse_duration(s).map_err(|e| invalid(format!("older_than: {e}"))))
        .transpose()?;
    let filter = records::filter(
        q.scope.as_deref(),
        q.namespace.as_deref(),
        state,
        older_than,
        now,
    )
    .map_err(invalid)?;
    let after = q
        .after
        .as_deref()
        .map(str::parse::<Cursor>)
        .transpose()
        .map_err(invalid)?;
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    let page = t
        .admin()?
        .list(&filter, after.as_ref(), limit, now)
        .await
        .map_err(|e| Problem::store(&e))?;
    Ok(axum::Json(RecordPage {
        records: page.records.iter().map(Into::into).collect(),
        next: page.next.map(|c| c.to_string()),
    })
    .into_response())
}

/// A count's query.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CountQuery {
    /// Only records of this scope.
    #[param(pattern = "^[!-~]{1,255}$")]
    scope: Option<String>,
    /// Only records of this namespace.
    #[param(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: Option<String>,
}

async fn counts(
    State(t): State<RecordTools>,
    _: Operator,
    q: Result<Query<CountQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let q = query(q)?;
    let now = t.clock.now();
    let filter = records::filter(q.scope.as_deref(), q.namespace.as_deref(), None, None, now)
        .map_err(invalid)?;
    let c = operator::counts(t.admin()?, &filter, now)
        .await
        .map_err(|e| Problem::store(&e))?;
    Ok(axum::Json(Counts::new(&c, now)).into_response())
}

async fn history(State(t): State<RecordTools>, _: Operator) -> Response {
    axum::Json(CountsHistory {
        every_seconds: super::sampler::SAMPLE_EVERY.as_secs(),
        samples: t.history.samples(),
    })
    .into_response()
}

/// The key of the record to show.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ShowQuery {
    /// The record's scope.
    #[param(pattern = "^[!-~]{1,255}$")]
    scope: String,
    /// The record's namespace.
    #[param(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The record's key.
    #[param(pattern = "^[!-~]{1,255}$")]
    key: String,
}

async fn show(
    State(t): State<RecordTools>,
    _: Operator,
    q: Result<Query<ShowQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let q = query(q)?;
    let key = Key::parse(&q.scope, &q.namespace, &q.key).map_err(invalid)?;
    let now = t.clock.now();
    let record = t
        .store
        .get(&key, now)
        .await
        .map_err(|e| Problem::store(&e))?
        .ok_or_else(|| {
            ProblemCode::RecordNotFound.problem("There is no live record under this key.")
        })?;
    Ok(axum::Json(ShownRecordView::new(&record, now)).into_response())
}

/// One record a repair names, as it was shown.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShownRecord {
    /// The record's scope.
    #[schema(pattern = "^[!-~]{1,255}$")]
    scope: String,
    /// The record's namespace.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    namespace: String,
    /// The record's key.
    #[schema(pattern = "^[!-~]{1,255}$")]
    key: String,
    /// Its state when shown (`in_progress`, `stuck`, `completed`, `released` or `expired`).
    #[schema(pattern = "^(in_progress|stuck|completed|released|expired)$")]
    state: String,
    /// Its fence when shown.
    fence: u64,
}

/// `POST /records/repair`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RepairBody {
    /// `release`, `reopen` or `delete`.
    #[schema(pattern = "^(release|reopen|delete)$")]
    action: String,
    /// 1 to 1000 records, each as it was shown.
    #[schema(min_items = 1, max_items = 1000)]
    records: Vec<ShownRecord>,
    /// Repair attempts shown `in_progress` too: their lease runs, so they may still be
    /// working. Without it a repair naming one is refused (409 `force_required`).
    #[serde(default)]
    force: bool,
}

async fn repair(
    State(t): State<RecordTools>,
    _: Operator,
    Peer(peer): Peer,
    JsonBody(body): JsonBody<RepairBody>,
) -> Result<Response, Problem> {
    let action = Action::parse(&body.action).map_err(invalid)?;
    if body.records.is_empty() || body.records.len() > MAX_BULK {
        return Err(invalid(format!(
            "`records` names 1 to {MAX_BULK} records, each as it was shown"
        )));
    }
    let targets = body
        .records
        .iter()
        .map(|r| {
            let key = Key::parse(&r.scope, &r.namespace, &r.key).map_err(invalid)?;
            let state = r.state.parse::<RecordState>().map_err(invalid)?;
            Ok(Target {
                key,
                shown: Shown {
                    state,
                    fence: r.fence,
                },
            })
        })
        .collect::<Result<Vec<_>, Problem>>()?;
    records::check(&targets, body.force).map_err(refused)?;
    let admin = t.admin()?;
    let who = peer.map_or_else(|| "http".to_owned(), |a| format!("http {}", a.ip()));
    match apply(&t.store, admin, &targets, action, t.clock.now(), &who).await {
        Ok(done) => Ok(axum::Json(done).into_response()),
        Err((done, e)) => Err(Problem::store(&e)
            .with("applied", done.applied)
            .with("skipped", done.skipped)),
    }
}

/// The answer to a repair refused before it touched anything.
fn refused(r: Refused) -> Problem {
    match r {
        Refused::Internal(n) => ProblemCode::InternalRecord
            .problem(format!(
                "{n} of the records named are idem's own (scope `idem.…`: a server's Snowflake \
                 worker lease, a one-time token); no repair touches them, and nothing was done."
            ))
            .with("internal", n),
        Refused::InProgress(n) => ProblemCode::ForceRequired
            .problem(format!(
                "{n} of the records named are attempts in progress: their lease runs, so they \
                 may still be working, and a retry let in beside one runs the work twice. \
                 Nothing was done; send `\"force\": true` to repair them anyway."
            ))
            .with("in_progress", n),
    }
}

/// The address a request came from, when the listener recorded it.
struct Peer(Option<SocketAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(
            parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|ConnectInfo(a)| *a),
        ))
    }
}
