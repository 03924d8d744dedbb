//! Recovery points: the finished steps of multi-step work, kept on its record.
//!
//! Work that calls several services in turn (debit an account, call a bank, credit another
//! account) records each step's output on the record, under the attempt's lease, before the
//! next step starts. An attempt that takes the key over after a crash finds those outputs and
//! resumes at the first step that has none, instead of running the finished ones again.
//!
//! A step is recorded as done (with its output) or as **unknown**: it sent a request and got no
//! answer (a timeout after sending), so its effect may or may not have happened. A later attempt
//! runs an unknown step again under the same [step key](step_key), which the service it calls
//! can use to recognise the repeat; it may then be recorded as done. No step is recorded after
//! an unknown one.
//!
//! Steps stay with the record while it lives: a release (a retryable failure) keeps them, so a
//! retry resumes; completion keeps them for inspection; a reopen (an operator's "run it again")
//! drops them, and so does the record's expiry.

use std::fmt;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::error::{StaleLease, StoreError};
use crate::{Fingerprint, Key};

/// The most steps one record keeps.
pub const MAX_STEPS: usize = 64;
/// The longest step name, in bytes.
pub const MAX_STEP_NAME: usize = 64;
/// The most bytes one record's steps take, encoded ([`encode`]): names, outputs and framing.
pub const MAX_STEPS_BYTES: usize = 1 << 20;

/// The name of a step: 1 to [`MAX_STEP_NAME`] ASCII letters, digits, `.`, `_`, `-` or `:`.
/// Names are labels chosen in code ("debit", "bank.transfer"), unique within a record.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StepName(String);

impl StepName {
    /// Checks and wraps `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidStep> {
        let name = name.into();
        let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':');
        if name.is_empty() || name.len() > MAX_STEP_NAME || !name.bytes().all(ok) {
            return Err(InvalidStep::Name);
        }
        Ok(Self(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StepName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for StepName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// A step name or output that cannot be recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidStep {
    /// The name is empty, too long, or has a character outside `A-Z a-z 0-9 . _ - :`.
    #[error("a step name is 1 to {MAX_STEP_NAME} ASCII letters, digits, '.', '_', '-' or ':'")]
    Name,
    /// The output alone is larger than a record's steps may be.
    #[error("a step's output is larger than a record's steps may be ({MAX_STEPS_BYTES} bytes)")]
    TooLarge,
}

/// What a step came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepOutcome {
    /// It finished; its output, opaque bytes, is handed back to a resuming attempt.
    Done(Bytes),
    /// It sent a request and got no answer: its effect may or may not have happened.
    Unknown,
}

impl StepOutcome {
    /// Its name as the JSON API and the operator's tools show it: `done` or `unknown`.
    pub const fn as_str(&self) -> &'static str {
        match self {
            StepOutcome::Done(_) => "done",
            StepOutcome::Unknown => "unknown",
        }
    }
}

/// One recorded step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Its name.
    pub name: StepName,
    /// What it came to.
    pub outcome: StepOutcome,
}

impl Step {
    /// A finished step with its output.
    pub fn done(name: StepName, output: impl Into<Bytes>) -> Result<Self, InvalidStep> {
        let output = output.into();
        if output.len() > MAX_STEPS_BYTES {
            return Err(InvalidStep::TooLarge);
        }
        Ok(Self {
            name,
            outcome: StepOutcome::Done(output),
        })
    }

    /// A step whose outcome is unknown.
    pub fn unknown(name: StepName) -> Self {
        Self {
            name,
            outcome: StepOutcome::Unknown,
        }
    }

    /// Its output, if it finished.
    pub fn output(&self) -> Option<&Bytes> {
        match &self.outcome {
            StepOutcome::Done(output) => Some(output),
            StepOutcome::Unknown => None,
        }
    }

    /// How many bytes it takes in [`encode`]'s form.
    pub fn encoded_len(&self) -> usize {
        2 + self.name.0.len() + self.output().map_or(0, |o| 4 + o.len())
    }
}

/// Why recording a step was refused by the state machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StepRefused {
    /// The lease no longer holds the record, or the record is not in progress.
    #[error(transparent)]
    Stale(#[from] StaleLease),
    /// A step of that name is recorded with another outcome; the first stays.
    #[error("step {0} is already recorded with another outcome")]
    Conflict(StepName),
    /// The last recorded step's outcome is unknown: it must be run again (and recorded as
    /// done) before any other step.
    #[error("step {0} has an unknown outcome; it must finish before another step is recorded")]
    AfterUnknown(StepName),
    /// The record holds as many steps, or as many bytes of them, as it may
    /// ([`MAX_STEPS`], [`MAX_STEPS_BYTES`]).
    #[error(
        "the record holds as many steps as it may ({MAX_STEPS} steps, {MAX_STEPS_BYTES} bytes)"
    )]
    Full,
}

/// The answer of recording a step when it does not succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The state machine refused it; nothing changed.
    #[error(transparent)]
    Refused(#[from] StepRefused),
    /// The store failed; whether the step was recorded is unknown.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<StaleLease> for StepError {
    fn from(e: StaleLease) -> Self {
        Self::Refused(StepRefused::Stale(e))
    }
}

/// Whether a step of a name not in `steps` may be added to them: refused after a step whose
/// outcome is unknown, and once they hold [`MAX_STEPS`]. (Whether its output fits in
/// [`MAX_STEPS_BYTES`] is known only once it is made.) For a caller to check before it runs
/// a step whose recording would be refused.
pub fn may_add(steps: &[Step]) -> Result<(), StepRefused> {
    if let Some(last) = steps.last().filter(|s| s.outcome == StepOutcome::Unknown) {
        return Err(StepRefused::AfterUnknown(last.name.clone()));
    }
    if steps.len() >= MAX_STEPS {
        return Err(StepRefused::Full);
    }
    Ok(())
}

/// Records `step` in `steps` (the record's, already checked to be held by the lease):
/// `Ok(true)` if they changed, `Ok(false)` for a repeat of what is recorded.
pub(crate) fn record(steps: &mut Vec<Step>, step: &Step) -> Result<bool, StepRefused> {
    if let Some(i) = steps.iter().position(|s| s.name == step.name) {
        let last = i + 1 == steps.len();
        return match (&steps[i].outcome, &step.outcome) {
            (a, b) if a == b => Ok(false),
            // An unknown step run again and finished.
            (StepOutcome::Unknown, StepOutcome::Done(_)) if last => {
                steps[i] = step.clone();
                check_size(steps).inspect_err(|_| steps[i].outcome = StepOutcome::Unknown)?;
                Ok(true)
            }
            _ => Err(StepRefused::Conflict(step.name.clone())),
        };
    }
    may_add(steps)?;
    steps.push(step.clone());
    check_size(steps).inspect_err(|_| {
        steps.pop();
    })?;
    Ok(true)
}

fn check_size(steps: &[Step]) -> Result<(), StepRefused> {
    let total: usize = 1 + steps.iter().map(Step::encoded_len).sum::<usize>();
    if total > MAX_STEPS_BYTES {
        return Err(StepRefused::Full);
    }
    Ok(())
}

/// The version byte that starts [`encode`]'s form.
const FORMAT: u8 = 1;

/// The steps as bytes, for a store to keep in one column or field: empty for none; otherwise a
/// version byte, then per step its name's length (1 byte), the name, a tag (0 done, 1 unknown)
/// and, when done, the output's length (4 bytes, big-endian) and the output.
///
/// Written by hand: the form is four fields, and a store keeps it next to the record's other
/// columns without a serialisation library of its own.
pub fn encode(steps: &[Step]) -> Vec<u8> {
    if steps.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(1 + steps.iter().map(Step::encoded_len).sum::<usize>());
    out.push(FORMAT);
    for s in steps {
        // Names are at most 64 bytes and outputs at most 1 MiB (checked when made).
        out.push(u8::try_from(s.name.0.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(s.name.0.as_bytes());
        match &s.outcome {
            StepOutcome::Done(o) => {
                out.push(0);
                out.extend_from_slice(&u32::try_from(o.len()).unwrap_or(u32::MAX).to_be_bytes());
                out.extend_from_slice(o);
            }
            StepOutcome::Unknown => out.push(1),
        }
    }
    out
}

/// Reads [`encode`]'s form back; a malformed one is [`StoreError::Corrupt`].
pub fn decode(bytes: &[u8]) -> Result<Vec<Step>, StoreError> {
    let corrupt = || StoreError::Corrupt("the stored steps are malformed".into());
    let Some((&version, mut rest)) = bytes.split_first() else {
        return Ok(Vec::new());
    };
    if version != FORMAT {
        return Err(corrupt());
    }
    let take = |rest: &mut &[u8], n: usize| -> Result<Vec<u8>, StoreError> {
        let (head, tail) = rest.split_at_checked(n).ok_or_else(corrupt)?;
        *rest = tail;
        Ok(head.to_vec())
    };
    let mut steps = Vec::new();
    while !rest.is_empty() {
        let len = usize::from(take(&mut rest, 1)?[0]);
        let name = String::from_utf8(take(&mut rest, len)?).map_err(|_| corrupt())?;
        let name = StepName::new(name).map_err(|_| corrupt())?;
        let outcome = match take(&mut rest, 1)?[0] {
            0 => {
                let n = take(&mut rest, 4)?;
                let n = u32::from_be_bytes([n[0], n[1], n[2], n[3]]) as usize;
                StepOutcome::Done(Bytes::from(take(&mut rest, n)?))
            }
            1 => StepOutcome::Unknown,
            _ => return Err(corrupt()),
        };
        steps.push(Step { name, outcome });
    }
    Ok(steps)
}

/// The idempotency key a step sends to the service it calls: the same on every attempt of the
/// same request (key and fingerprint) and distinct for every other request or step, so that
/// the service can recognise a step run again after a crash or an unknown outcome. 32 hex
/// digits of SHA-256 over the key's parts, the fingerprint and the step's name.
///
/// A key used again after its record expired, with the same input, derives the same step keys:
/// to the service it is the same request.
pub fn step_key(key: &Key, fingerprint: &Fingerprint, step: &StepName) -> String {
    let mut h = Sha256::new();
    h.update(b"idem step key v1\0");
    for part in [
        key.scope().as_str(),
        key.namespace().as_str(),
        key.client_key().as_str(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.update(fingerprint.as_bytes());
    h.update(step.as_str().as_bytes());
    crate::hex(&h.finalize()[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> StepName {
        StepName::new(s).unwrap()
    }

    fn done(s: &str, out: &str) -> Step {
        Step::done(name(s), out.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn names_are_checked() {
        for ok in ["debit", "bank.transfer", "a", "x:1-2_3", &"n".repeat(64)] {
            assert!(StepName::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "with space", "é", "a/b", &"n".repeat(65)] {
            assert_eq!(StepName::new(bad), Err(InvalidStep::Name), "{bad}");
        }
    }

    #[test]
    fn encoding_round_trips() {
        let steps = vec![
            done("debit", "{\"hold\":1}"),
            Step::done(name("empty"), Vec::new()).unwrap(),
            Step::done(name("binary"), vec![0u8, 255, 1]).unwrap(),
            Step::unknown(name("bank")),
        ];
        let bytes = encode(&steps);
        assert_eq!(
            bytes.len(),
            1 + steps.iter().map(Step::encoded_len).sum::<usize>()
        );
        assert_eq!(decode(&bytes).unwrap(), steps);
        assert!(encode(&[]).is_empty());
        assert!(decode(&[]).unwrap().is_empty());
    }

    #[test]
    fn malformed_encodings_are_corrupt() {
        let good = encode(&[done("a", "xy")]);
        for bad in [
            vec![2u8],
            good[..good.len() - 1].to_vec(),
            [&good[..], &[9u8][..]].concat(),
            vec![1, 1, b' ', 1],
            vec![1, 1, b'a', 7],
        ] {
            assert!(
                matches!(decode(&bad), Err(StoreError::Corrupt(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn recording_appends_repeats_and_refuses() {
        let mut steps = Vec::new();
        assert_eq!(record(&mut steps, &done("a", "1")), Ok(true));
        assert_eq!(record(&mut steps, &done("a", "1")), Ok(false));
        assert_eq!(
            record(&mut steps, &done("a", "2")),
            Err(StepRefused::Conflict(name("a")))
        );
        assert_eq!(record(&mut steps, &Step::unknown(name("b"))), Ok(true));
        assert_eq!(record(&mut steps, &Step::unknown(name("b"))), Ok(false));
        assert_eq!(
            record(&mut steps, &done("c", "3")),
            Err(StepRefused::AfterUnknown(name("b")))
        );
        // the unknown step, run again, finishes
        assert_eq!(record(&mut steps, &done("b", "2")), Ok(true));
        assert_eq!(
            record(&mut steps, &Step::unknown(name("b"))),
            Err(StepRefused::Conflict(name("b")))
        );
        assert_eq!(record(&mut steps, &done("c", "3")), Ok(true));
        assert_eq!(steps, vec![done("a", "1"), done("b", "2"), done("c", "3")]);
    }

    #[test]
    fn records_are_bounded_in_steps_and_bytes() {
        let mut steps = Vec::new();
        for i in 0..MAX_STEPS {
            assert_eq!(record(&mut steps, &done(&format!("s{i}"), "")), Ok(true));
        }
        assert_eq!(
            record(&mut steps, &done("one-more", "")),
            Err(StepRefused::Full)
        );
        let mut steps = Vec::new();
        let big = Step::done(name("big"), vec![0u8; MAX_STEPS_BYTES - 100]).unwrap();
        assert_eq!(record(&mut steps, &big), Ok(true));
        let more = Step::done(name("more"), vec![0u8; 200]).unwrap();
        assert_eq!(record(&mut steps, &more), Err(StepRefused::Full));
        assert_eq!(steps.len(), 1);
        assert_eq!(
            Step::done(name("x"), vec![0u8; MAX_STEPS_BYTES + 1]),
            Err(InvalidStep::TooLarge)
        );
    }

    #[test]
    fn step_keys_are_stable_and_distinct() {
        let key = Key::parse("s", "n", "k").unwrap();
        let fp = Fingerprint::of_bytes(b"in");
        let a = step_key(&key, &fp, &name("a"));
        assert_eq!(a, step_key(&key, &fp, &name("a")));
        assert_eq!(a.len(), 32);
        assert_ne!(a, step_key(&key, &fp, &name("b")));
        assert_ne!(
            a,
            step_key(&key, &Fingerprint::of_bytes(b"other"), &name("a"))
        );
        let other = Key::parse("s", "nk", "").ok();
        if let Some(other) = other {
            assert_ne!(a, step_key(&other, &fp, &name("a")));
        }
        assert_ne!(
            a,
            step_key(&Key::parse("s2", "n", "k").unwrap(), &fp, &name("a"))
        );
    }
}
