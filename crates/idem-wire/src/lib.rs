//! How an answer to a request with an `Idempotency-Key` is read, by whoever sent it: the
//! answer the key keeps, one to send again with the same key (and not before when), or one
//! that ends the request. `idem-client` (retries for `reqwest`) and `idem relay` (queue
//! messages to HTTP) read answers by these rules alone, so that the two never disagree about
//! a status.
//!
//! It also holds the catalogue of problem codes ([`ProblemCode`]) that idem's servers answer
//! with: the codes named in [`codes`] are the ones of it that change how an answer is read
//! (besides Stripe's `idempotency_error`).
//!
//! ```
//! use std::time::Duration;
//! use idem_wire::{Answer, Problem, read};
//!
//! let busy = Problem::from_json(br#"{"code":"request_in_progress"}"#);
//! assert_eq!(
//!     read(409, &busy, Some(Duration::from_secs(1))),
//!     Answer::Retry { after: Some(Duration::from_secs(1)) }
//! );
//! assert_eq!(read(501, &Problem::default(), None), Answer::Final);
//! ```

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use http::header::RETRY_AFTER;

mod catalogue;

pub use catalogue::ProblemCode;

/// The problem codes that change how an answer is read, as clients see them (each is the
/// catalogue's [`ProblemCode::as_str`]).
pub mod codes {
    use crate::ProblemCode;

    /// The gateway's and the layer's: another request with the key is running.
    pub const REQUEST_IN_PROGRESS: &str = ProblemCode::RequestInProgress.as_str();
    /// `idem serve`'s record API: another attempt holds the key.
    pub const IN_PROGRESS: &str = ProblemCode::InProgress.as_str();
    /// An earlier request with the key may or may not have taken effect.
    pub const OUTCOME_UNKNOWN: &str = ProblemCode::OutcomeUnknown.as_str();
    /// The request ran; only its answer was too large to keep.
    pub const RESPONSE_NOT_REPLAYABLE: &str = ProblemCode::ResponseNotReplayable.as_str();
    /// The route requires a key and the request has none.
    pub const IDEMPOTENCY_KEY_MISSING: &str = ProblemCode::IdempotencyKeyMissing.as_str();
    /// The key is repeated, malformed or too long.
    pub const IDEMPOTENCY_KEY_INVALID: &str = ProblemCode::IdempotencyKeyInvalid.as_str();
    /// The key was used before with another request (the gateway and the layer).
    pub const IDEMPOTENCY_KEY_MISMATCH: &str = ProblemCode::IdempotencyKeyMismatch.as_str();
    /// The key was used before with another request (`idem serve`'s record API).
    pub const FINGERPRINT_MISMATCH: &str = ProblemCode::FingerprintMismatch.as_str();
}

/// What an answer means for the request that got it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer {
    /// 2xx: the request took effect, and this is the answer the key keeps.
    Done,
    /// The request was not processed, or not yet (it is in progress, the server is busy or
    /// failed before the work, or its answer is not yet stored): send it again with the same
    /// key, not before `after` if the server said.
    Retry {
        /// The server's `Retry-After`.
        after: Option<Duration>,
    },
    /// An earlier request with the key may or may not have taken effect, and the server will
    /// not run it again until someone resolves it (409 `outcome_unknown` without
    /// `Retry-After`).
    OutcomeUnknown,
    /// The key itself was refused: missing or malformed, or used before with another request
    /// (`mismatch`).
    KeyRefused {
        /// Used before with another request (400 or 422), rather than missing or malformed.
        mismatch: bool,
    },
    /// The request took effect, but its answer was too large to keep (409
    /// `response_not_replayable`): it is not run again.
    NotReplayable,
    /// The server's final answer, to hand on as it is: a business refusal, 501 or 505 (which
    /// no retry changes), a redirect.
    Final,
}

/// What an error body says, as far as reading the answer goes: RFC 9457's `code` extension
/// (idem's servers), or Stripe's `{"error": {"type": "idempotency_error"}}`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Problem {
    /// The problem's `code`.
    pub code: Option<String>,
    /// The problem's `detail`, a sentence for a person.
    pub detail: Option<String>,
    /// Stripe's `idempotency_error`: a key in use (409) or reused with other parameters (400).
    pub stripe_idempotency_error: bool,
}

impl Problem {
    /// What a body says; an empty [`Problem`] for one that is not JSON.
    pub fn from_json(body: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct Body {
            code: Option<String>,
            detail: Option<String>,
            error: Option<StripeError>,
        }
        #[derive(serde::Deserialize)]
        struct StripeError {
            #[serde(rename = "type")]
            kind: Option<String>,
        }
        match serde_json::from_slice::<Body>(body) {
            Ok(b) => Self {
                code: b.code,
                detail: b.detail,
                stripe_idempotency_error: b
                    .error
                    .and_then(|e| e.kind)
                    .is_some_and(|k| k == "idempotency_error"),
            },
            Err(_) => Self::default(),
        }
    }

    fn is(&self, codes: &[&str]) -> bool {
        self.code.as_deref().is_some_and(|c| codes.contains(&c))
    }
}

/// Reads an answer: its status, what its body says, and its `Retry-After`.
///
/// Retried: 408, 425, 429; every 5xx but 501 and 505; a 409 that says another request with
/// the key is running (`request_in_progress`, `in_progress`, Stripe's `idempotency_error`) and
/// any 409 with a `Retry-After`, which asks to be tried again (an overtaken attempt's
/// `stale_lease`, an unknown outcome the server reopens when the first attempt's lease ends).
pub fn read(status: u16, problem: &Problem, after: Option<Duration>) -> Answer {
    use codes::*;
    match status {
        200..=299 => Answer::Done,
        408 | 425 | 429 => Answer::Retry { after },
        501 | 505 => Answer::Final,
        500..=599 => Answer::Retry { after },
        409 if problem.is(&[REQUEST_IN_PROGRESS, IN_PROGRESS])
            || problem.stripe_idempotency_error
            || after.is_some() =>
        {
            Answer::Retry { after }
        }
        409 if problem.is(&[OUTCOME_UNKNOWN]) => Answer::OutcomeUnknown,
        409 if problem.is(&[RESPONSE_NOT_REPLAYABLE]) => Answer::NotReplayable,
        400 | 422 if problem.is(&[IDEMPOTENCY_KEY_MISMATCH, FINGERPRINT_MISMATCH]) => {
            Answer::KeyRefused { mismatch: true }
        }
        400 if problem.stripe_idempotency_error => Answer::KeyRefused { mismatch: true },
        400 if problem.is(&[IDEMPOTENCY_KEY_MISSING, IDEMPOTENCY_KEY_INVALID]) => {
            Answer::KeyRefused { mismatch: false }
        }
        _ => Answer::Final,
    }
}

/// The `Retry-After` of an answer (RFC 9110 §10.2.3: seconds, or an HTTP date), from `now`.
/// A date in the past is no wait; a value that is neither is ignored.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use http::HeaderValue;

    fn code(c: &str) -> Problem {
        Problem::from_json(format!(r#"{{"code":"{c}"}}"#).as_bytes())
    }

    const SECOND: Option<Duration> = Some(Duration::from_secs(1));

    /// Every row, as the client and the relay both read it.
    #[test]
    fn each_answer_is_read_by_its_row() {
        let none = Problem::default();
        for s in [200, 201, 204] {
            assert_eq!(read(s, &none, None), Answer::Done);
        }
        for s in [408, 425, 429, 500, 502, 503, 504] {
            assert_eq!(read(s, &none, None), Answer::Retry { after: None }, "{s}");
            assert_eq!(
                read(s, &none, SECOND),
                Answer::Retry { after: SECOND },
                "{s}"
            );
        }
        for s in [501, 505] {
            assert_eq!(read(s, &none, SECOND), Answer::Final, "{s}");
        }
        assert_eq!(
            read(503, &code("answer_not_stored"), SECOND),
            Answer::Retry { after: SECOND }
        );
        for c in ["request_in_progress", "in_progress"] {
            assert_eq!(
                read(409, &code(c), None),
                Answer::Retry { after: None },
                "{c}"
            );
        }
        let stripe = Problem::from_json(br#"{"error":{"type":"idempotency_error"}}"#);
        assert_eq!(read(409, &stripe, None), Answer::Retry { after: None });
        assert_eq!(
            read(400, &stripe, None),
            Answer::KeyRefused { mismatch: true }
        );
        assert_eq!(
            read(409, &code("outcome_unknown"), None),
            Answer::OutcomeUnknown
        );
        assert_eq!(
            read(409, &code("outcome_unknown"), SECOND),
            Answer::Retry { after: SECOND }
        );
        assert_eq!(
            read(409, &code("stale_lease"), SECOND),
            Answer::Retry { after: SECOND }
        );
        assert_eq!(
            read(409, &code("response_not_replayable"), None),
            Answer::NotReplayable
        );
        for (s, c) in [
            (422, "idempotency_key_mismatch"),
            (400, "idempotency_key_mismatch"),
            (422, "fingerprint_mismatch"),
        ] {
            assert_eq!(
                read(s, &code(c), None),
                Answer::KeyRefused { mismatch: true },
                "{s} {c}"
            );
        }
        for c in ["idempotency_key_missing", "idempotency_key_invalid"] {
            assert_eq!(
                read(400, &code(c), None),
                Answer::KeyRefused { mismatch: false },
                "{c}"
            );
        }
        for s in [301, 400, 401, 403, 404, 409, 410, 413, 422] {
            assert_eq!(read(s, &none, None), Answer::Final, "{s}");
        }
    }

    #[test]
    fn a_body_that_is_not_json_says_nothing() {
        assert_eq!(Problem::from_json(b"<html>"), Problem::default());
        let p = Problem::from_json(br#"{"detail":"x"}"#);
        assert!(p.code.is_none() && !p.stripe_idempotency_error);
        assert_eq!(p.detail.as_deref(), Some("x"));
    }

    fn headers(retry_after: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_str(retry_after).unwrap());
        h
    }

    #[test]
    fn retry_after_takes_seconds_and_dates_and_ignores_the_rest() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            retry_after(&headers("3"), now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(retry_after(&headers(" 0 "), now), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(
            retry_after(&headers(&later), now),
            Some(Duration::from_secs(7))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(retry_after(&headers(&past), now), Some(Duration::ZERO));
        assert_eq!(retry_after(&headers("-1"), now), None);
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }
}
