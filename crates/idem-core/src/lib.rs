//! The record model of idem: keys, request fingerprints, the idempotency record state
//! machine, the [`Store`] trait every backend implements, the lock model ([`lock`]) and clocks.
//!
//! This crate does no I/O and needs no async runtime; stores (`idem-store`), the run-once API
//! (`idem`) and the server plug into it.
//!
//! ```
//! use idem_core::{BeginOutcome, BeginRequest, Fingerprint, Key, LeaseId, Record, Timestamp};
//!
//! let key = Key::parse("tenant-1", "transfer", "order-42").unwrap();
//! let fp = Fingerprint::of_json_str(r#"{"amount": 100, "to": "bob"}"#).unwrap();
//! let req = BeginRequest::new(key, fp);
//! let now = Timestamp::from_millis(1_000);
//!
//! // The first attempt acquires the key...
//! let step = Record::begin(None, &req, now, LeaseId::generate());
//! let BeginOutcome::Acquired(lease) = step.outcome else { panic!() };
//! let record = step.write.unwrap();
//! // ...a concurrent retry is told it is in progress...
//! assert!(matches!(Record::begin(Some(&record), &req, now, LeaseId::generate()).outcome, BeginOutcome::InProgress { .. }));
//! // ...and once completed, every retry gets the stored answer.
//! let done = Record::complete(Some(&record), &lease, "sent".into(), now).unwrap().unwrap();
//! assert!(matches!(Record::begin(Some(&done), &req, now, LeaseId::generate()).outcome, BeginOutcome::Replay(_)));
//! ```

pub mod admin;
pub mod clock;
pub mod counter;
pub mod error;
pub mod fingerprint;
pub mod json;
pub mod key;
pub mod lock;
pub mod page;
pub mod record;
pub mod repair;
pub mod step;
pub mod store;
pub mod token;

pub use admin::{Counts, Listed, Page, RecordAdmin, RecordFilter, RecordState, Repair, Shown};
pub use clock::{Clock, ManualClock, SystemClock, Timestamp};
pub use counter::{Counters, DynCounters, MAX_COUNTER, SharedCounters, counter_step};
pub use error::{BoxFuture, LeaseError, StaleLease, StoreError};
pub use fingerprint::{Fingerprint, FingerprintBuilder};
pub use key::{ClientKey, Key, KeyError, KeyPart, Namespace, Scope};
pub use lock::{
    Acquire, DynLockStore, Held, HeldLock, InvalidLock, LockError, LockName, LockOwner, LockState,
    LockStore, OwnerDigest, Queued, ReleaseListener, SharedLockStore,
};
pub use page::{Cursor, InvalidListing};
pub use record::{
    BeginOutcome, BeginRequest, BeginStep, DEFAULT_LEASE, DEFAULT_TTL, Lease, LeaseId,
    MIN_DURATION, Record, Replay, Status,
};
pub use step::{InvalidStep, Step, StepError, StepName, StepOutcome, StepRefused, step_key};
pub use store::{DynStore, SharedStore, Store};
pub use token::{IssuedToken, TokenError, Tokens};

pub use bytes::Bytes;

/// `bytes` as lowercase hex digits, appended to `out`. By table rather than by `format!`, which
/// costs a formatter call per byte on paths that run per request (lock keys and owners).
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// `bytes` as lowercase hex digits.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::new();
    push_hex(&mut out, bytes);
    out
}

/// 128 bits from a cryptographically secure generator, as 32 lowercase hex digits (URL-safe):
/// an id no one can guess or enumerate (lock owners, one-time tokens).
pub fn random_hex128() -> String {
    hex(&rand::random::<[u8; 16]>())
}

#[cfg(test)]
mod hex_tests {
    #[test]
    fn hex_is_lowercase_two_digits_a_byte() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa0, 0xff, 0x5c]), "000fa0ff5c");
        assert_eq!(super::hex(&[]), "");
        let all: Vec<u8> = (0..=255).collect();
        let expected: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(super::hex(&all), expected);
    }

    #[test]
    fn random_ids_are_32_lowercase_hex_digits_and_differ() {
        let (a, b) = (super::random_hex128(), super::random_hex128());
        for id in [&a, &b] {
            assert_eq!(id.len(), 32);
            assert!(
                id.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
            );
        }
        assert_ne!(a, b);
    }
}
