//! RFC 9457 problem details: every error the API returns.
//!
//! Each problem has a stable machine-readable `code` (also in `type` as
//! `urn:idem:problem:<code>`), a short `title`, and a `detail` sentence for people. Details
//! never contain keys, tokens or bodies. idem's own codes are in one catalogue,
//! [`ProblemCode`]; [`Problem::new`] is for a service's own.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::{Map, Value, json};

use idem_wire::ProblemCode;

/// A [`Problem`] from a code of idem's catalogue: `ProblemCode::NotFound.problem("…")`.
pub trait ToProblem {
    /// A problem with this code, its status and title, and `detail` for people.
    fn problem(self, detail: impl Into<String>) -> Problem;
}

impl ToProblem for ProblemCode {
    fn problem(self, detail: impl Into<String>) -> Problem {
        Problem::new(self.status(), self.as_str(), self.title(), detail)
    }
}

/// An error answer.
#[derive(Debug)]
pub struct Problem {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) extra: Map<String, Value>,
}

impl Problem {
    /// A problem with a status, a stable code, a title and a detail sentence. For idem's own
    /// codes, [`ProblemCode::problem`].
    pub fn new(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            code,
            title,
            detail: detail.into(),
            retry_after: None,
            extra: Map::new(),
        }
    }

    /// Adds a `Retry-After` header (whole seconds, rounded up) and a `retry_after_ms` member.
    #[must_use]
    pub fn retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// Replaces the stable code.
    #[must_use]
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = code;
        self
    }

    /// Replaces the status (for a code whose status depends on configuration).
    #[must_use]
    pub(crate) fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds an extension member.
    #[must_use]
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(name.to_owned(), value.into());
        self
    }

    /// 400 `invalid_request`.
    pub fn invalid_request(detail: impl Into<String>) -> Self {
        ProblemCode::InvalidRequest.problem(detail)
    }

    /// 404 `not_found`.
    pub fn not_found(detail: impl Into<String>) -> Self {
        ProblemCode::NotFound.problem(detail)
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable code.
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// 503 for a store failure: the work must not run. The store's own message (which may
    /// name a database user or host) is logged, not sent to the client.
    pub fn store(e: &idem_core::StoreError) -> Self {
        if let idem_core::StoreError::Invalid(e) = e {
            return Self::invalid_request(format!("{e}."));
        }
        if let idem_core::StoreError::Full { .. } = e {
            tracing::warn!(error = %e, "the record store is full; answered store_full");
            return ProblemCode::StoreFull
                .problem(
                    "The record store holds as many records as it may, so nothing was done; \
                     try again later.",
                )
                .retry_after(Duration::from_secs(1));
        }
        let (code, detail) = if e.is_transient() {
            (
                ProblemCode::StoreUnavailable,
                "The record store cannot be reached, so nothing was done; try again shortly.",
            )
        } else {
            (
                ProblemCode::StoreError,
                "The record store failed, so nothing was done; the server's log says why.",
            )
        };
        tracing::warn!(error = %e, "the record store failed; answered {}", code.as_str());
        code.problem(detail)
    }
}

impl Problem {
    /// The problem as an HTTP response with an `application/problem+json` body.
    pub fn into_http<B: From<Bytes>>(self) -> Response<B> {
        let mut body = json!({
            "type": format!("urn:idem:problem:{}", self.code),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "code": self.code,
        });
        if let (Some(obj), Some(d)) = (body.as_object_mut(), self.retry_after) {
            obj.insert(
                "retry_after_ms".into(),
                u64::try_from(d.as_millis()).unwrap_or(u64::MAX).into(),
            );
        }
        if let Some(obj) = body.as_object_mut() {
            obj.extend(self.extra);
        }
        let mut res = Response::new(B::from(Bytes::from(body.to_string())));
        *res.status_mut() = self.status;
        let headers = res.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(d) = self.retry_after {
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        res
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        self.into_http()
    }
}
