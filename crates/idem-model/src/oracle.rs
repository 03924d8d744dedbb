//! Rules a history of store calls must keep, checked without a specification: stated over the
//! calls and their answers alone, and written without idem-core's state machine (only its
//! types). The linearizability check's specification ([`crate::linearizable::RecordSpec`]) is
//! that state machine, which the memory and SQLite stores also run; a bug in it passes on
//! those stores and is blamed on the stores that are right. These rules are what is left to
//! tell them apart:
//!
//! - **One fence, one acquisition**: per key, no two `begin`s acquire with the same fence.
//! - **Fences rise**: per key, an acquisition that began after another was answered has the
//!   higher fence, when the record cannot have been forgotten in between (both, and every
//!   acquisition that may have run between them, asked for a retention longer than the
//!   history lasts; a record forgotten after its retention starts again from the clock).
//! - **One stored answer per fence**: per key and fence, every replay and every completed
//!   record read gives the same bytes.

use std::collections::HashMap;
use std::time::Duration;

use idem_core::{BeginOutcome, Bytes, Key, Status};

use crate::linearizable::{Op, Ret};

/// One call of a history.
#[derive(Debug, Clone)]
pub struct Call {
    /// What was asked.
    pub op: Op,
    /// What was answered; `None` for a call that failed or never answered (its effect is
    /// unknown).
    pub ret: Option<Ret>,
    /// When it was invoked and answered, as positions in the history's order of events (a
    /// call without an answer counts as answered at the end).
    pub invoked: u64,
    /// See `invoked`.
    pub answered: u64,
}

/// An acquisition, or a `begin` that may have been one (it failed, its effect unknown).
struct Taken<'a> {
    key: &'a Key,
    /// `None` when the `begin` failed: it may or may not have acquired.
    fence: Option<u64>,
    ttl: Duration,
    invoked: u64,
    answered: u64,
}

/// Every rule `calls` break, one line each; `long` is a retention no record of the history
/// outlives its start by (a record kept that long is never forgotten within the history).
pub fn violations(calls: &[Call], long: Duration) -> Vec<String> {
    let mut found = Vec::new();
    let taken: Vec<Taken<'_>> = calls
        .iter()
        .filter_map(|c| {
            let Op::Begin { req, .. } = &c.op else {
                return None;
            };
            let fence = match &c.ret {
                Some(Ret::Begun(BeginOutcome::Acquired(lease))) => Some(lease.fence),
                Some(_) => return None,
                None => None,
            };
            Some(Taken {
                key: &req.key,
                fence,
                ttl: req.ttl,
                invoked: c.invoked,
                answered: c.answered,
            })
        })
        .collect();

    let mut fences: HashMap<(&Key, u64), usize> = HashMap::new();
    for t in &taken {
        if let Some(fence) = t.fence {
            *fences.entry((t.key, fence)).or_default() += 1;
        }
    }
    let mut shared: Vec<_> = fences.into_iter().filter(|(_, n)| *n > 1).collect();
    shared.sort_by_key(|((_, fence), _)| *fence);
    for ((key, fence), n) in shared {
        found.push(format!("{key:?}: {n} acquisitions with one fence {fence}"));
    }

    for a in &taken {
        for b in &taken {
            let (Some(fa), Some(fb)) = (a.fence, b.fence) else {
                continue;
            };
            if a.key != b.key || a.answered >= b.invoked || fb > fa {
                continue;
            }
            // Kept throughout: both, and every begin of the key that may have acquired
            // between them, with a long retention.
            let kept = |t: &Taken<'_>| t.ttl >= long;
            let between = taken
                .iter()
                .filter(|t| t.key == a.key && t.invoked < b.answered && t.answered > a.invoked);
            if kept(a) && kept(b) && between.into_iter().all(kept) {
                found.push(format!(
                    "{:?}: fence {fb} acquired after fence {fa} was, with the record kept",
                    a.key
                ));
            }
        }
    }

    let mut answers: HashMap<(&Key, u64), &Bytes> = HashMap::new();
    for c in calls {
        let read = match (&c.op, &c.ret) {
            (Op::Begin { req, .. }, Some(Ret::Begun(BeginOutcome::Replay(r)))) => {
                Some((&req.key, r.fence, &r.response))
            }
            (Op::Get { key, .. }, Some(Ret::Got(Some(r)))) if r.status == Status::Completed => {
                r.response.as_ref().map(|response| (key, r.fence, response))
            }
            _ => None,
        };
        let Some((key, fence, response)) = read else {
            continue;
        };
        let first = *answers.entry((key, fence)).or_insert(response);
        if first != response {
            found.push(format!(
                "{key:?}: fence {fence} answered {first:?} and {response:?}"
            ));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use idem_core::{BeginRequest, Fingerprint, Lease, LeaseId, Replay, Timestamp};

    use super::*;

    const LONG: Duration = Duration::from_secs(60);

    fn key() -> Key {
        Key::parse("oracle", "test", "k").unwrap()
    }

    /// A `begin` with retention `ttl`, invoked and answered at `at`, that acquired `fence`.
    fn acquired(fence: u64, ttl: Duration, at: (u64, u64)) -> Call {
        let now = Timestamp::from_millis(1_000);
        Call {
            op: Op::Begin {
                req: BeginRequest::new(key(), Fingerprint::of_bytes(b"pay")).with_ttl(ttl),
                now,
            },
            ret: Some(Ret::Begun(BeginOutcome::Acquired(Lease {
                id: LeaseId::generate(),
                fence,
                expires_at: now,
            }))),
            invoked: at.0,
            answered: at.1,
        }
    }

    fn replayed(fence: u64, response: &'static [u8], at: u64) -> Call {
        let now = Timestamp::from_millis(1_000);
        Call {
            op: Op::Begin {
                req: BeginRequest::new(key(), Fingerprint::of_bytes(b"pay")),
                now,
            },
            ret: Some(Ret::Begun(BeginOutcome::Replay(Replay {
                response: Bytes::from_static(response),
                fence,
                completed_at: now,
                expires_at: now,
            }))),
            invoked: at,
            answered: at + 1,
        }
    }

    #[test]
    fn a_history_that_keeps_the_rules_passes() {
        let calls = [
            acquired(10, LONG, (1, 2)),
            acquired(11, LONG, (3, 4)),
            replayed(11, b"ok", 5),
            replayed(11, b"ok", 7),
        ];
        assert!(violations(&calls, LONG).is_empty());
    }

    #[test]
    fn two_acquisitions_with_one_fence_are_flagged() {
        let calls = [acquired(10, LONG, (1, 4)), acquired(10, LONG, (2, 3))];
        let found = violations(&calls, LONG);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("2 acquisitions with one fence 10"),
            "{found:?}"
        );
    }

    #[test]
    fn a_fence_that_goes_back_on_a_kept_record_is_flagged_and_not_after_a_short_one() {
        let back = [acquired(11, LONG, (1, 2)), acquired(10, LONG, (3, 4))];
        let found = violations(&back, LONG);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("fence 10 acquired after fence 11"),
            "{found:?}"
        );
        // Overlapping, the order is not known; with a short retention in between, the record
        // may have been forgotten and started again from a clock behind.
        let overlapping = [acquired(11, LONG, (1, 3)), acquired(10, LONG, (2, 4))];
        assert!(violations(&overlapping, LONG).is_empty());
        let forgotten = [
            acquired(11, LONG, (1, 2)),
            acquired(12, Duration::from_millis(4), (3, 4)),
            acquired(10, LONG, (5, 6)),
        ];
        assert!(violations(&forgotten, LONG).is_empty());
    }

    #[test]
    fn two_answers_for_one_fence_are_flagged() {
        let calls = [replayed(11, b"ok", 1), replayed(11, b"other", 3)];
        let found = violations(&calls, LONG);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("fence 11 answered"), "{found:?}");
    }
}
