//! What the relay does with each answer of its target: the table in the user guide's relay
//! chapter (docs/guide/relay.md), as code. A message is acked only when its effect happened
//! (or the target says it did); one whose effect did not happen, or may not have, is retried
//! or dead-lettered, never dropped.

use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, StatusCode};
use idem_wire::{Answer, Problem, retry_after};

/// What becomes of a message after one POST.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The target took it: record the answer and ack.
    Delivered,
    /// The target did not process it: POST again with the same key, not before the delay
    /// the target asked for (`Retry-After` in seconds), if it did.
    Retry(Option<Duration>),
    /// Its effect did not happen, or is not known to have, and a person must look (the relay
    /// or the target is misconfigured, or the outcome is unknown): dead-letter it with the
    /// answer, recording nothing, so that moved back to the queue it is sent again.
    DeadLetter(&'static str),
}

/// Judges one answer: its status, headers, and what its body says. Whether it is kept,
/// retried or final is [`idem_wire::read`]'s call, the same as `idem-client`'s; this adds only
/// what the relay does with a final answer. `ack_4xx` says the target's other 4xx answers are
/// business answers (a refused order) to record and ack, rather than dead-letter.
pub(crate) fn verdict(
    status: StatusCode,
    headers: &HeaderMap,
    problem: &Problem,
    ack_4xx: bool,
) -> Verdict {
    let after = retry_after(headers, SystemTime::now());
    match idem_wire::read(status.as_u16(), problem, after) {
        Answer::Done | Answer::NotReplayable => Verdict::Delivered,
        Answer::Retry { after } => Verdict::Retry(after),
        Answer::OutcomeUnknown => Verdict::DeadLetter(
            "an earlier POST with this key may or may not have taken effect; resolve the record \
             at the target (reopen it if the request did not take effect), then move this \
             message back to the queue",
        ),
        Answer::KeyRefused { .. } => Verdict::DeadLetter(
            "the target refused the Idempotency-Key (sent wrong, or used before by another \
             message with another body)",
        ),
        _ => final_answer(status, ack_4xx),
    }
}

/// What becomes of a message whose answer is final.
fn final_answer(status: StatusCode, ack_4xx: bool) -> Verdict {
    match status.as_u16() {
        501 | 505 => Verdict::DeadLetter("the target does not support the request"),
        401 | 403 | 407 => {
            Verdict::DeadLetter("the target refused the relay's credentials (check --header)")
        }
        404 | 405 => Verdict::DeadLetter("the target has no such endpoint for POST (check --to)"),
        413 | 415 => Verdict::DeadLetter(
            "the target refused the body's size or type (check --content-type and its limits)",
        ),
        400..=499 if ack_4xx => Verdict::Delivered,
        400..=499 => Verdict::DeadLetter(
            "the target refused the message (if its 4xx answers are business answers, \
             --ack-4xx records and acks them)",
        ),
        // 1xx reach no one here; 3xx: the relay does not follow redirects.
        _ => Verdict::DeadLetter(
            "the target redirected the request, which the relay does not follow (point --to at \
             the final URL)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judge(status: u16, code: Option<&str>, retry_after: bool, ack_4xx: bool) -> Verdict {
        let mut headers = HeaderMap::new();
        if retry_after {
            headers.insert(axum::http::header::RETRY_AFTER, "3".parse().unwrap());
        }
        let problem = code.map_or_else(Problem::default, |c| {
            Problem::from_json(format!(r#"{{"code":"{c}"}}"#).as_bytes())
        });
        verdict(
            StatusCode::from_u16(status).unwrap(),
            &headers,
            &problem,
            ack_4xx,
        )
    }

    /// Every row of the table, both ways of `--ack-4xx`: only the business 4xx row moves.
    #[test]
    fn each_answer_gets_the_row_of_the_table() {
        use Verdict::*;
        let dead = |v: &Verdict| matches!(v, DeadLetter(_));
        for ack in [false, true] {
            for s in [200, 201, 204] {
                assert_eq!(judge(s, None, false, ack), Delivered);
            }
            assert_eq!(
                judge(409, Some("response_not_replayable"), false, ack),
                Delivered
            );
            for s in [408, 425, 429, 500, 502, 503, 504] {
                assert_eq!(judge(s, None, false, ack), Retry(None), "{s}");
            }
            assert_eq!(
                judge(503, None, true, ack),
                Retry(Some(Duration::from_secs(3)))
            );
            assert_eq!(
                judge(409, Some("request_in_progress"), false, ack),
                Retry(None)
            );
            assert_eq!(judge(409, Some("in_progress"), false, ack), Retry(None));
            assert!(matches!(
                judge(409, Some("outcome_unknown"), true, ack),
                Retry(Some(_))
            ));
            assert!(dead(&judge(409, Some("outcome_unknown"), false, ack)));
            for s in [
                401, 403, 404, 405, 407, 413, 415, 501, 505, 301, 303, 307, 308,
            ] {
                assert!(dead(&judge(s, None, false, ack)), "{s}");
            }
            for (s, code) in [
                (400, "idempotency_key_missing"),
                (400, "idempotency_key_invalid"),
                (422, "idempotency_key_mismatch"),
                (400, "idempotency_key_mismatch"),
            ] {
                assert!(dead(&judge(s, Some(code), false, ack)), "{s} {code}");
            }
            for s in [400, 409, 410, 422] {
                assert_eq!(dead(&judge(s, None, false, ack)), !ack, "{s}");
            }
        }
    }
}
