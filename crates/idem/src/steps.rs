//! Multi-step work that survives a crash half way: recovery points.
//!
//! [`Once::steps`](crate::Once::steps) runs work made of named steps. Each step's output is
//! stored on the record, under the attempt's lease, before the next step starts. An attempt
//! that takes the key over after a crash (or runs again after a retryable failure) gets the
//! finished steps' outputs back without running them, and goes on at the first step that has
//! none. The last value is the record's answer, replayed to every retry as with
//! [`Once::run`](crate::Once::run).
//!
//! A step that calls another service gets a [step key](StepContext::key), derived from the
//! record's key, its input and the step's name: the same on every attempt, so the service can
//! recognise a call it has seen. A call to another service runs **at least once**: if the
//! process stops after the service acted but before the step was recorded, the next attempt
//! calls again, with the same step key. A call whose outcome is unknown (it timed out after
//! sending) can be recorded as such ([`Steps::call`]); the attempt stops, and the next one
//! runs the step again with [`StepContext::after_unknown`] set, so that it can ask the service
//! what became of the first call before sending another.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use idem_core::{
    Clock, DynStore, Fingerprint, InvalidStep, Key, Lease, Step, StepError, StepName, StepOutcome,
    StepRefused, Store, StoreError,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde::ser::Error as _;

use crate::claim::settle_retrying;

/// Why a step did not give a value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepFailure<E> {
    /// The step's work failed; the run's error policy decides what becomes of the key (see
    /// [`Once::permanent_if`](crate::Once::permanent_if)).
    #[error("the step failed")]
    Failed(E),
    /// Another attempt took the key over: this one must stop, and its steps are not recorded.
    #[error("the lease was lost; the step was not recorded")]
    LeaseLost,
    /// The step ran but its output could not be stored; the key is released, and the next
    /// attempt runs the step again (with the same step key).
    #[error("the step ran but could not be recorded: {0}")]
    NotRecorded(#[source] StoreError),
    /// The step's name is invalid, or the record refused it.
    #[error(transparent)]
    Problem(StepProblem),
    /// A recorded step's output could not be decoded (its type changed since it was
    /// recorded); the key is released.
    #[error("cannot decode the step's output: {0}")]
    Codec(#[source] serde_json::Error),
    /// The step ran, but its output cannot be recorded: it does not encode, does not decode
    /// back as it was written (a non-finite float becomes `null`), or is larger than a record
    /// keeps. Every attempt would run the step and fail the same way, so the run stores a
    /// marker instead of releasing the key, and retries get
    /// [`RunError::Codec`](crate::RunError::Codec) without running anything.
    #[error("the step ran but its output cannot be recorded: {0}")]
    Unrecordable(#[source] serde_json::Error),
}

/// A step the record cannot take.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepProblem {
    /// Its name or output is not one a record keeps.
    #[error(transparent)]
    Invalid(#[from] InvalidStep),
    /// The record refused it: a step of that name recorded with another outcome, a step after
    /// one whose outcome is unknown, or more steps than a record keeps.
    #[error(transparent)]
    Refused(StepRefused),
}

/// What a step's work is told.
#[derive(Debug, Clone)]
pub struct StepContext {
    key: String,
    after_unknown: bool,
}

impl StepContext {
    /// The idempotency key to send to the service this step calls: the same on every attempt
    /// of this request, different for every other request and step (see
    /// [`idem_core::step_key`]).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether an earlier attempt ran this step and its outcome is unknown: the service may
    /// have acted. Ask it (by [`StepContext::key`]) before calling again, or rely on it to
    /// recognise the key.
    pub fn after_unknown(&self) -> bool {
        self.after_unknown
    }
}

/// The steps of one attempt: hands back recorded outputs, runs and records the rest. Cheap to
/// clone; every clone is the same attempt.
pub struct Steps<S, C> {
    inner: Arc<Inner<S, C>>,
}

impl<S, C> Clone for Steps<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<S, C> {
    store: S,
    clock: C,
    key: Key,
    fingerprint: Fingerprint,
    lease: Lease,
    resumed: usize,
    recorded: Mutex<Vec<Step>>,
}

impl<S: Store + Clone, C: Clock + Clone> Steps<S, C> {
    /// The steps of the attempt holding `lease`, with the ones earlier attempts recorded.
    pub(crate) fn new(
        store: S,
        clock: C,
        key: Key,
        fingerprint: Fingerprint,
        lease: Lease,
        recorded: Vec<Step>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                clock,
                key,
                fingerprint,
                lease,
                resumed: recorded.len(),
                recorded: Mutex::new(recorded),
            }),
        }
    }

    /// The recorded steps of a key taken over, read under `lease`: none on the lease that
    /// created the record; `None` if the lease no longer holds the record.
    pub(crate) async fn recorded(
        store: &S,
        clock: &C,
        key: &Key,
        lease: &Lease,
    ) -> Result<Option<Vec<Step>>, StoreError> {
        // The lease that created the record: no attempt before it recorded anything.
        if !lease.may_resume() {
            return Ok(Some(Vec::new()));
        }
        // Through `DynStore`, as the run's own store calls are: this future is then `Send`
        // for a store chosen at run time (`Arc<dyn DynStore>`) too.
        let store: &dyn DynStore = store;
        let record = store.get(key, clock.now()).await?;
        Ok(record.filter(|r| r.holds(lease)).map(|r| r.steps))
    }

    /// The lease of this attempt; its fence can guard writes elsewhere.
    pub fn lease(&self) -> Lease {
        self.inner.lease
    }

    /// How many steps earlier attempts had recorded when this one began (0 on a first run).
    pub fn resumed(&self) -> usize {
        self.inner.resumed
    }

    /// The step key of the step `name` (see [`StepContext::key`]).
    pub fn key_of(&self, name: &StepName) -> String {
        idem_core::step_key(&self.inner.key, &self.inner.fingerprint, name)
    }

    /// Runs the step `name` unless it is recorded, then records its output. A recorded step's
    /// output is handed back without running `work`. A failed step is not recorded: the error
    /// is the step's [`StepFailure::Failed`].
    pub async fn step<T, E, F, Fut>(&self, name: &str, work: F) -> Result<T, StepFailure<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(StepContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call(name, |_: &E| false, work).await
    }

    /// [`Steps::step`] for a call to another service: an error for which `unknown` answers
    /// `true` (a timeout after the request was sent) records the step as unknown before it is
    /// returned, so the next attempt knows ([`StepContext::after_unknown`]).
    pub async fn call<T, E, F, Fut>(
        &self,
        name: &str,
        unknown: impl Fn(&E) -> bool,
        work: F,
    ) -> Result<T, StepFailure<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(StepContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let name = StepName::new(name).map_err(|e| StepFailure::Problem(e.into()))?;
        let before = {
            let recorded = self.lock();
            let before = recorded.iter().find(|s| s.name == name).cloned();
            if before.is_none() {
                // What the record would refuse anyway, refused before the step runs rather
                // than after its effect.
                idem_core::step::may_add(&recorded)
                    .map_err(|r| StepFailure::Problem(StepProblem::Refused(r)))?;
            }
            before
        };
        let after_unknown = match before.map(|s| s.outcome) {
            Some(StepOutcome::Done(output)) => {
                return serde_json::from_slice(&output).map_err(StepFailure::Codec);
            }
            Some(StepOutcome::Unknown) => true,
            None => false,
        };
        let context = StepContext {
            key: self.key_of(&name),
            after_unknown,
        };
        match work(context).await {
            Ok(value) => {
                let output = serde_json::to_vec(&value).map_err(StepFailure::Unrecordable)?;
                // A later attempt reads the output back instead of running the step: one that
                // does not decode would fail every attempt after the effect.
                serde_json::from_slice::<T>(&output).map_err(StepFailure::Unrecordable)?;
                let step = Step::done(name, output).map_err(|e| match e {
                    InvalidStep::TooLarge => {
                        StepFailure::Unrecordable(serde_json::Error::custom(e.to_string()))
                    }
                    e => StepFailure::Problem(e.into()),
                })?;
                self.record(step).await.map_err(|f| match f {
                    // Past the record's bytes with this output: it would be refused again.
                    StepFailure::Problem(StepProblem::Refused(r @ StepRefused::Full)) => {
                        StepFailure::Unrecordable(serde_json::Error::custom(r.to_string()))
                    }
                    f => f,
                })?;
                Ok(value)
            }
            Err(error) if unknown(&error) => {
                self.record(Step::unknown(name)).await?;
                Err(StepFailure::Failed(error))
            }
            Err(error) => Err(StepFailure::Failed(error)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Step>> {
        self.inner
            .recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `step`, retrying while the store is briefly unavailable.
    ///
    /// Not finished in the background if the attempt is dropped meanwhile: the run's guard
    /// releases the key then, and a recording that landed after the release would be refused
    /// anyway. The step is then not recorded, and the next attempt runs it again under the same
    /// step key (calls to other services run at least once).
    async fn record<E>(&self, step: Step) -> Result<(), StepFailure<E>> {
        let Inner {
            store,
            clock,
            key,
            lease,
            ..
        } = &*self.inner;
        let store: &dyn DynStore = store;
        let recorded = settle_retrying(|| store.record_step(key, lease, &step, clock.now())).await;
        match recorded {
            Ok(()) => {
                let mut recorded = self.lock();
                match recorded.iter_mut().find(|s| s.name == step.name) {
                    Some(s) => *s = step,
                    None => recorded.push(step),
                }
                Ok(())
            }
            Err(StepError::Refused(StepRefused::Stale(_))) => Err(StepFailure::LeaseLost),
            Err(StepError::Refused(r)) => Err(StepFailure::Problem(StepProblem::Refused(r))),
            Err(StepError::Store(e)) => Err(StepFailure::NotRecorded(e)),
            // `StepError` is non-exhaustive; an unknown refusal means the step was not recorded.
            Err(e) => Err(StepFailure::NotRecorded(StoreError::backend(
                "the step was not recorded",
                e,
            ))),
        }
    }
}
