//! Which answers are kept, which are retried, and which end the call.

use std::time::{Duration, SystemTime};

use http_body_util::{BodyExt, Limited};
use reqwest::header::{CONTENT_LENGTH, CONTENT_TYPE};
use reqwest::{Response, Url};
use reqwest::{ResponseBuilderExt, StatusCode};

use idem_wire::{Answer, Problem, retry_after};

use crate::outcome::Last;

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

/// Judges one answer by [`idem_wire::read`], the rules `idem relay` reads answers by too:
/// retried are 408, 425, 429 and every 5xx but 501 and 505 (which a retry does not change),
/// a 409 that says a request with the key is still in progress (by its problem code, or
/// Stripe's `idempotency_error`), and any 409 with a `Retry-After`.
pub(crate) async fn classify(response: Response) -> Verdict {
    let status = response.status();
    let after = retry_after(response.headers(), SystemTime::now());
    // Only these are told apart by their body.
    let (response, problem) = if matches!(status.as_u16(), 400 | 409 | 422) {
        match read_problem(response).await {
            Ok(read) => read,
            // The body broke off: as if the connection had.
            Err(e) => {
                return Verdict::Retry {
                    last: Last::Transport(e),
                    after: None,
                };
            }
        }
    } else {
        (response, Problem::default())
    };
    match idem_wire::read(status.as_u16(), &problem, after) {
        Answer::Retry { after } => Verdict::Retry {
            last: Last::Response(Box::new(response)),
            after,
        },
        Answer::OutcomeUnknown => Verdict::Unknown {
            detail: problem.detail,
        },
        Answer::KeyRefused { mismatch: true } => Verdict::Mismatch {
            status,
            detail: problem.detail,
        },
        // Done, final, not replayable, or a key the client sent wrong: the server's answer.
        _ => Verdict::Keep(response),
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
    let problem = Problem::from_json(&bytes);
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
        // A 409 with a Retry-After asks to be tried again, whatever its body; without one, a
        // 409 of the application's own is kept.
        let v = judge(409, &[json[0], ("retry-after", "1")], r#"{"code":"taken"}"#).await;
        assert_eq!(name(&v), "retry");
        let v = judge(409, &json, r#"{"code":"taken"}"#).await;
        assert_eq!(name(&v), "keep");
        let v = judge(
            409,
            &[json[0], ("retry-after", "1")],
            r#"{"code":"outcome_unknown"}"#,
        )
        .await;
        assert_eq!(name(&v), "retry");
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
