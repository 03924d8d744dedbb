//! The consumer's decision table: what becomes of a delivery, given how the run of its key
//! ended. One pure function, which the consumer applies (`decide.rs`) and the delivery model
//! (`idem-model`) calls, so that the model checks the table that ships rather than a copy.

use crate::source::Reason;

/// How the run of a delivery's key ended, as far as the delivery's fate depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RunEnd {
    /// The handler ran, and its result is stored.
    Handled,
    /// A result stored by an earlier run was found; nothing ran.
    Replayed,
    /// The handler failed, or a permanent failure stored by an earlier run was found.
    Failed,
    /// Another attempt holds the key (and was waited for as long as allowed).
    InProgress,
    /// The key was used before with another payload.
    Mismatch,
    /// The stored result could not be decoded.
    Undecodable,
    /// The handler ran, and its result could not be stored: the record stays in progress until
    /// its lease ends.
    NotRecorded,
    /// This run stored nothing and holds nothing: the store failed before the claim, the lease
    /// was taken over (the attempt that took it settles its own delivery), or a step was
    /// refused (the key was released).
    Unsettled,
}

/// What the consumer does with a delivery once its run has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Verdict {
    /// Ack: the broker forgets the message.
    Ack,
    /// Requeue, to come back once the attempt holding the key may have settled: its lease's
    /// end, within the backoff's bounds.
    RequeueAfterHolder,
    /// Requeue, to come back after a lease: the record stays in progress until then.
    RequeueAfterLease,
    /// Requeue with backoff.
    RequeueWithBackoff,
    /// Dead-letter, with this reason.
    DeadLetter(Reason),
    /// The handler's failure decides: a permanent one is dead-lettered; a retryable one (or a
    /// panic) is requeued with backoff, and dead-lettered once the key was taken
    /// `max_attempts` times.
    ByFailure,
}

impl Verdict {
    /// Whether the delivery is acked.
    pub fn acks(self) -> bool {
        self == Self::Ack
    }
}

/// The delivery's fate after its run ended as `end`. A message is acked only once its result
/// is stored (or was stored before): every end without a stored result requeues or
/// dead-letters.
pub const fn verdict(end: RunEnd) -> Verdict {
    match end {
        RunEnd::Handled | RunEnd::Replayed => Verdict::Ack,
        RunEnd::Failed => Verdict::ByFailure,
        RunEnd::InProgress => Verdict::RequeueAfterHolder,
        RunEnd::Mismatch => Verdict::DeadLetter(Reason::Mismatch),
        RunEnd::Undecodable => Verdict::DeadLetter(Reason::Undecodable),
        RunEnd::NotRecorded => Verdict::RequeueAfterLease,
        RunEnd::Unsettled => Verdict::RequeueWithBackoff,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_stored_result_is_acked() {
        let every = [
            RunEnd::Handled,
            RunEnd::Replayed,
            RunEnd::Failed,
            RunEnd::InProgress,
            RunEnd::Mismatch,
            RunEnd::Undecodable,
            RunEnd::NotRecorded,
            RunEnd::Unsettled,
        ];
        let acked: Vec<_> = every.into_iter().filter(|e| verdict(*e).acks()).collect();
        assert_eq!(acked, [RunEnd::Handled, RunEnd::Replayed]);
    }
}
