//! The operations. Their bodies are never run: the attributes describe the handlers in
//! `api`, `tokens`, `locks`, `ids` and `admin::http`; `Security` adds who may call them and
//! `Errors` their problem answers.
#![allow(dead_code)]

use crate::api::{
    BeginBody, CompleteBody, ReleaseBody as RecordReleaseBody, RenewBody as RecordRenewBody,
    StepBody,
};
use crate::locks::{AcquireBody, ReleaseBody as LockReleaseBody, RenewBody as LockRenewBody};
use crate::tokens::{ConsumeBody, IssueBody};
use idem_ops::admin::http::{CountQuery, ListQuery, RepairBody, ShowQuery};

use crate::answers::*;
use idem_ops::admin::answers::*;
use idem_ops::admin::records::Repaired;
use idem_ops::health::Health;

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

/// Extends the lease of long work.
///
/// From now, by `lease_ms` (the server's default lease without it), so that no other attempt
/// takes the key over while the work runs. 409 `stale_lease` once another attempt holds the
/// key or the record was settled.
#[utoipa::path(post, path = "/v1/records/renew", tag = "records", request_body = RecordRenewBody,
    responses((status = 200, description = "Renewed.", body = Renewed)))]
fn renew() {}

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
#[utoipa::path(post, path = "/v1/locks/{name}/renew", tag = "locks", request_body = LockRenewBody,
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
