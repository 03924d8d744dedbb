//! The API's OpenAPI 3.1 document, served at `GET /openapi.json`.
//!
//! Request bodies and query parameters are the handlers' own types; the answers, which the
//! handlers write with `json!`, are described by the schema types below. Each operation's
//! errors come from one table (`ERRORS`): for every status an operation may answer with a
//! problem, the document lists the `code`s it may carry, so a client (or a test) can tell an
//! undocumented error from a documented one. `crates/idem-server/openapi.json` is this
//! document as committed; `tests/openapi.rs` keeps the two equal.

use std::collections::BTreeMap;

use idem_http::ProblemCode;
use serde::Serialize;
use serde_json::Value;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::admin::http::{CountQuery, ListQuery, RepairBody, ShowQuery};
use crate::api::{BeginBody, CompleteBody, ReleaseBody as RecordReleaseBody, StepBody};
use crate::locks::{AcquireBody, ReleaseBody as LockReleaseBody, RenewBody};
use crate::tokens::{ConsumeBody, IssueBody};

/// The document, as `GET /openapi.json` serves it.
pub fn document() -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    spell_unsigned_formats(&mut doc);
    doc
}

/// The document as pretty-printed JSON with a final newline, as committed.
pub fn pretty() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

/// `GET /openapi.json`.
pub(crate) async fn serve() -> axum::Json<Value> {
    axum::Json(document())
}

/// Unsigned integers are described as `uint8` … `uint64` (OpenAPI's `int64` would cap them at
/// 2^63 - 1); utoipa 5 spells these formats `u-int64`.
fn spell_unsigned_formats(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for (name, member) in map.iter_mut() {
                if let (true, Value::String(format)) = (name == "format", &mut *member) {
                    if let Some(bits) = format.strip_prefix("u-int") {
                        *format = format!("uint{bits}");
                    }
                } else {
                    spell_unsigned_formats(member);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(spell_unsigned_formats),
        _ => {}
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem",
        description = "The idem server's JSON API: idempotency records, one-time tokens, locks \
                       and ids for services in any language, and the operator's endpoints under \
                       `/_idem`. Every error is an RFC 9457 problem+json with a stable `code`."
    ),
    paths(
        ops::healthz,
        ops::begin,
        ops::step,
        ops::complete,
        ops::release,
        ops::get_record,
        ops::issue_token,
        ops::consume_token,
        ops::acquire_lock,
        ops::renew_lock,
        ops::release_lock,
        ops::uuid7,
        ops::snowflake,
        ops::segment,
        ops::openapi_json,
        ops::admin_health,
        ops::admin_metrics,
        ops::admin_page,
        ops::admin_page_slash,
        ops::admin_script,
        ops::admin_style,
        ops::records_list,
        ops::records_counts,
        ops::records_show,
        ops::records_history,
        ops::records_repair,
        ops::segments,
        ops::locks_held,
    ),
    components(schemas(Problem)),
    modifiers(&Security, &Errors),
    tags(
        (name = "records", description = "Idempotency records: claim a key, store the answer, replay it."),
        (name = "tokens", description = "One-time tokens, each caller's its own."),
        (name = "locks", description = "Locks with fencing tokens."),
        (name = "ids", description = "UUIDv7, Snowflake and segment ids."),
        (name = "health", description = "Health and metrics."),
        (name = "admin", description = "The operator's record tools, behind the admin token."),
    )
)]
struct ApiDoc;

/// The name of the API key scheme.
const API_KEY: &str = "api_key";
/// The name of the admin token scheme.
const ADMIN_TOKEN: &str = "admin_token";

struct Security;

impl Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        let bearer = |description: &str| {
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(description))
                    .build(),
            )
        };
        components.add_security_scheme(
            API_KEY,
            bearer(
                "An API key from the server's --api-keys file, as `Authorization: Bearer <key>`. \
                 A server without one serves every caller anonymously, under one scope.",
            ),
        );
        components.add_security_scheme(
            ADMIN_TOKEN,
            bearer(
                "The admin token (--admin-token-file), as `Authorization: Bearer <token>`. \
                 Without one the record tools answer 403 `admin_disabled`.",
            ),
        );
        for (path, item) in doc.paths.paths.iter_mut() {
            let requirement = if path.starts_with("/v1/") {
                // Anonymous callers too, on a server without API keys.
                vec![
                    SecurityRequirement::default(),
                    SecurityRequirement::new(API_KEY, Vec::<String>::new()),
                ]
            } else if path.starts_with("/_idem/records")
                || path == "/_idem/segments"
                || path == "/_idem/locks"
            {
                vec![SecurityRequirement::new(ADMIN_TOKEN, Vec::<String>::new())]
            } else {
                continue;
            };
            for op in [&mut item.get, &mut item.post].into_iter().flatten() {
                op.security = Some(requirement.clone());
            }
        }
    }
}

/// Every answer of the API's error responses.
#[derive(Serialize, ToSchema)]
#[schema(
    title = "Problem",
    description = "An RFC 9457 problem (`application/problem+json`). Some codes add members: \
                   `retry_after_ms` (with a `Retry-After` header), `limit_bytes`, `held_until`, \
                   `applied` and `skipped`."
)]
struct Problem {
    /// `urn:idem:problem:<code>`.
    #[serde(rename = "type")]
    kind: String,
    /// A short title, the same for every answer with the code.
    title: String,
    /// The HTTP status.
    status: u16,
    /// What happened, in a sentence for people.
    detail: String,
    /// The stable machine-readable code.
    code: String,
    /// How long to wait before retrying, in milliseconds (with a `Retry-After` header).
    #[schema(nullable = false)]
    retry_after_ms: Option<u64>,
}

/// The `lease` of an `acquired` begin.
#[derive(Serialize, ToSchema)]
struct LeaseView {
    /// The lease token `complete` and `release` take back.
    id: String,
    /// The fencing token of this attempt.
    fence: u64,
    /// When the lease runs out.
    #[schema(format = DateTime)]
    expires_at: String,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum AcquiredOutcome {
    Acquired,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum ReplayOutcome {
    Replay,
}

/// The key is the caller's: run the work, then `complete` (or `release`).
#[derive(Serialize, ToSchema)]
struct Acquired {
    outcome: AcquiredOutcome,
    lease: LeaseView,
    /// The steps earlier attempts recorded, in order (empty on a record's first attempt):
    /// resume after the last one that is `done`.
    steps: Vec<StepView>,
    /// The step key of each step named in the request's `step_keys`.
    #[schema(nullable = false)]
    step_keys: Option<BTreeMap<String, String>>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum StepOutcomeView {
    Done,
    Unknown,
}

/// A recorded step.
#[derive(Serialize, ToSchema)]
struct StepView {
    /// Its name.
    step: String,
    /// `done`, with its output, or `unknown`: it sent a request and got no answer.
    outcome: StepOutcomeView,
    /// The idempotency key to send to the service the step calls, the same on every attempt.
    step_key: String,
    /// The output of a `done` step, as it was recorded.
    #[schema(value_type = Value, required = false)]
    output: Option<Value>,
    /// An output that is not JSON (recorded by another client of the store), as text.
    #[schema(nullable = false)]
    output_text: Option<String>,
}

/// A step recorded (or a repeat of one already recorded).
#[derive(Serialize, ToSchema)]
struct StepRecorded {
    step: String,
    outcome: StepOutcomeView,
    /// The fence of the lease.
    fence: u64,
}

/// The key was completed before: here is the stored response.
#[derive(Serialize, ToSchema)]
struct Replay {
    outcome: ReplayOutcome,
    /// The fence of the attempt that completed it.
    fence: u64,
    /// When it was completed.
    #[schema(format = DateTime)]
    completed_at: String,
    /// The stored response (JSON, as `complete` was given it).
    #[schema(value_type = Value, required = false)]
    response: Option<Value>,
    /// A stored response that is not JSON (written by another client of the store), as text.
    #[schema(nullable = false)]
    response_text: Option<String>,
}

/// What `begin` answers.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum BeginAnswer {
    Acquired(Acquired),
    Replay(Replay),
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum SettledStatus {
    Completed,
    Released,
}

/// What `complete` and `release` answer.
#[derive(Serialize, ToSchema)]
struct Settled {
    /// `completed` or `released`.
    status: SettledStatus,
    /// The fence of the lease.
    fence: u64,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum RecordStatus {
    InProgress,
    Completed,
    Released,
}

/// A live record of the caller's.
#[derive(Serialize, ToSchema)]
struct RecordView {
    namespace: String,
    key: String,
    status: RecordStatus,
    fence: u64,
    /// The request's fingerprint, as hex.
    fingerprint: String,
    #[schema(format = DateTime)]
    created_at: String,
    #[schema(format = DateTime)]
    updated_at: String,
    #[schema(format = DateTime)]
    expires_at: String,
    /// When the running attempt's lease runs out (`in_progress` only).
    #[schema(format = DateTime, nullable = false)]
    lease_expires_at: Option<String>,
    /// The stored response, for a completed record.
    #[schema(value_type = Value, required = false)]
    response: Option<Value>,
    /// A stored response that is not JSON, as text.
    #[schema(nullable = false)]
    response_text: Option<String>,
    /// The steps recorded on the record, in order.
    steps: Vec<StepView>,
}

/// A new one-time token.
#[derive(Serialize, ToSchema)]
struct IssuedToken {
    token: String,
    #[schema(format = DateTime)]
    expires_at: String,
}

/// A consumed token.
#[derive(Serialize, ToSchema)]
struct Consumed {
    /// Always `true`.
    consumed: bool,
}

/// A lock holding.
#[derive(Serialize, ToSchema)]
struct Holding {
    /// The holding's secret handle (`<owner>.<fence>`), for `renew` and `release`.
    lock: String,
    /// The fencing token, to send with every write the lock protects.
    fence: u64,
    #[schema(format = DateTime)]
    expires_at: String,
}

/// A released lock.
#[derive(Serialize, ToSchema)]
struct LockReleased {
    /// Always `true`.
    released: bool,
}

/// UUIDv7 ids, strictly increasing.
#[derive(Serialize, ToSchema)]
struct Uuid7Ids {
    /// Each a UUID in its hyphenated form.
    ids: Vec<String>,
}

/// Snowflake ids, as numbers and as strings (JavaScript loses precision above 2^53).
#[derive(Serialize, ToSchema)]
struct SnowflakeIds {
    ids: Vec<u64>,
    id_strings: Vec<String>,
    /// The worker id they were made with.
    worker: u64,
}

/// Segment ids, as numbers and as strings.
#[derive(Serialize, ToSchema)]
struct SegmentIds {
    ids: Vec<u64>,
    id_strings: Vec<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
enum Level {
    Ok,
    Degraded,
    Down,
}

/// One component's health; components may add members of their own.
#[derive(Serialize, ToSchema)]
struct ComponentHealth {
    status: Level,
    /// Why it is not `ok`.
    #[schema(nullable = false)]
    reason: Option<String>,
    /// Since when it is in this state.
    #[schema(format = DateTime, nullable = false)]
    since: Option<String>,
}

/// The health report.
#[derive(Serialize, ToSchema)]
struct Health {
    /// `ok`, or `degraded` if a component other than the store is not `ok`.
    status: Level,
    /// The store's kind (`memory`, `sqlite`, …).
    store: String,
    /// Each component by name (`store` always).
    components: BTreeMap<String, ComponentHealth>,
}

/// A record as the record tools list it.
#[derive(Serialize, ToSchema)]
struct ListedRecord {
    scope: String,
    namespace: String,
    key: String,
    /// `in_progress`, `stuck`, `completed`, `released` or `expired`.
    state: String,
    /// What the record holds, for a guarded HTTP route: `in_progress`, `stuck`, `expired`,
    /// `stored`, `too_large`, `unknown`, `released` or `foreign`.
    kind: String,
    fence: u64,
    #[schema(format = DateTime)]
    created_at: String,
    #[schema(format = DateTime)]
    updated_at: String,
    #[schema(format = DateTime)]
    lease_expires_at: String,
    #[schema(format = DateTime)]
    expires_at: String,
    /// The stored response's size; `null` while there is none.
    #[schema(required = true)]
    response_bytes: Option<u64>,
    /// The stored answer's HTTP status (`stored` and `too_large`).
    #[schema(nullable = false)]
    status: Option<u16>,
    /// Until when an unknown outcome is held (`unknown`; `null`: until someone resolves it).
    #[schema(format = DateTime)]
    until: Option<String>,
}

/// One page of records.
#[derive(Serialize, ToSchema)]
struct RecordPage {
    records: Vec<ListedRecord>,
    /// The cursor of the page after this one (`after`); `null` on the last page.
    #[schema(required = true)]
    next: Option<String>,
}

/// Records by state.
#[derive(Serialize, ToSchema)]
struct Counts {
    in_progress: u64,
    stuck: u64,
    completed: u64,
    unknown: u64,
    released: u64,
    expired: u64,
    total: u64,
    /// The oldest running attempt's age, in seconds; `null` if none runs.
    #[schema(required = true)]
    oldest_in_progress_seconds: Option<f64>,
}

/// Counts taken in the background at one time.
#[derive(Serialize, ToSchema)]
struct Sample {
    /// When, in milliseconds since the Unix epoch.
    at: u64,
    in_progress: u64,
    stuck: u64,
    completed: u64,
    unknown: u64,
    released: u64,
    expired: u64,
}

/// The counts taken in the background, oldest first.
#[derive(Serialize, ToSchema)]
struct CountsHistory {
    /// How often counts are taken.
    every_seconds: u64,
    samples: Vec<Sample>,
}

/// The segment tags this server holds for its callers.
#[derive(Serialize, ToSchema)]
struct SegmentTags {
    segments: Vec<SegmentTag>,
}

/// One caller's segment tag.
#[derive(Serialize, ToSchema)]
struct SegmentTag {
    /// The caller's scope.
    scope: String,
    /// The tag.
    tag: String,
    /// Ids held in memory (current and spare ranges).
    remaining: u64,
    /// The size of the next range fetched.
    step: u64,
    /// How long the ids in memory last at the rate served so far (`null` before any was
    /// served).
    runway_seconds: Option<f64>,
    /// Why fetching ranges fails, while it does.
    failing: Option<String>,
}

/// The locks held now.
#[derive(Serialize, ToSchema)]
struct LocksHeld {
    locks: Vec<LockHeld>,
}

/// One lock held: its name (scoped to the caller that holds it), the fence of the holding and
/// when its lease ends. Never its owner.
#[derive(Serialize, ToSchema)]
struct LockHeld {
    name: String,
    fence: u64,
    /// RFC 3339.
    expires_at: String,
}

/// The answer a record replays (records of guarded HTTP routes).
#[derive(Serialize, ToSchema)]
struct StoredAnswer {
    status: u16,
    /// Each header as `[name, value]`.
    headers: Vec<[String; 2]>,
    body_bytes: u64,
    /// The body (at most 64 KiB of it) if it is text; `null` otherwise.
    #[schema(required = true)]
    body: Option<String>,
    body_truncated: bool,
}

/// One recorded step of multi-step work, as an operator sees it: its output by size only.
#[derive(Serialize, ToSchema)]
struct ShownStep {
    step: String,
    outcome: StepOutcomeView,
    /// The size of a `done` step's output.
    #[schema(nullable = false)]
    output_bytes: Option<u64>,
}

/// One live record, with the answer it replays and the steps it recorded.
#[derive(Serialize, ToSchema)]
struct ShownRecordView {
    #[serde(flatten)]
    record: ListedRecord,
    #[schema(nullable = false)]
    answer: Option<StoredAnswer>,
    /// The steps recorded on it, in order.
    steps: Vec<ShownStep>,
}

/// What a repair did.
#[derive(Serialize, ToSchema)]
struct Repaired {
    /// Records repaired.
    applied: u64,
    /// Records left alone: no longer as shown.
    skipped: u64,
}

// The operations. Their bodies are never run: the attributes describe the handlers in `api`,
// `tokens`, `locks`, `ids` and `admin::http`; `Security` adds who may call them and `Errors`
// their problem answers.
#[allow(dead_code)]
mod ops {
    use super::*;

    /// Each component's health.
    #[utoipa::path(get, path = "/healthz", tag = "health",
        responses((status = 200, description = "The store answers.", body = Health)))]
    fn healthz() {}

    /// Claims a key.
    ///
    /// `acquired`: run the work, then `complete` with its response (or `release` after a retryable
    /// failure). `replay`: the work was done; here is its response.
    #[utoipa::path(post, path = "/v1/records/begin", tag = "records", request_body = BeginBody,
        responses((status = 200, description = "Acquired, or a replay.", body = BeginAnswer)))]
    fn begin() {}

    /// Records a step of multi-step work under the lease.
    ///
    /// A finished step with its `output`, or `"unknown": true` for one that sent a request and
    /// got no answer. An attempt that takes the key over later gets the recorded steps in
    /// `begin`'s answer and resumes after them.
    #[utoipa::path(post, path = "/v1/records/step", tag = "records", request_body = StepBody,
        responses((status = 200, description = "Recorded.", body = StepRecorded)))]
    fn step() {}

    /// Stores the response under the lease.
    #[utoipa::path(post, path = "/v1/records/complete", tag = "records", request_body = CompleteBody,
        responses((status = 200, description = "Completed.", body = Settled)))]
    fn complete() {}

    /// Gives the key back after a retryable failure.
    #[utoipa::path(post, path = "/v1/records/release", tag = "records",
        request_body = RecordReleaseBody,
        responses((status = 200, description = "Released.", body = Settled)))]
    fn release() {}

    /// The caller's record under a key.
    #[utoipa::path(get, path = "/v1/records/{namespace}/{key}", tag = "records",
        params(
            ("namespace" = String, Path, pattern = "^[A-Za-z0-9._:-]{1,128}$",
                description = "The namespace of the key."),
            ("key" = String, Path, pattern = "^[!-~]{1,255}$", description = "The idempotency key."),
        ),
        responses((status = 200, description = "The live record.", body = RecordView)))]
    fn get_record() {}

    /// Issues a one-time token.
    #[utoipa::path(post, path = "/v1/tokens", tag = "tokens", request_body = IssueBody,
        responses((status = 201, description = "Issued.", body = IssuedToken)))]
    fn issue_token() {}

    /// Consumes a one-time token: it succeeds once.
    #[utoipa::path(post, path = "/v1/tokens/consume", tag = "tokens", request_body = ConsumeBody,
        responses((status = 200, description = "Consumed.", body = Consumed)))]
    fn consume_token() {}

    /// Acquires a lock, waiting up to `wait_ms`.
    #[utoipa::path(post, path = "/v1/locks/{name}/acquire", tag = "locks", request_body = AcquireBody,
        params(("name" = String, Path, pattern = "^[!-~]{1,128}$",
            description = "The lock's name: 1 to 128 visible ASCII characters.")),
        responses((status = 200, description = "Held.", body = Holding)))]
    fn acquire_lock() {}

    /// Renews a holding.
    #[utoipa::path(post, path = "/v1/locks/{name}/renew", tag = "locks", request_body = RenewBody,
        params(("name" = String, Path, pattern = "^[!-~]{1,128}$", description = "The lock's name.")),
        responses((status = 200, description = "Renewed.", body = Holding)))]
    fn renew_lock() {}

    /// Releases a holding; repeating it succeeds.
    #[utoipa::path(post, path = "/v1/locks/{name}/release", tag = "locks",
        request_body = LockReleaseBody,
        params(("name" = String, Path, pattern = "^[!-~]{1,128}$", description = "The lock's name.")),
        responses((status = 200, description = "Released.", body = LockReleased)))]
    fn release_lock() {}

    /// UUIDv7 ids.
    #[utoipa::path(get, path = "/v1/ids/uuid7", tag = "ids",
        params(("count" = Option<u32>, Query, minimum = 1, maximum = 1000,
            description = "How many ids (default 1).")),
        responses((status = 200, description = "The ids.", body = Uuid7Ids)))]
    fn uuid7() {}

    /// Snowflake ids, from the worker id the server leases from its store.
    #[utoipa::path(get, path = "/v1/ids/snowflake", tag = "ids",
        params(("count" = Option<u32>, Query, minimum = 1, maximum = 1000,
            description = "How many ids (default 1).")),
        responses((status = 200, description = "The ids.", body = SnowflakeIds)))]
    fn snowflake() {}

    /// Ids from the caller's own sequence `tag`, increasing per server.
    #[utoipa::path(get, path = "/v1/ids/segment/{tag}", tag = "ids",
        params(
            ("tag" = String, Path, description = "The sequence's name."),
            ("count" = Option<u32>, Query, minimum = 1, maximum = 1000,
                description = "How many ids (default 1)."),
        ),
        responses((status = 200, description = "The ids.", body = SegmentIds)))]
    fn segment() {}

    /// This document.
    #[utoipa::path(get, path = "/openapi.json", tag = "health",
        responses((status = 200, description = "The OpenAPI document.", body = Object)))]
    fn openapi_json() {}

    /// Each component's health (as `/healthz`).
    #[utoipa::path(get, path = "/_idem/health", tag = "health",
        responses((status = 200, description = "The store answers.", body = Health)))]
    fn admin_health() {}

    /// The server's metrics, in the Prometheus text format.
    #[utoipa::path(get, path = "/_idem/metrics", tag = "health",
        responses((status = 200, description = "The metrics.", body = String,
            content_type = "text/plain")))]
    fn admin_metrics() {}

    /// The admin page (it signs in with the admin token).
    #[utoipa::path(get, path = "/_idem", tag = "admin",
        responses((status = 200, description = "The page.", body = String, content_type = "text/html")))]
    fn admin_page() {}

    /// Redirects to the admin page.
    #[utoipa::path(get, path = "/_idem/", tag = "admin",
        responses((status = 308, description = "To `/_idem`.")))]
    fn admin_page_slash() {}

    /// The admin page's script.
    #[utoipa::path(get, path = "/_idem/assets/app.js", tag = "admin",
        responses((status = 200, description = "The script.", body = String,
            content_type = "text/javascript")))]
    fn admin_script() {}

    /// The admin page's style sheet.
    #[utoipa::path(get, path = "/_idem/assets/app.css", tag = "admin",
        responses((status = 200, description = "The style sheet.", body = String,
            content_type = "text/css")))]
    fn admin_style() {}

    /// One page of records, with the cursor of the next.
    #[utoipa::path(get, path = "/_idem/records", tag = "admin", params(ListQuery),
        responses((status = 200, description = "The page.", body = RecordPage)))]
    fn records_list() {}

    /// Records by state, unknown outcomes, the oldest attempt's age.
    #[utoipa::path(get, path = "/_idem/records/counts", tag = "admin", params(CountQuery),
        responses((status = 200, description = "The counts.", body = Counts)))]
    fn records_counts() {}

    /// One live record, with the answer it replays.
    #[utoipa::path(get, path = "/_idem/records/show", tag = "admin", params(ShowQuery),
        responses((status = 200, description = "The record.", body = ShownRecordView)))]
    fn records_show() {}

    /// The counts taken in the background, oldest first.
    #[utoipa::path(get, path = "/_idem/records/history", tag = "admin",
        responses((status = 200, description = "The samples.", body = CountsHistory)))]
    fn records_history() {}

    /// The segment tags this server holds for its callers, with their runway.
    #[utoipa::path(get, path = "/_idem/segments", tag = "admin",
        responses((status = 200, description = "The tags.", body = SegmentTags)))]
    fn segments() {}

    /// The locks held now (at most 1000, by name).
    #[utoipa::path(get, path = "/_idem/locks", tag = "admin",
        responses((status = 200, description = "The locks.", body = LocksHeld)))]
    fn locks_held() {}

    /// Repairs records that are still as they were shown.
    #[utoipa::path(post, path = "/_idem/records/repair", tag = "admin", request_body = RepairBody,
        responses((status = 200, description = "What was done.", body = Repaired)))]
    fn records_repair() {}
}

use ProblemCode as P;

/// A caller the API keys do not know.
const AUTH: &[P] = &[P::Unauthorized];
/// A JSON body that cannot be read.
const BODY: &[P] = &[
    P::UnsupportedMediaType,
    P::MalformedJson,
    P::InvalidRequest,
    P::BodyTooLarge,
];
/// A path parameter that does not decode.
const PATH: &[P] = &[P::InvalidPath];
/// A store that fails.
const STORE: &[P] = &[P::StoreUnavailable, P::StoreError, P::StoreFull];
/// The record tools' gate.
const ADMIN: &[P] = &[
    P::Unauthorized,
    P::AdminDisabled,
    P::RecordToolsUnsupported,
    P::InvalidRequest,
];
/// A count of ids.
const COUNT: &[P] = &[P::InvalidCount, P::InvalidRequest];

/// The problems each operation may answer with, by method and path.
const ERRORS: &[(&str, &str, &[&[P]])] = &[
    ("get", "/healthz", &[&[P::StoreUnavailable]]),
    ("get", "/_idem/health", &[&[P::StoreUnavailable]]),
    (
        "post",
        "/v1/records/begin",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::InvalidKey,
                P::InvalidFingerprint,
                P::InvalidDuration,
                P::InvalidStep,
                P::InProgress,
                P::FingerprintMismatch,
            ],
        ],
    ),
    (
        "post",
        "/v1/records/step",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::InvalidKey,
                P::InvalidLease,
                P::InvalidStep,
                P::StaleLease,
                P::StepConflict,
                P::StepAfterUnknown,
                P::StepsFull,
            ],
        ],
    ),
    (
        "post",
        "/v1/records/complete",
        &[
            AUTH,
            BODY,
            STORE,
            &[P::InvalidKey, P::InvalidLease, P::StaleLease],
        ],
    ),
    (
        "post",
        "/v1/records/release",
        &[
            AUTH,
            BODY,
            STORE,
            &[P::InvalidKey, P::InvalidLease, P::StaleLease],
        ],
    ),
    (
        "get",
        "/v1/records/{namespace}/{key}",
        &[
            AUTH,
            PATH,
            STORE,
            &[P::InvalidKey, P::InvalidRequest, P::NotFound],
        ],
    ),
    ("post", "/v1/tokens", &[AUTH, BODY, STORE]),
    (
        "post",
        "/v1/tokens/consume",
        &[
            AUTH,
            BODY,
            STORE,
            &[
                P::TokenAlreadyUsed,
                P::TokenExpired,
                P::TokenWrongPurpose,
                P::TokenUnknown,
            ],
        ],
    ),
    (
        "post",
        "/v1/locks/{name}/acquire",
        &[
            AUTH,
            PATH,
            BODY,
            STORE,
            &[
                P::LocksUnsupported,
                P::InvalidLockName,
                P::InvalidLease,
                P::InvalidWait,
                P::InvalidOwner,
                P::LockHeld,
                P::NotOwner,
                P::LockError,
            ],
        ],
    ),
    (
        "post",
        "/v1/locks/{name}/renew",
        &[
            AUTH,
            PATH,
            BODY,
            STORE,
            &[
                P::LocksUnsupported,
                P::InvalidLockName,
                P::InvalidLease,
                P::InvalidLock,
                P::LockHeld,
                P::NotOwner,
                P::LockError,
            ],
        ],
    ),
    (
        "post",
        "/v1/locks/{name}/release",
        &[
            AUTH,
            PATH,
            BODY,
            STORE,
            &[
                P::LocksUnsupported,
                P::InvalidLockName,
                P::InvalidLock,
                P::LockHeld,
                P::NotOwner,
                P::LockError,
            ],
        ],
    ),
    ("get", "/v1/ids/uuid7", &[AUTH, COUNT]),
    (
        "get",
        "/v1/ids/snowflake",
        &[
            AUTH,
            COUNT,
            &[
                P::NoWorkerId,
                P::WorkerLeaseExpired,
                P::WorkerLost,
                P::IdsUnavailable,
                P::IdsBusy,
            ],
        ],
    ),
    (
        "get",
        "/v1/ids/segment/{tag}",
        &[
            AUTH,
            PATH,
            COUNT,
            STORE,
            &[P::InvalidTag, P::TagQuotaExceeded, P::TooManyTags],
        ],
    ),
    ("get", "/_idem/records", &[ADMIN, STORE]),
    ("get", "/_idem/records/counts", &[ADMIN, STORE]),
    (
        "get",
        "/_idem/records/show",
        &[ADMIN, STORE, &[P::RecordNotFound]],
    ),
    ("get", "/_idem/records/history", &[ADMIN]),
    (
        "get",
        "/_idem/segments",
        &[&[P::Unauthorized, P::AdminDisabled]],
    ),
    (
        "get",
        "/_idem/locks",
        &[
            &[P::Unauthorized, P::AdminDisabled, P::LocksUnsupported],
            STORE,
        ],
    ),
    // With --metrics-require-token.
    (
        "get",
        "/_idem/metrics",
        &[&[P::Unauthorized, P::AdminDisabled]],
    ),
    ("post", "/_idem/records/repair", &[ADMIN, BODY, STORE]),
];

/// Adds each operation's problem answers from [`ERRORS`]: one response a status, whose `code`
/// is one of those the operation answers with at that status.
struct Errors;

impl Modify for Errors {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        for (method, path, groups) in ERRORS {
            let Some(op) = doc
                .paths
                .paths
                .get_mut(*path)
                .and_then(|item| operation(item, method))
            else {
                continue;
            };
            let mut by_status: BTreeMap<u16, Vec<P>> = BTreeMap::new();
            for code in groups.iter().flat_map(|g| g.iter()) {
                let codes = by_status.entry(code.status().as_u16()).or_default();
                if !codes.contains(code) {
                    codes.push(*code);
                }
            }
            for (status, codes) in by_status {
                op.responses
                    .responses
                    .insert(status.to_string(), problem_response(status, &codes).into());
            }
        }
    }
}

fn operation<'a>(item: &'a mut PathItem, method: &str) -> Option<&'a mut Operation> {
    match method {
        "get" => item.get.as_mut(),
        "post" => item.post.as_mut(),
        _ => None,
    }
}

/// A problem+json response of `status` whose `code` is one of `codes`.
fn problem_response(status: u16, codes: &[P]) -> utoipa::openapi::Response {
    let description = codes
        .iter()
        .map(|c| format!("`{}`: {}", c.as_str(), c.meaning()))
        .collect::<Vec<_>>()
        .join("\n\n");
    let narrowed = ObjectBuilder::new()
        .property(
            "code",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(codes.iter().map(|c| c.as_str()))),
        )
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .enum_values(Some([status])),
        );
    let schema = AllOfBuilder::new()
        .item(Ref::from_schema_name("Problem"))
        .item(narrowed);
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/problem+json",
            ContentBuilder::new().schema(Some(schema)).build(),
        )
        .build()
}
