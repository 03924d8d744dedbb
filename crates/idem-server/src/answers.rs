//! What the JSON API answers, as types: the handlers build these, and the OpenAPI document
//! ([`crate::openapi`]) is derived from the same types, so an answer and its description
//! cannot drift apart. (The record tools' and health answers are `idem-ops`'s own types.)

use std::collections::BTreeMap;

use idem_core::{Bytes, Fingerprint, Key, Lease, Record, Status, Step, step_key};
pub use idem_ops::admin::answers::StepOutcomeView;
use idem_ops::json::rfc3339;
use serde::Serialize;
use serde_json::value::RawValue;
use utoipa::ToSchema;

/// A stored value as an answer shows it: `field` with the JSON it holds, byte for byte as it
/// was stored (numbers as written, members in their order), or `field_text` with its text
/// when it is not JSON (written by another client of the store).
fn stored(bytes: &Bytes) -> (Option<Box<RawValue>>, Option<String>) {
    let json = std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| RawValue::from_string(text.to_owned()).ok());
    match json {
        Some(raw) => (Some(raw), None),
        None => (None, Some(String::from_utf8_lossy(bytes).into_owned())),
    }
}

/// The `lease` of an `acquired` begin.
#[derive(Serialize, ToSchema)]
pub struct LeaseView {
    /// The lease token `complete` and `release` take back.
    id: String,
    /// The fencing token of this attempt.
    fence: u64,
    /// When the lease runs out.
    #[schema(format = DateTime)]
    expires_at: String,
}

/// The outcome of a `begin` that took the key.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AcquiredOutcome {
    /// The key is the caller's.
    Acquired,
}

/// The outcome of a `begin` answered with the stored response.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReplayOutcome {
    /// The key was completed before.
    Replay,
}

/// The key is the caller's: run the work, then `complete` (or `release`).
#[derive(Serialize, ToSchema)]
pub struct Acquired {
    outcome: AcquiredOutcome,
    lease: LeaseView,
    /// The steps earlier attempts recorded, in order (empty on a record's first attempt):
    /// resume after the last one that is `done`.
    steps: Vec<StepView>,
    /// The step key of each step named in the request's `step_keys`.
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    step_keys: Option<BTreeMap<String, String>>,
}

impl Acquired {
    /// `lease` (its token is `token`), with the steps earlier attempts recorded and the step
    /// keys of the steps the request named.
    pub fn new(
        lease: &Lease,
        token: String,
        steps: &[Step],
        key: &Key,
        fingerprint: &Fingerprint,
        step_keys: Option<BTreeMap<String, String>>,
    ) -> Self {
        Self {
            outcome: AcquiredOutcome::Acquired,
            lease: LeaseView {
                id: token,
                fence: lease.fence,
                expires_at: rfc3339(lease.expires_at),
            },
            steps: steps
                .iter()
                .map(|s| StepView::new(s, key, fingerprint))
                .collect(),
            step_keys,
        }
    }
}

/// A recorded step.
#[derive(Serialize, ToSchema)]
pub struct StepView {
    /// Its name.
    step: String,
    /// `done`, with its output, or `unknown`: it sent a request and got no answer.
    outcome: StepOutcomeView,
    /// The idempotency key to send to the service the step calls, the same on every attempt.
    step_key: String,
    /// The output of a `done` step, as it was recorded.
    #[schema(value_type = Value, required = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<Box<RawValue>>,
    /// An output that is not JSON (recorded by another client of the store), as text.
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    output_text: Option<String>,
}

impl StepView {
    /// `step` of the record of `key` made for a request with `fingerprint`.
    pub fn new(step: &Step, key: &Key, fingerprint: &Fingerprint) -> Self {
        let (output, output_text) = step.output().map(stored).unwrap_or_default();
        Self {
            step: step.name.as_str().to_owned(),
            outcome: (&step.outcome).into(),
            step_key: step_key(key, fingerprint, &step.name),
            output,
            output_text,
        }
    }
}

/// A step recorded (or a repeat of one already recorded).
#[derive(Serialize, ToSchema)]
pub struct StepRecorded {
    step: String,
    outcome: StepOutcomeView,
    /// The fence of the lease.
    fence: u64,
}

impl StepRecorded {
    /// `step` recorded under the lease with `fence`.
    pub fn new(step: &Step, fence: u64) -> Self {
        Self {
            step: step.name.as_str().to_owned(),
            outcome: (&step.outcome).into(),
            fence,
        }
    }
}

/// The key was completed before: here is the stored response.
#[derive(Serialize, ToSchema)]
pub struct Replay {
    outcome: ReplayOutcome,
    /// The fence of the attempt that completed it.
    fence: u64,
    /// When it was completed.
    #[schema(format = DateTime)]
    completed_at: String,
    /// The stored response (JSON, as `complete` was given it).
    #[schema(value_type = Value, required = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<Box<RawValue>>,
    /// A stored response that is not JSON (written by another client of the store), as text.
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    response_text: Option<String>,
}

impl From<&idem_core::Replay> for Replay {
    fn from(r: &idem_core::Replay) -> Self {
        let (response, response_text) = stored(&r.response);
        Self {
            outcome: ReplayOutcome::Replay,
            fence: r.fence,
            completed_at: rfc3339(r.completed_at),
            response,
            response_text,
        }
    }
}

/// What `begin` answers.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum BeginAnswer {
    /// The key is the caller's.
    Acquired(Acquired),
    /// The key was completed before.
    Replay(Replay),
}

/// What `renew` answers: the lease with its new end (its token and fence are unchanged).
#[derive(Serialize, ToSchema)]
pub struct Renewed {
    lease: LeaseView,
}

impl Renewed {
    /// `lease` (its token is `token`) with its new end.
    pub fn new(lease: &Lease, token: String) -> Self {
        Self {
            lease: LeaseView {
                id: token,
                fence: lease.fence,
                expires_at: rfc3339(lease.expires_at),
            },
        }
    }
}

/// What became of the record.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SettledStatus {
    /// It holds the response.
    Completed,
    /// The key was given back.
    Released,
}

/// What `complete` and `release` answer.
#[derive(Serialize, ToSchema)]
pub struct Settled {
    /// `completed` or `released`.
    status: SettledStatus,
    /// The fence of the lease.
    fence: u64,
}

impl Settled {
    /// The lease with `fence` completed its record.
    pub fn completed(fence: u64) -> Self {
        Self {
            status: SettledStatus::Completed,
            fence,
        }
    }

    /// The lease with `fence` released its record.
    pub fn released(fence: u64) -> Self {
        Self {
            status: SettledStatus::Released,
            fence,
        }
    }
}

/// A record's status.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecordStatus {
    /// An attempt holds the key (or held it until its lease ran out).
    InProgress,
    /// It holds the response.
    Completed,
    /// The key was given back.
    Released,
}

/// A live record of the caller's.
#[derive(Serialize, ToSchema)]
pub struct RecordView {
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
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_expires_at: Option<String>,
    /// The stored response, for a completed record.
    #[schema(value_type = Value, required = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<Box<RawValue>>,
    /// A stored response that is not JSON, as text.
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    response_text: Option<String>,
    /// The steps recorded on the record, in order.
    steps: Vec<StepView>,
}

impl From<&Record> for RecordView {
    fn from(r: &Record) -> Self {
        let (response, response_text) = r.response.as_ref().map(stored).unwrap_or_default();
        Self {
            namespace: r.key.namespace().as_str().to_owned(),
            key: r.key.client_key().as_str().to_owned(),
            status: match r.status {
                Status::InProgress => RecordStatus::InProgress,
                Status::Completed => RecordStatus::Completed,
                Status::Released => RecordStatus::Released,
            },
            fence: r.fence,
            fingerprint: r.fingerprint.to_hex(),
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            expires_at: rfc3339(r.expires_at),
            lease_expires_at: (r.status == Status::InProgress).then(|| rfc3339(r.lease_expires_at)),
            response,
            response_text,
            steps: r
                .steps
                .iter()
                .map(|s| StepView::new(s, &r.key, &r.fingerprint))
                .collect(),
        }
    }
}

/// A new one-time token.
#[derive(Serialize, ToSchema)]
pub struct IssuedToken {
    token: String,
    #[schema(format = DateTime)]
    expires_at: String,
}

impl From<idem_core::IssuedToken> for IssuedToken {
    fn from(t: idem_core::IssuedToken) -> Self {
        Self {
            token: t.token,
            expires_at: rfc3339(t.expires_at),
        }
    }
}

/// A consumed token.
#[derive(Serialize, ToSchema)]
pub struct Consumed {
    /// Always `true`.
    consumed: bool,
}

impl Consumed {
    /// The one answer.
    pub const YES: Self = Self { consumed: true };
}

/// A lock holding.
#[derive(Serialize, ToSchema)]
pub struct Holding {
    /// The holding's secret handle (`<owner>.<fence>`), for `renew` and `release`.
    lock: String,
    /// The fencing token, to send with every write the lock protects.
    fence: u64,
    #[schema(format = DateTime)]
    expires_at: String,
}

impl Holding {
    /// The holding of `owner`, with `fence`, until `expires_at`.
    pub fn new(owner: &str, fence: u64, expires_at: idem_core::Timestamp) -> Self {
        Self {
            lock: format!("{owner}.{fence}"),
            fence,
            expires_at: rfc3339(expires_at),
        }
    }
}

/// A released lock.
#[derive(Serialize, ToSchema)]
pub struct LockReleased {
    /// Always `true`.
    released: bool,
}

impl LockReleased {
    /// The one answer.
    pub const YES: Self = Self { released: true };
}

/// UUIDv7 ids, strictly increasing.
#[derive(Serialize, ToSchema)]
pub struct Uuid7Ids {
    /// Each a UUID in its hyphenated form.
    pub ids: Vec<String>,
}

/// Snowflake ids, as numbers and as strings (JavaScript loses precision above 2^53).
#[derive(Serialize, ToSchema)]
pub struct SnowflakeIds {
    ids: Vec<u64>,
    id_strings: Vec<String>,
    /// The worker id they were made with.
    worker: u64,
}

impl SnowflakeIds {
    /// `ids`, made with `worker`.
    pub fn new(ids: Vec<u64>, worker: u64) -> Self {
        Self {
            id_strings: ids.iter().map(u64::to_string).collect(),
            ids,
            worker,
        }
    }
}

/// Segment ids, as numbers and as strings.
#[derive(Serialize, ToSchema)]
pub struct SegmentIds {
    ids: Vec<u64>,
    id_strings: Vec<String>,
}

impl From<Vec<u64>> for SegmentIds {
    fn from(ids: Vec<u64>) -> Self {
        Self {
            id_strings: ids.iter().map(u64::to_string).collect(),
            ids,
        }
    }
}

/// The segment tags this server holds for its callers.
#[derive(Serialize, ToSchema)]
pub struct SegmentTags {
    /// Each tag, by scope.
    pub segments: Vec<SegmentTag>,
}

/// One caller's segment tag.
#[derive(Serialize, ToSchema)]
pub struct SegmentTag {
    /// The caller's scope.
    scope: String,
    /// The tag.
    tag: String,
    /// Ids held in memory (the current range and the one ahead).
    remaining: u64,
    /// The size of the next range fetched.
    step: u64,
    /// How long the ids in memory last at the rate served so far (`null` before any was
    /// served).
    runway_seconds: Option<f64>,
    /// Why fetching ranges fails, while it does.
    failing: Option<String>,
}

impl SegmentTag {
    /// A caller's tag: ids left in memory, the next range's size, how long the ids last at the
    /// rate served so far, and why fetching fails, while it does.
    pub fn new(
        scope: String,
        tag: String,
        remaining: u64,
        step: u64,
        runway: Option<std::time::Duration>,
        failing: Option<String>,
    ) -> Self {
        Self {
            scope,
            tag,
            remaining,
            step,
            runway_seconds: runway.map(|d| d.as_secs_f64()),
            failing,
        }
    }
}

/// The locks held now.
#[derive(Serialize, ToSchema)]
pub struct LocksHeld {
    /// Each lock held (at most 1,000).
    pub locks: Vec<LockHeld>,
}

/// One lock held: its name (scoped to the caller that holds it), the fence of the holding and
/// when its lease ends. Never its owner.
#[derive(Serialize, ToSchema)]
pub struct LockHeld {
    name: String,
    fence: u64,
    /// RFC 3339.
    expires_at: String,
}

impl From<&idem_core::HeldLock> for LockHeld {
    fn from(l: &idem_core::HeldLock) -> Self {
        Self {
            name: l.name.as_str().to_owned(),
            fence: l.fence,
            expires_at: rfc3339(l.expires_at),
        }
    }
}
