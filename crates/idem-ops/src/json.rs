//! Request bodies and path parameters: bodies bounded and JSON only, and every rejection a
//! problem+json (axum's own extractors answer `text/plain`); and instants as answers show them.

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use idem_core::Timestamp;
use idem_http::{Problem, ProblemCode, ToProblem};

/// A JSON request body of at most [`BodyLimit::max_body`] bytes.
pub struct JsonBody<T>(pub T);

/// A handler state that bounds request bodies.
pub trait BodyLimit {
    /// The largest request body accepted, in bytes.
    fn max_body(&self) -> usize;
}

impl<T: DeserializeOwned, S: BodyLimit + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = Problem;

    async fn from_request(req: Request<Body>, state: &S) -> Result<Self, Problem> {
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|m| {
                let m = m.trim().to_ascii_lowercase();
                m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
            })
            .unwrap_or(false);
        if !is_json {
            return Err(ProblemCode::UnsupportedMediaType
                .problem("The body must be JSON, sent with `Content-Type: application/json`."));
        }
        let limit = state.max_body();
        let too_large = || {
            ProblemCode::BodyTooLarge
                .problem(format!(
                    "The body is larger than the limit of {limit} bytes."
                ))
                .with("limit_bytes", limit)
        };
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let bytes = axum::body::to_bytes(req.into_body(), limit)
            .await
            .map_err(|_| too_large())?;
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| {
            use serde_json::error::Category;
            match e.classify() {
                Category::Syntax | Category::Eof | Category::Io => {
                    ProblemCode::MalformedJson.problem(format!("The body is not valid JSON: {e}."))
                }
                Category::Data => Problem::invalid_request(shape_error(&e)),
            }
        })
    }
}

/// The route's path parameters, as [`axum::extract::Path`] takes them, refused with a
/// problem+json: 400 `invalid_path` for a parameter that does not decode (percent-encoded
/// bytes that are not UTF-8, as in `/v1/locks/%FF/acquire`).
pub struct PathParams<T>(pub T);

impl<T, S> FromRequestParts<S> for PathParams<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(PathParams(value)),
            Err(e) => Err(path_problem(&e)),
        }
    }
}

/// The problem for a path that does not fit its route. Its detail names no part of the path:
/// the parameters are the caller's keys and names.
fn path_problem(e: &PathRejection) -> Problem {
    let status = e.status();
    if status.is_server_error() {
        // A route whose handler takes parameters the route does not have: idem's own bug.
        tracing::error!(error = %e, "path parameters do not fit the route");
        return ProblemCode::InternalError
            .problem("The server could not read this route's parameters.");
    }
    ProblemCode::InvalidPath
        .problem("A path segment does not decode: percent-encoded bytes must make UTF-8 text.")
}

/// Describes a body of the wrong shape without repeating the values it holds: serde's messages
/// quote the offending value (`invalid type: string "…"`), and a body may carry secrets.
fn shape_error(e: &serde_json::Error) -> String {
    let message = e.to_string();
    let names_a_field = ["missing field", "unknown field", "duplicate field"]
        .iter()
        .any(|p| message.starts_with(p));
    let what = if names_a_field {
        // Field names are the API's own (or, for an unknown field, the caller's member name).
        message
            .split(" at line ")
            .next()
            .unwrap_or_default()
            .to_owned()
    } else {
        "a member has the wrong type or value".to_owned()
    };
    format!(
        "The body does not have the expected shape: {what} (line {}, column {}).",
        e.line(),
        e.column()
    )
}

/// The last instant RFC 3339 can write (9999-12-31T23:59:59.999Z); later ones, which only a
/// library caller with an enormous TTL can make, are shown as that.
const LAST_RFC3339: Timestamp = Timestamp::from_millis(253_402_300_799_999);

/// `t` in RFC 3339 with milliseconds, as every answer shows an instant.
pub fn rfc3339(t: Timestamp) -> String {
    humantime::format_rfc3339_millis(t.min(LAST_RFC3339).to_system_time()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_errors_do_not_repeat_values() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct B {
            key: String,
            n: Option<u64>,
        }
        let err = |body: &str| shape_error(&serde_json::from_str::<B>(body).unwrap_err());
        let m = err(r#"{"key": 4111111111111111}"#);
        assert!(!m.contains("4111"), "{m}");
        let m = err(r#"{"key": "k", "n": "tok-SECRET"}"#);
        assert!(!m.contains("SECRET"), "{m}");
        assert!(err(r#"{}"#).contains("missing field `key`"));
        assert!(err(r#"{"key": "k", "x": 1}"#).contains("unknown field `x`"));
    }
}
