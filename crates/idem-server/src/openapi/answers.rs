//! The one answer described here rather than derived: the problem body, which
//! `idem_http::Problem` writes (that crate does not depend on an OpenAPI library).

use serde::Serialize;
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
