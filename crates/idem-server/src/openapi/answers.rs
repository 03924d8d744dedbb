//! The answers' schemas: what the handlers write with `json!`, described as types.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

/// Every answer of the API's error responses.
#[derive(Serialize, ToSchema)]
#[schema(
    title = "Problem",
    description = "An RFC 9457 problem (`application/problem+json`). Some codes add members: \
                   `retry_after_ms` (with a `Retry-After` header), `limit_bytes`, `held_until`, \
                   `applied` and `skipped`."
)]
pub(super) struct Problem {
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
pub(super) struct LeaseView {
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
pub(super) enum AcquiredOutcome {
    Acquired,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
pub(super) enum ReplayOutcome {
    Replay,
}

/// The key is the caller's: run the work, then `complete` (or `release`).
#[derive(Serialize, ToSchema)]
pub(super) struct Acquired {
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
pub(super) enum StepOutcomeView {
    Done,
    Unknown,
}

/// A recorded step.
#[derive(Serialize, ToSchema)]
pub(super) struct StepView {
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
pub(super) struct StepRecorded {
    step: String,
    outcome: StepOutcomeView,
    /// The fence of the lease.
    fence: u64,
}

/// The key was completed before: here is the stored response.
#[derive(Serialize, ToSchema)]
pub(super) struct Replay {
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
pub(super) enum BeginAnswer {
    Acquired(Acquired),
    Replay(Replay),
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
pub(super) enum SettledStatus {
    Completed,
    Released,
}

/// What `complete` and `release` answer.
#[derive(Serialize, ToSchema)]
pub(super) struct Settled {
    /// `completed` or `released`.
    status: SettledStatus,
    /// The fence of the lease.
    fence: u64,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
pub(super) enum RecordStatus {
    InProgress,
    Completed,
    Released,
}

/// A live record of the caller's.
#[derive(Serialize, ToSchema)]
pub(super) struct RecordView {
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
pub(super) struct IssuedToken {
    token: String,
    #[schema(format = DateTime)]
    expires_at: String,
}

/// A consumed token.
#[derive(Serialize, ToSchema)]
pub(super) struct Consumed {
    /// Always `true`.
    consumed: bool,
}

/// A lock holding.
#[derive(Serialize, ToSchema)]
pub(super) struct Holding {
    /// The holding's secret handle (`<owner>.<fence>`), for `renew` and `release`.
    lock: String,
    /// The fencing token, to send with every write the lock protects.
    fence: u64,
    #[schema(format = DateTime)]
    expires_at: String,
}

/// A released lock.
#[derive(Serialize, ToSchema)]
pub(super) struct LockReleased {
    /// Always `true`.
    released: bool,
}

/// UUIDv7 ids, strictly increasing.
#[derive(Serialize, ToSchema)]
pub(super) struct Uuid7Ids {
    /// Each a UUID in its hyphenated form.
    ids: Vec<String>,
}

/// Snowflake ids, as numbers and as strings (JavaScript loses precision above 2^53).
#[derive(Serialize, ToSchema)]
pub(super) struct SnowflakeIds {
    ids: Vec<u64>,
    id_strings: Vec<String>,
    /// The worker id they were made with.
    worker: u64,
}

/// Segment ids, as numbers and as strings.
#[derive(Serialize, ToSchema)]
pub(super) struct SegmentIds {
    ids: Vec<u64>,
    id_strings: Vec<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
// Described here, never built: the handlers write these answers with `json!`.
#[allow(dead_code)]
pub(super) enum Level {
    Ok,
    Degraded,
    Down,
}

/// One component's health; components may add members of their own.
#[derive(Serialize, ToSchema)]
pub(super) struct ComponentHealth {
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
pub(super) struct Health {
    /// `ok`, or `degraded` if a component other than the store is not `ok`.
    status: Level,
    /// The store's kind (`memory`, `sqlite`, …).
    store: String,
    /// Each component by name (`store` always).
    components: BTreeMap<String, ComponentHealth>,
}

/// A record as the record tools list it.
#[derive(Serialize, ToSchema)]
pub(super) struct ListedRecord {
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
    /// One of idem's own records (scope `idem.…`, such as a server's Snowflake worker lease):
    /// listed, never repaired.
    internal: bool,
}

/// One page of records.
#[derive(Serialize, ToSchema)]
pub(super) struct RecordPage {
    records: Vec<ListedRecord>,
    /// The cursor of the page after this one (`after`); `null` on the last page.
    #[schema(required = true)]
    next: Option<String>,
}

/// Records by state.
#[derive(Serialize, ToSchema)]
pub(super) struct Counts {
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
pub(super) struct Sample {
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
pub(super) struct CountsHistory {
    /// How often counts are taken.
    every_seconds: u64,
    samples: Vec<Sample>,
}

/// The segment tags this server holds for its callers.
#[derive(Serialize, ToSchema)]
pub(super) struct SegmentTags {
    segments: Vec<SegmentTag>,
}

/// One caller's segment tag.
#[derive(Serialize, ToSchema)]
pub(super) struct SegmentTag {
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
pub(super) struct LocksHeld {
    locks: Vec<LockHeld>,
}

/// One lock held: its name (scoped to the caller that holds it), the fence of the holding and
/// when its lease ends. Never its owner.
#[derive(Serialize, ToSchema)]
pub(super) struct LockHeld {
    name: String,
    fence: u64,
    /// RFC 3339.
    expires_at: String,
}

/// The answer a record replays (records of guarded HTTP routes).
#[derive(Serialize, ToSchema)]
pub(super) struct StoredAnswer {
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
pub(super) struct ShownStep {
    step: String,
    outcome: StepOutcomeView,
    /// The size of a `done` step's output.
    #[schema(nullable = false)]
    output_bytes: Option<u64>,
}

/// One live record, with the answer it replays and the steps it recorded.
#[derive(Serialize, ToSchema)]
pub(super) struct ShownRecordView {
    #[serde(flatten)]
    record: ListedRecord,
    #[schema(nullable = false)]
    answer: Option<StoredAnswer>,
    /// The steps recorded on it, in order.
    steps: Vec<ShownStep>,
}

/// What a repair did.
#[derive(Serialize, ToSchema)]
pub(super) struct Repaired {
    /// Records repaired.
    applied: u64,
    /// Records left alone: no longer as shown.
    skipped: u64,
}
