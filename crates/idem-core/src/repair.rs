//! Whether an operator's repair still applies: the check every store makes before a repair
//! lands ([`RecordAdmin::repair`](crate::RecordAdmin::repair)'s contract), written once.
//!
//! A repair lands only on the record an operator was shown: still in the state shown, with the
//! fence shown, and only if the repair applies to that state. A store that reads the record
//! before it writes (memory, SQLite) decides with [`applies`]; one that decides inside a single
//! statement or script (PostgreSQL, MySQL, Redis) asks [`may_apply`] first and puts the state
//! and the fence shown into that statement's conditions.

use crate::admin::{Repair, Shown};
use crate::clock::Timestamp;
use crate::record::Record;

/// Whether `repair` can apply to a record shown as `shown` at all: when it never applies to
/// the state shown (releasing a record shown released or expired), nothing is to be read or
/// written.
pub fn may_apply(repair: Repair, shown: Shown) -> bool {
    repair.applies_to(shown.state)
}

/// Whether `repair` applies to `record` as it is at `now`: the record is still what was
/// `shown` (the same state, the same fence), and the repair applies to that state.
pub fn applies(repair: Repair, shown: Shown, record: &Record, now: Timestamp) -> bool {
    may_apply(repair, shown) && shown.is(record, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::RecordState;
    use crate::{BeginOutcome, BeginRequest, Fingerprint, Key, LeaseId};

    fn in_progress(now: Timestamp) -> Record {
        let key = Key::parse("s", "n", "k").unwrap_or_else(|e| panic!("{e}"));
        let req = BeginRequest::new(key, Fingerprint::of_bytes(b"request"));
        let step = Record::begin(None, &req, now, LeaseId::generate());
        assert!(matches!(step.outcome, BeginOutcome::Acquired(_)));
        step.write.unwrap_or_else(|| panic!("a fresh begin writes"))
    }

    #[test]
    fn a_repair_applies_to_the_record_as_shown_only() {
        let now = Timestamp::from_millis(1_000);
        let record = in_progress(now);
        let shown = Shown {
            state: RecordState::of(&record, now),
            fence: record.fence,
        };
        assert_eq!(shown.state, RecordState::InProgress);
        for repair in [Repair::Release, Repair::Delete] {
            assert!(may_apply(repair, shown));
            assert!(applies(repair, shown, &record, now));
            // Another fence: the record moved on since it was shown.
            let moved = Shown {
                fence: record.fence + 1,
                ..shown
            };
            assert!(!applies(repair, moved, &record, now));
            // Another state: likewise.
            let stuck = Shown {
                state: RecordState::Stuck,
                ..shown
            };
            assert!(!applies(repair, stuck, &record, now));
        }
    }

    #[test]
    fn releasing_what_was_shown_released_or_expired_never_applies() {
        for state in [RecordState::Released, RecordState::Expired] {
            let shown = Shown { state, fence: 1 };
            assert!(!may_apply(Repair::Release, shown));
            assert!(may_apply(Repair::Delete, shown));
        }
    }
}
