//! Request bodies: bounded, JSON only, with every rejection a problem+json.

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use crate::AppState;
use crate::problem::Problem;

/// A JSON request body of at most `AppState::max_body` bytes.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = Problem;

    async fn from_request(req: Request<Body>, state: &AppState) -> Result<Self, Problem> {
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
            return Err(Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "Unsupported media type",
                "The body must be JSON, sent with `Content-Type: application/json`.",
            ));
        }
        let limit = state.max_body;
        let too_large = || {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "Body too large",
                format!("The body is larger than the limit of {limit} bytes."),
            )
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
                Category::Syntax | Category::Eof | Category::Io => Problem::new(
                    StatusCode::BAD_REQUEST,
                    "malformed_json",
                    "Malformed JSON",
                    format!("The body is not valid JSON: {e}."),
                ),
                Category::Data => Problem::invalid_request(format!(
                    "The body does not have the expected shape: {e}."
                )),
            }
        })
    }
}
