//! What a call ends with: an answer, or why there is none.

use std::fmt;
use std::time::Duration;

use reqwest::{Response, StatusCode};

/// How a call went: its key, how many attempts it took, and whether the server said the
/// answer is a replay of an earlier execution (`Idempotent-Replayed: true`).
///
/// Through the middleware it rides in the answer's extensions ([`report`]). Its `Debug` (and
/// so that of every [`Error`]) leaves the key out, so that logging an error logs no key.
#[derive(Clone, PartialEq, Eq)]
pub struct Report {
    /// The key the call carried (attached or the caller's), without the quotes of its
    /// structured-field form; `None` for a call without one. A secret of sorts: whoever has it
    /// (and the caller's credentials) gets the answer back; do not log it.
    pub key: Option<String>,
    /// Attempts made, the first included.
    pub attempts: u32,
    /// From the first attempt to the end of the last.
    pub elapsed: Duration,
    /// The server answered from its store: the operation ran on an earlier attempt (or an
    /// earlier call with the same key), not on this one.
    pub replayed: bool,
}

impl fmt::Debug for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Report")
            .field("key", &self.key.as_ref().map(|_| "<withheld>"))
            .field("attempts", &self.attempts)
            .field("elapsed", &self.elapsed)
            .field("replayed", &self.replayed)
            .finish()
    }
}

/// The call's [`Report`], on an answer the middleware returned.
pub fn report(response: &Response) -> Option<&Report> {
    response.extensions().get::<Report>()
}

/// An answer the server gave, to keep: a success, or a refusal that retrying would not change
/// (a 404, a 403, a 400 for a bad request…). Its status is the caller's to look at, as with
/// plain `reqwest`.
#[derive(Debug)]
pub struct Answer {
    /// The answer, its body unread.
    pub response: Response,
    /// How the call went.
    pub report: Report,
}

/// What ended a call's retries without an answer to keep.
#[derive(Debug)]
pub enum Last {
    /// The last attempt was answered with a status that is retried (5xx, 408, 425, 429, 409
    /// "in progress"), its body unread.
    Response(Box<Response>),
    /// The last attempt failed on the way: the connection was refused or broke, or timed out.
    Transport(reqwest_middleware::Error),
}

/// Why a call has no answer to keep.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server does not know whether an earlier request with this key took effect (its
    /// upstream timed out or broke after the request was sent: 409 `outcome_unknown`), and will
    /// not run it again until someone who can look finds out. Retrying cannot help; a new key
    /// would risk running the operation twice.
    #[error(
        "the server does not know whether an earlier request with this key took effect, and will not run it again until the outcome is resolved"
    )]
    OutcomeUnknown {
        /// The server's explanation (`detail` of its problem document), if any.
        detail: Option<String>,
        /// How the call went.
        report: Report,
    },
    /// The key was used before with a different request (422 `idempotency_key_mismatch` or
    /// `fingerprint_mismatch`, or 400 under Stripe's rules): a new logical operation needs a
    /// new key. Never retried.
    #[error(
        "the key was used before with a different request ({status}): a new operation needs a new key"
    )]
    KeyMismatch {
        /// 422, or 400 from servers that follow Stripe.
        status: StatusCode,
        /// The server's explanation, if any.
        detail: Option<String>,
        /// How the call went.
        report: Report,
    },
    /// Every attempt the policy allowed failed, or the next pause would have outlasted the
    /// call's total time or gone beyond the longest `Retry-After` the policy waits for.
    #[error("gave up after {} attempt(s) in {:.1?}: {last}", report.attempts, report.elapsed)]
    GaveUp {
        /// How the last attempt ended.
        #[source]
        last: Last,
        /// How the call went.
        report: Report,
    },
    /// The request failed in a way no retry changes (it could not be built, a redirect
    /// policy refused it, another middleware failed), or it was not retried: a POST or PATCH
    /// without a key, or a body that cannot be sent twice (a stream).
    #[error(transparent)]
    Request(reqwest_middleware::Error),
}

impl Error {
    /// How the call went, where it got as far as an attempt.
    pub fn report(&self) -> Option<&Report> {
        match self {
            Error::OutcomeUnknown { report, .. }
            | Error::KeyMismatch { report, .. }
            | Error::GaveUp { report, .. } => Some(report),
            Error::Request(_) => None,
        }
    }
}

impl fmt::Display for Last {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Last::Response(r) => write!(f, "the last answer was {}", r.status()),
            Last::Transport(e) => write!(f, "the last attempt failed: {e}"),
        }
    }
}

impl std::error::Error for Last {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Last::Response(_) => None,
            Last::Transport(e) => Some(e),
        }
    }
}
