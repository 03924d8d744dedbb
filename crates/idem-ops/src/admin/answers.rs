//! What the record tools answer, as types: the handlers (and `idem records --json`) build
//! these, and `idem serve`'s OpenAPI document is derived from the same types.

use idem_core::{Listed, Record, StepOutcome, Timestamp};
use idem_http::operator::{self, HttpCounts, RecordState as HttpState, StoredAnswer as Stored};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::records::is_internal;
use crate::json::rfc3339;

/// How much of a stored answer's body the record tools show.
pub const SHOWN_BODY: usize = 64 * 1024;

/// A recorded step's outcome.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepOutcomeView {
    /// It finished, with its output.
    Done,
    /// It sent a request and got no answer.
    Unknown,
}

impl From<&StepOutcome> for StepOutcomeView {
    fn from(o: &StepOutcome) -> Self {
        match o {
            StepOutcome::Done(_) => Self::Done,
            StepOutcome::Unknown => Self::Unknown,
        }
    }
}

/// A record as the record tools list it.
#[derive(Serialize, ToSchema)]
pub struct ListedRecord {
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
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    /// Until when an unknown outcome is held (`unknown`; `null`: until someone resolves it).
    #[schema(value_type = Option<String>, format = DateTime)]
    #[serde(skip_serializing_if = "Option::is_none")]
    until: Option<Option<String>>,
    /// One of idem's own records (scope `idem.…`, such as a server's Snowflake worker lease):
    /// listed, never repaired.
    internal: bool,
}

impl From<&Listed> for ListedRecord {
    fn from(l: &Listed) -> Self {
        let http = operator::listed_state(l);
        let (status, until) = match http {
            HttpState::Stored { status } | HttpState::TooLarge { status } => {
                (Some(status.as_u16()), None)
            }
            HttpState::Unknown { until } => (None, Some(until.map(rfc3339))),
            _ => (None, None),
        };
        Self {
            scope: l.key.scope().as_str().to_owned(),
            namespace: l.key.namespace().as_str().to_owned(),
            key: l.key.client_key().as_str().to_owned(),
            state: l.state.as_str().to_owned(),
            kind: http.name().to_owned(),
            fence: l.fence,
            created_at: rfc3339(l.created_at),
            updated_at: rfc3339(l.updated_at),
            lease_expires_at: rfc3339(l.lease_expires_at),
            expires_at: rfc3339(l.expires_at),
            response_bytes: l.response_len,
            status,
            until,
            internal: is_internal(&l.key),
        }
    }
}

/// One page of records.
#[derive(Serialize, ToSchema)]
pub struct RecordPage {
    /// The page's records, in key order (keyspace order on Redis).
    pub records: Vec<ListedRecord>,
    /// The cursor of the page after this one (`after`); `null` on the last page.
    #[schema(required = true)]
    pub next: Option<String>,
}

/// Records by state.
#[derive(Serialize, ToSchema)]
pub struct Counts {
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

impl Counts {
    /// `c`, with the oldest attempt's age at `now`.
    pub fn new(c: &HttpCounts, now: Timestamp) -> Self {
        let r = &c.records;
        Self {
            in_progress: r.in_progress,
            stuck: r.stuck,
            completed: r.completed,
            unknown: c.unknown,
            released: r.released,
            expired: r.expired,
            total: r.total(),
            oldest_in_progress_seconds: r
                .oldest_in_progress
                .map(|t| now.saturating_since(t).as_secs_f64()),
        }
    }
}

/// Counts taken in the background at one time.
#[derive(Serialize, ToSchema)]
pub struct Sample {
    /// When, in milliseconds since the Unix epoch.
    at: u64,
    in_progress: u64,
    stuck: u64,
    completed: u64,
    unknown: u64,
    released: u64,
    expired: u64,
}

impl Sample {
    /// `c`, counted at `at`.
    pub fn new(at: Timestamp, c: &HttpCounts) -> Self {
        Self {
            at: at.as_millis(),
            in_progress: c.records.in_progress,
            stuck: c.records.stuck,
            completed: c.records.completed,
            unknown: c.unknown,
            released: c.records.released,
            expired: c.records.expired,
        }
    }
}

/// The counts taken in the background, oldest first.
#[derive(Serialize, ToSchema)]
pub struct CountsHistory {
    /// How often counts are taken.
    pub every_seconds: u64,
    /// The samples, oldest first.
    pub samples: Vec<Sample>,
}

/// The answer a record replays (records of guarded HTTP routes).
#[derive(Serialize, ToSchema)]
pub struct StoredAnswer {
    status: u16,
    /// Each header as `[name, value]`.
    headers: Vec<[String; 2]>,
    body_bytes: u64,
    /// The body (at most 64 KiB of it) if it is text; `null` otherwise.
    #[schema(required = true)]
    body: Option<String>,
    body_truncated: bool,
}

impl From<&Stored> for StoredAnswer {
    fn from(answer: &Stored) -> Self {
        let mut shown = &answer.body[..answer.body.len().min(SHOWN_BODY)];
        // Cut at a character's end: a text body longer than the limit is still text.
        if let Err(e) = std::str::from_utf8(shown)
            && e.error_len().is_none()
        {
            shown = &shown[..e.valid_up_to()];
        }
        Self {
            status: answer.status.as_u16(),
            headers: answer
                .headers
                .iter()
                .map(|(name, value)| {
                    [
                        name.as_str().to_owned(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    ]
                })
                .collect(),
            body_bytes: answer.body.len() as u64,
            // Text is shown as it is; other bodies by their size only.
            body: std::str::from_utf8(shown).ok().map(str::to_owned),
            body_truncated: answer.body.len() > SHOWN_BODY,
        }
    }
}

/// One recorded step of multi-step work, as an operator sees it: its output by size only.
#[derive(Serialize, ToSchema)]
pub struct ShownStep {
    step: String,
    outcome: StepOutcomeView,
    /// The size of a `done` step's output.
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    output_bytes: Option<u64>,
}

impl ShownStep {
    /// A record's steps as an operator sees them: name, outcome, and a finished step's
    /// output by its size only (outputs are the work's data).
    pub fn of(record: &Record) -> Vec<Self> {
        record
            .steps
            .iter()
            .map(|s| Self {
                step: s.name.as_str().to_owned(),
                outcome: (&s.outcome).into(),
                output_bytes: s.output().map(|o| o.len() as u64),
            })
            .collect()
    }
}

/// One live record, with the answer it replays and the steps it recorded.
#[derive(Serialize, ToSchema)]
pub struct ShownRecordView {
    #[serde(flatten)]
    record: ListedRecord,
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    answer: Option<StoredAnswer>,
    /// The steps recorded on it, in order.
    steps: Vec<ShownStep>,
}

impl ShownRecordView {
    /// `record` as shown at `now`.
    pub fn new(record: &Record, now: Timestamp) -> Self {
        Self {
            record: (&idem_core::Listed::of(record, now)).into(),
            answer: operator::stored_answer(record).as_ref().map(Into::into),
            steps: ShownStep::of(record),
        }
    }
}

/// A listed record as JSON: its key, its state in the store and in HTTP terms, its fence, its
/// times, its stored answer's size, and whether it is idem's own ([`is_internal`]).
pub fn listed_json(l: &Listed) -> Value {
    json!(ListedRecord::from(l))
}

/// A record's steps as an operator sees them: name, outcome, and a finished step's output by
/// its size only (outputs are the work's data).
pub fn steps_json(record: &Record) -> Value {
    json!(ShownStep::of(record))
}

/// Counts as JSON: each state, the unknown outcomes, and the oldest attempt's age in seconds.
pub fn counts_json(c: &HttpCounts, now: Timestamp) -> Value {
    json!(Counts::new(c, now))
}
