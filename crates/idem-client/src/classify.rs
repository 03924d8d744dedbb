//! Which answers are kept, which are retried, and which end the call.

use std::time::{Duration, SystemTime};

use http_body_util::{BodyExt, Limited};
use reqwest::header::{CONTENT_LENGTH, CONTENT_TYPE};
use reqwest::{Response, Url};
use reqwest::{ResponseBuilderExt, StatusCode};

use crate::outcome::Last;
use crate::policy::retry_after;

/// What to do with an attempt's answer.
pub(crate) enum Verdict {
    /// An answer to give the caller.
    Keep(Response),
    /// Try again (if the request may be), not before `after` if the server said so.
    Retry { last: Last, after: Option<Duration> },
    /// 409 `outcome_unknown`.
    Unknown { detail: Option<String> },
    /// The key was used with another request.
    Mismatch {
        status: StatusCode,
        detail: Option<String>,
    },
}

/// The largest problem document read to tell a 400, 409 or 422 apart. Larger bodies (and
/// bodies of unknown length) are left unread, and the answer is judged by its status and
/// headers alone.
const PROBLEM_LIMIT: usize = 64 * 1024;

/// Judges one answer.
///
/// Retried: 408, 425, 429 and every 5xx but 501 and 505 (which a retry does not change), and
/// a 409 that says a request with the key is still in progress: by its problem code
/// (`request_in_progress`, `in_progress`), by Stripe's `idempotency_error`, or, for a 409
/// without a problem document, by a `Retry-After`.
pub(crate) async fn classify(response: Response) -> Verdict {
    let status = response.status();
    let after = retry_after(response.headers(), SystemTime::now());
    match status.as_u16() {
        408 | 425 | 429 => retry(response, after),
        501 | 505 => Verdict::Keep(response),
        500..=599 => retry(response, after),
        400 | 409 | 422 => {
            let (response, problem) = match read_problem(response).await {
                Ok(read) => read,
                // The body broke off: as if the connection had.
                Err(e) => {
                    return Verdict::Retry {
                        last: Last::Transport(e),
                        after: None,
                    };
                }
            };
            match (status.as_u16(), problem.kind()) {
                (409, Kind::InProgress | Kind::Stripe) => retry(response, after),
                (409, Kind::Unknown) => Verdict::Unknown {
                    detail: problem.detail,
                },
                (400 | 422, Kind::Mismatch | Kind::Stripe) => Verdict::Mismatch {
                    status,
                    detail: problem.detail,
                },
                (409, Kind::None) if !problem.read && after.is_some() => retry(response, after),
                _ => Verdict::Keep(response),
            }
        }
        _ => Verdict::Keep(response),
    }
}

fn retry(response: Response, after: Option<Duration>) -> Verdict {
    Verdict::Retry {
        last: Last::Response(Box::new(response)),
        after,
    }
}

/// What a problem document says about the key.
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    InProgress,
    Unknown,
    Mismatch,
    /// Stripe's `idempotency_error`: in progress with 409, a mismatch with 400.
    Stripe,
    None,
}

/// The parts of an error body that matter here: RFC 9457's `code` extension and `detail`
/// (idem's servers), and Stripe's `{"error": {"type", "message"}}`.
#[derive(Default, serde::Deserialize)]
struct Problem {
    code: Option<String>,
    detail: Option<String>,
    error: Option<StripeError>,
    /// Whether a JSON body was read at all.
    #[serde(skip)]
    read: bool,
}

#[derive(serde::Deserialize)]
struct StripeError {
    #[serde(rename = "type")]
    kind: Option<String>,
}

impl Problem {
    fn kind(&self) -> Kind {
        match self.code.as_deref() {
            Some("request_in_progress" | "in_progress") => return Kind::InProgress,
            Some("outcome_unknown") => return Kind::Unknown,
            Some("idempotency_key_mismatch" | "fingerprint_mismatch") => return Kind::Mismatch,
            _ => {}
        }
        // Stripe answers a key in use with 409 and a key reused with other parameters with
        // 400, both as an `idempotency_error`; the status tells them apart.
        match self.error.as_ref().and_then(|e| e.kind.as_deref()) {
            Some("idempotency_error") => Kind::Stripe,
            _ => Kind::None,
        }
    }
}

/// Reads a JSON body of known, small length and gives back the answer with the same body;
/// any other answer is given back untouched with an empty [`Problem`].
async fn read_problem(
    response: Response,
) -> Result<(Response, Problem), reqwest_middleware::Error> {
    let json = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().contains("json"));
    let small = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .is_some_and(|n| n <= PROBLEM_LIMIT);
    if !(json && small) {
        return Ok((response, Problem::default()));
    }
    let url = response.url().clone();
    let (parts, body) = http::Response::from(response).into_parts();
    let bytes = Limited::new(body, PROBLEM_LIMIT)
        .collect()
        .await
        .map_err(|e| match e.downcast::<reqwest::Error>() {
            Ok(e) => reqwest_middleware::Error::Reqwest(*e),
            Err(e) => reqwest_middleware::Error::Middleware(anyhow::Error::from_boxed(e)),
        })?
        .to_bytes();
    let mut problem: Problem = serde_json::from_slice(&bytes).unwrap_or_default();
    problem.read = true;
    Ok((rebuild(parts, bytes, url), problem))
}

/// The answer again, with its body read into memory (and its URL, which the conversion
/// through `http` loses).
fn rebuild(parts: http::response::Parts, body: bytes::Bytes, url: Url) -> Response {
    let mut builder = http::Response::builder()
        .status(parts.status)
        .version(parts.version);
    if let Some(headers) = builder.headers_mut() {
        *headers = parts.headers;
    }
    if let Some(extensions) = builder.extensions_mut() {
        *extensions = parts.extensions;
    }
    match builder.url(url).body(body) {
        Ok(rebuilt) => Response::from(rebuilt),
        // Status, version and headers came from a valid answer, so the builder cannot fail.
        Err(_) => Response::from(http::Response::new(bytes::Bytes::new())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn problem(json: &str) -> Problem {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn problem_codes_and_stripe_errors_are_told_apart() {
        assert_eq!(
            problem(r#"{"code":"request_in_progress","detail":"x"}"#).kind(),
            Kind::InProgress
        );
        assert_eq!(
            problem(r#"{"code":"in_progress"}"#).kind(),
            Kind::InProgress
        );
        assert_eq!(
            problem(r#"{"code":"outcome_unknown"}"#).kind(),
            Kind::Unknown
        );
        assert_eq!(
            problem(r#"{"code":"idempotency_key_mismatch"}"#).kind(),
            Kind::Mismatch
        );
        assert_eq!(
            problem(r#"{"code":"fingerprint_mismatch"}"#).kind(),
            Kind::Mismatch
        );
        assert_eq!(
            problem(r#"{"error":{"type":"idempotency_error","message":"m"}}"#).kind(),
            Kind::Stripe
        );
        assert_eq!(problem(r#"{"code":"lock_held"}"#).kind(), Kind::None);
        assert_eq!(
            problem(r#"{"error":{"type":"card_error"}}"#).kind(),
            Kind::None
        );
        assert_eq!(problem("{}").kind(), Kind::None);
    }

    async fn judge(status: u16, headers: &[(&str, &str)], body: &str) -> Verdict {
        let mut b = http::Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let b = b.header(CONTENT_LENGTH, body.len());
        classify(Response::from(b.body(body.to_owned()).unwrap())).await
    }

    fn name(v: &Verdict) -> &'static str {
        match v {
            Verdict::Keep(_) => "keep",
            Verdict::Retry { .. } => "retry",
            Verdict::Unknown { .. } => "unknown",
            Verdict::Mismatch { .. } => "mismatch",
        }
    }

    #[tokio::test]
    async fn statuses_are_judged_as_documented() {
        let json = [("content-type", "application/problem+json")];
        for (status, verdict) in [
            (200, "keep"),
            (201, "keep"),
            (404, "keep"),
            (408, "retry"),
            (425, "retry"),
            (429, "retry"),
            (500, "retry"),
            (501, "keep"),
            (502, "retry"),
            (503, "retry"),
            (504, "retry"),
            (505, "keep"),
            (409, "keep"),
            (422, "keep"),
            (400, "keep"),
        ] {
            assert_eq!(name(&judge(status, &json, "{}").await), verdict, "{status}");
        }
        let v = judge(409, &json, r#"{"code":"request_in_progress"}"#).await;
        assert_eq!(name(&v), "retry");
        let v = judge(409, &json, r#"{"code":"outcome_unknown","detail":"d"}"#).await;
        assert!(matches!(v, Verdict::Unknown { detail: Some(d) } if d == "d"));
        let v = judge(422, &json, r#"{"code":"idempotency_key_mismatch"}"#).await;
        assert!(matches!(v, Verdict::Mismatch { status, .. } if status == 422));
        let stripe = [("content-type", "application/json")];
        let v = judge(400, &stripe, r#"{"error":{"type":"idempotency_error"}}"#).await;
        assert_eq!(name(&v), "mismatch");
        let v = judge(409, &stripe, r#"{"error":{"type":"idempotency_error"}}"#).await;
        assert_eq!(name(&v), "retry");
        // A 409 of the application's own (a JSON body with no code of ours) is kept, even
        // with a Retry-After; one with no document but a Retry-After is taken as in progress.
        let v = judge(409, &[json[0], ("retry-after", "1")], r#"{"code":"taken"}"#).await;
        assert_eq!(name(&v), "keep");
        let v = judge(409, &[("retry-after", "1")], "busy").await;
        assert_eq!(name(&v), "retry");
        let v = judge(409, &[], "busy").await;
        assert_eq!(name(&v), "keep");
    }

    #[tokio::test]
    async fn a_read_answer_keeps_its_body_headers_and_url() {
        let url = Url::parse("http://example.test/v1/x").unwrap();
        let r = http::Response::builder()
            .status(409)
            .header(CONTENT_TYPE, "application/json")
            .header(CONTENT_LENGTH, 16)
            .header("x-kept", "yes")
            .url(url.clone())
            .body(r#"{"code":"taken"}"#)
            .unwrap();
        let Verdict::Keep(r) = classify(Response::from(r)).await else {
            panic!("kept");
        };
        assert_eq!(r.url(), &url);
        assert_eq!(r.headers()["x-kept"], "yes");
        assert_eq!(r.text().await.unwrap(), r#"{"code":"taken"}"#);
    }
}
