//! What the server stores (PostgreSQL, MySQL/MariaDB, Redis) share when a decision is made in
//! Rust from a record as read and written only if the record has not changed meanwhile: how
//! many rounds to try, the error when every round lost, and `record_step`'s decision.

use idem_core::{Lease, Record, StaleLease, Step, StepError, StoreError, Timestamp};

/// How many times a read-then-conditional-write is tried: another writer may change the record
/// between the read and the write, and then it is read again.
pub(crate) const ROUNDS: usize = 8;

/// The answer when the record changed under the operation in every round.
pub(crate) fn kept_changing() -> StoreError {
    StoreError::Unavailable {
        message: "the record kept changing under contention; try again".into(),
        source: None,
    }
}

/// What `record_step` writes over the steps of a record as read.
pub(crate) struct StepWrite {
    /// The steps after it, encoded.
    pub(crate) steps: Vec<u8>,
    /// How many bytes the steps took as read: the write applies only while they still do.
    /// Steps change only under their lease and only grow, so under the same lease an equal
    /// length means an unchanged list.
    pub(crate) read_len: usize,
}

/// Decides `record_step` from the record as read: `None` if the step is recorded already (a
/// repeat), the write to make otherwise.
pub(crate) fn step_write(
    record: Option<Record>,
    lease: &Lease,
    step: &Step,
    now: Timestamp,
) -> Result<Option<StepWrite>, StepError> {
    let mut record = record.ok_or(StaleLease)?;
    let read_len = idem_core::step::encode(&record.steps).len();
    if !record.record_step_in_place(lease, step, now)? {
        return Ok(None);
    }
    Ok(Some(StepWrite {
        steps: idem_core::step::encode(&record.steps),
        read_len,
    }))
}
