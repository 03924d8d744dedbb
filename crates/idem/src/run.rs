//! Run a piece of work at most once per key and replay its result to every repeat.

use std::future::Future;
use std::time::Duration;

use crate::cancel::finishing;
use crate::claim::{InFlight, begin_waiting, settle_retrying};
use crate::steps::{StepFailure, StepProblem, Steps};
use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Clock, DEFAULT_LEASE, DEFAULT_TTL, DynStore, Fingerprint,
    Key, Lease, LeaseError, Store, StoreError, SystemClock,
};
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Serialize};

/// The engine: a store and a clock.
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem::{Idempotency, Key, MemoryStore};
///
/// let idem = Idempotency::new(MemoryStore::new());
/// let key = Key::parse("tenant-1", "charge", "order-42")?;
/// let charge = serde_json::json!({"amount": 500, "currency": "EUR"});
///
/// let first = idem
///     .once(&key)
///     .input(&charge)?
///     .run(|_lease| async { Ok::<_, String>("ch_1".to_owned()) })
///     .await?;
/// let retry = idem
///     .once(&key)
///     .input(&charge)?
///     .run(|_lease| async { Ok::<_, String>("ch_2".to_owned()) })
///     .await?;
/// assert_eq!(retry.value, "ch_1"); // the work ran once; the retry got the first answer
/// assert!(retry.replayed && !first.replayed);
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Idempotency<S, C = SystemClock> {
    store: S,
    clock: C,
}

impl<S: Store + Clone> Idempotency<S> {
    /// An engine over `store` with the system clock.
    pub fn new(store: S) -> Self {
        Self {
            store,
            clock: SystemClock,
        }
    }
}

impl<S: Store + Clone, C: Clock + Clone> Idempotency<S, C> {
    /// The same engine with another clock (a [`ManualClock`](idem_core::ManualClock) in tests).
    pub fn with_clock<C2: Clock + Clone>(self, clock: C2) -> Idempotency<S, C2> {
        Idempotency {
            store: self.store,
            clock,
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// Starts describing one run of work under `key`. The defaults: no input (an empty
    /// fingerprint), the default lease (60 s) and TTL (24 h), every error retryable, and an
    /// attempt in flight answered with [`RunError::InProgress`] at once.
    pub fn once<'a>(&'a self, key: &'a Key) -> Once<'a, S, C> {
        Once {
            engine: self,
            key,
            fingerprint: Fingerprint::of_bytes(b""),
            lease: DEFAULT_LEASE,
            ttl: DEFAULT_TTL,
            in_flight: InFlight::Reject,
            classify: AllRetryable,
        }
    }
}

/// Decides whether an error of the work is permanent (stored and replayed to every retry) or
/// retryable (the key is released so that a retry runs the work again).
pub trait ErrorPolicy<E> {
    /// `true`: store the error as the result; `false`: release the key.
    fn is_permanent(&self, error: &E) -> bool;
}

/// The default policy: every error is retryable.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllRetryable;

impl<E> ErrorPolicy<E> for AllRetryable {
    fn is_permanent(&self, _: &E) -> bool {
        false
    }
}

/// A policy given as a function.
#[derive(Debug, Clone, Copy)]
pub struct PermanentIf<F>(F);

impl<E, F: Fn(&E) -> bool> ErrorPolicy<E> for PermanentIf<F> {
    fn is_permanent(&self, error: &E) -> bool {
        (self.0)(error)
    }
}

/// One run of work under a key: set options, then [`Once::run`].
#[must_use = "nothing runs until `.run(work)` is awaited"]
pub struct Once<'a, S, C, P = AllRetryable> {
    engine: &'a Idempotency<S, C>,
    key: &'a Key,
    fingerprint: Fingerprint,
    lease: Duration,
    ttl: Duration,
    in_flight: InFlight,
    classify: P,
}

/// The result of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done<T> {
    /// The work's value: computed now, or the stored one.
    pub value: T,
    /// `true` if the value was stored by an earlier run and is replayed.
    pub replayed: bool,
    /// The fence of the lease under which the value was computed.
    pub fence: u64,
}

/// Why a run did not produce a value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// The work failed. A permanent error is stored (and `replayed` on every retry); a
    /// retryable one released the key, so a retry runs the work again.
    #[error("the work failed ({})", if *.replayed { "stored failure replayed" } else { "this attempt" })]
    Failed {
        /// The work's error.
        error: E,
        /// `true` if this is a stored permanent failure from an earlier run.
        replayed: bool,
    },
    /// Another attempt holds the key (and waiting, if asked for, did not see it finish).
    #[error("another attempt is in progress; retry after {retry_after:?}")]
    InProgress {
        /// How long until that attempt's lease runs out.
        retry_after: Duration,
    },
    /// The key was used before with a different input.
    #[error("the key was used with a different input")]
    Mismatch,
    /// The work ran, but its lease had been taken over (it ran longer than the lease), so its
    /// result was not stored, nor its retryable failure acted on: another attempt owns the key
    /// now.
    #[error("the lease was lost while the work ran; its result was not stored")]
    LeaseLost,
    /// The work ran, but storing its result failed; the record stays in progress until its
    /// lease runs out, and then a retry runs the work again. (A step that could not be
    /// recorded releases the key at once: the retry resumes at that step.)
    #[error("the work ran but its result could not be stored: {0}")]
    NotRecorded(#[source] StoreError),
    /// The store failed before the work could be claimed: the work did not run.
    #[error("the work did not run: {0}")]
    Store(#[source] StoreError),
    /// A step could not be recorded: its name is not a valid step name, or the record refused
    /// it (a step of that name recorded with another outcome, a step after one whose outcome
    /// is unknown, or more steps than a record keeps). The key was released.
    #[error("the step could not be recorded: {0}")]
    Step(#[source] StepProblem),
    /// The value or the error could not be serialised (the work ran; a marker is stored so
    /// that retries get this error instead of running the work again), or a stored one could
    /// not be read back.
    #[error("cannot encode or decode the stored result: {0}")]
    Codec(#[source] serde_json::Error),
}

/// A result as stored: the work's value, or its permanent error.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Stored<T, E> {
    Ok(T),
    Err(E),
    /// The work ran, but its result could not be serialised.
    Unencodable(String),
}

impl<'a, S: Store + Clone, C: Clock + Clone, P> Once<'a, S, C, P> {
    /// The input that identifies the request: its canonical JSON is fingerprinted, and a
    /// later run with the same key but another input is a [`RunError::Mismatch`].
    pub fn input<I: Serialize + ?Sized>(mut self, input: &I) -> Result<Self, serde_json::Error> {
        self.fingerprint = Fingerprint::of_serialize(input)?;
        Ok(self)
    }

    /// Sets the fingerprint directly.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// How long the work may run before another attempt may take the key over.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long the result is kept and replayed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// What to do when another attempt holds the key.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// Store (and replay) the errors for which `permanent` answers `true`; release the key
    /// for the others.
    pub fn permanent_if<E, F: Fn(&E) -> bool>(
        self,
        permanent: F,
    ) -> Once<'a, S, C, PermanentIf<F>> {
        Once {
            engine: self.engine,
            key: self.key,
            fingerprint: self.fingerprint,
            lease: self.lease,
            ttl: self.ttl,
            in_flight: self.in_flight,
            classify: PermanentIf(permanent),
        }
    }

    /// Runs `work` unless a result is stored, and stores its result.
    ///
    /// `work` gets the [`Lease`]; its `fence` can guard writes to other resources.
    ///
    /// This future may be dropped at any point (a timeout, a cancelled request) and leaves no
    /// key held for nobody:
    /// - while the store is taking the key, the `begin` is finished in the background and a
    ///   key it took is released at once;
    /// - while the work runs (or if the work panics), the key is released in the background,
    ///   so that a retry does not have to wait for the lease to run out;
    /// - while the result is being stored (or the key released after a retryable error),
    ///   that is finished in the background: the work has run, and a retry gets its result.
    pub async fn run<T, E, F, Fut>(self, work: F) -> Result<Done<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        P: ErrorPolicy<E>,
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.execute(|lease| async move { work(lease).await.map_err(Halt::Work) })
            .await
    }

    /// Runs multi-step `work` unless a result is stored, resuming after the steps an earlier
    /// attempt recorded (see [`crate::steps`]). `work` gets the attempt's [`Steps`]; each
    /// [`Steps::step`] runs once per request, and its output is recorded before the next step
    /// starts. The value `work` returns is stored and replayed, as by [`Once::run`]; its
    /// errors are classified as there (a retryable one releases the key, and the recorded
    /// steps stay for the retry to resume).
    ///
    /// A retry whose input differs from the first attempt's is [`RunError::Mismatch`], never
    /// resumed. Dropped part way, the attempt behaves as [`Once::run`] does (the key is
    /// released); a step whose recording had not finished is run again by the next attempt.
    ///
    /// ```
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idem::{Idempotency, Key, MemoryStore, StepFailure};
    ///
    /// let idem = Idempotency::new(MemoryStore::new());
    /// let key = Key::parse("bank", "transfer", "t-1")?;
    /// let done = idem
    ///     .once(&key)
    ///     .input(&("alice", "bob", 100))?
    ///     .steps(|s| async move {
    ///         let hold: u64 = s.step("debit", |_| async { Ok::<_, String>(41) }).await?;
    ///         // The bank gets a key of this step's own, the same on every attempt.
    ///         let receipt: String = s
    ///             .step("bank", |cx| async move { Ok(format!("tx-{hold}-{}", &cx.key()[..4])) })
    ///             .await?;
    ///         s.step("credit", |_| async move { Ok::<_, String>(receipt) }).await
    ///     })
    ///     .await?;
    /// assert!(done.value.starts_with("tx-41-"));
    /// # let _: Option<StepFailure<String>> = None;
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    pub async fn steps<T, E, F, Fut>(self, work: F) -> Result<Done<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        P: ErrorPolicy<E>,
        F: FnOnce(Steps<S, C>) -> Fut,
        Fut: Future<Output = Result<T, StepFailure<E>>>,
    {
        let (store, clock) = (self.engine.store.clone(), self.engine.clock.clone());
        let (key, fingerprint) = (self.key.clone(), self.fingerprint);
        self.execute(|lease| async move {
            let recorded = match Steps::recorded(&store, &clock, &key, &lease).await {
                Ok(Some(recorded)) => recorded,
                Ok(None) => return Err(Halt::Engine(RunError::LeaseLost)),
                Err(e) => return Err(Halt::Engine(RunError::Store(e))),
            };
            let steps = Steps::new(store, clock, key, fingerprint, lease, recorded);
            work(steps).await.map_err(halt)
        })
        .await
    }

    /// [`Once::run`] for work that can also stop for a reason of the engine's ([`Halt`]).
    pub(crate) async fn execute<T, E, F, Fut>(self, work: F) -> Result<Done<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        P: ErrorPolicy<E>,
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<T, Halt<E>>>,
    {
        let engine = self.engine;
        let req = BeginRequest::new(self.key.clone(), self.fingerprint)
            .with_lease(self.lease)
            .with_ttl(self.ttl);
        let lease = match self.claim(&req).await? {
            Claim::Acquired(lease) => lease,
            Claim::Replay { response, fence } => {
                return match serde_json::from_slice(&response).map_err(RunError::Codec)? {
                    Stored::Ok(value) => Ok(Done {
                        value,
                        replayed: true,
                        fence,
                    }),
                    Stored::Err(error) => Err(RunError::Failed {
                        error,
                        replayed: true,
                    }),
                    Stored::Unencodable(why) => Err(RunError::Codec(serde_json::Error::custom(
                        format!("the first run's result could not be stored: {why}"),
                    ))),
                };
            }
        };

        let mut guard = ReleaseOnDrop {
            store: Some(engine.store.clone()),
            clock: engine.clock.clone(),
            key: self.key.clone(),
            lease,
        };
        let result = work(lease).await;

        // Decide what to store while the guard is still armed: a panic in the error policy or
        // in a `Serialize` impl gives the key back like a panic in the work.
        let stored = match &result {
            Ok(value) => Some(encode(&Stored::<&T, &E>::Ok(value))),
            Err(Halt::Unrecordable(codec)) => Some(Err(serde_json::Error::custom(codec))),
            Err(Halt::Work(error)) if self.classify.is_permanent(error) => {
                Some(encode(&Stored::<&T, &E>::Err(error)))
            }
            // Another attempt holds the key now: nothing of it is this one's to settle.
            Err(Halt::Engine(RunError::LeaseLost)) => {
                guard.store = None;
                return Err(RunError::LeaseLost);
            }
            Err(_) => None,
        };
        // From here the outcome is known and is settled below; a retry must not run the work
        // again just because this future is dropped while the store answers.
        guard.store = None;

        match stored {
            Some(Ok(bytes)) => {
                settle(engine, self.key, lease, Some(bytes))
                    .await
                    .map_err(lease_error)?;
            }
            Some(Err(codec)) => {
                // The work ran but its result cannot be encoded. Releasing the key would let a
                // retry run the work again; store a marker instead, replayed as this error.
                let marker = encode(&Stored::<(), ()>::Unencodable(codec.to_string()))
                    .map_err(RunError::Codec)?;
                settle(engine, self.key, lease, Some(marker))
                    .await
                    .map_err(lease_error)?;
                return Err(RunError::Codec(codec));
            }
            None => {
                // Another attempt took the key over while the work ran: its outcome is the
                // key's, and this failure (perhaps its very consequence, as a fenced
                // resource's refusal) is nobody's to act on. If the release fails otherwise,
                // the key frees itself when the lease runs out and the caller still gets the
                // work's own error.
                if let Err(e @ LeaseError::Stale(_)) = settle(engine, self.key, lease, None).await {
                    return Err(lease_error(e));
                }
            }
        }
        match result {
            Ok(value) => Ok(Done {
                value,
                replayed: false,
                fence: lease.fence,
            }),
            Err(Halt::Work(error)) => Err(RunError::Failed {
                error,
                replayed: false,
            }),
            Err(Halt::Engine(e)) => Err(e),
            // Stored as a marker and answered above.
            Err(Halt::Unrecordable(codec)) => Err(RunError::Codec(codec)),
        }
    }

    async fn claim<E>(&self, req: &BeginRequest) -> Result<Claim, RunError<E>> {
        let engine = self.engine;
        let outcome = begin_waiting(&engine.store, &engine.clock, req, self.in_flight)
            .await
            .map_err(RunError::Store)?;
        match outcome {
            BeginOutcome::Acquired(lease) => Ok(Claim::Acquired(lease)),
            BeginOutcome::Replay(r) => Ok(Claim::Replay {
                response: r.response,
                fence: r.fence,
            }),
            BeginOutcome::Mismatch => Err(RunError::Mismatch),
            BeginOutcome::InProgress { lease_expires_at } => Err(RunError::InProgress {
                retry_after: lease_expires_at.saturating_since(engine.clock.now()),
            }),
        }
    }
}

/// Completes the record with `response`, or releases the key if there is none, retrying while
/// the store is briefly unavailable. Carried on to its end if the caller stops waiting: the
/// work has run, and its outcome is recorded whatever becomes of the caller.
///
/// Through [`DynStore`], whose futures are boxed and `Send` by name, so that this future is
/// `Send` for a store chosen at run time (`Arc<dyn DynStore>`) too.
fn settle<S: Store + Clone, C: Clock + Clone>(
    engine: &Idempotency<S, C>,
    key: &Key,
    lease: Lease,
    response: Option<Bytes>,
) -> impl Future<Output = Result<(), LeaseError>> + Send + 'static {
    let (store, clock, key) = (engine.store.clone(), engine.clock.clone(), key.clone());
    let call = async move {
        let store: &dyn DynStore = &store;
        match response {
            Some(bytes) => {
                settle_retrying(|| store.complete(&key, &lease, bytes.clone(), clock.now())).await
            }
            None => settle_retrying(|| store.release(&key, &lease, clock.now())).await,
        }
    };
    finishing(call, |_| async {})
}

/// A step's failure as the run sees it.
fn halt<E>(failure: StepFailure<E>) -> Halt<E> {
    match failure {
        StepFailure::Failed(e) => Halt::Work(e),
        StepFailure::LeaseLost => Halt::Engine(RunError::LeaseLost),
        StepFailure::NotRecorded(e) => Halt::Engine(RunError::NotRecorded(e)),
        StepFailure::Problem(p) => Halt::Engine(RunError::Step(p)),
        StepFailure::Codec(e) => Halt::Engine(RunError::Codec(e)),
        StepFailure::Unrecordable(e) => Halt::Unrecordable(e),
    }
}

/// Why work run by [`Once::execute`] stopped without a value.
pub(crate) enum Halt<E> {
    /// The work's own error, classified by the policy.
    Work(E),
    /// The engine's: the key is released (a step that could not be recorded) unless the lease
    /// was lost.
    Engine(RunError<E>),
    /// Work ran whose result can never be recorded (a step's output): a marker is stored, as
    /// for a result that does not encode.
    Unrecordable(serde_json::Error),
}

enum Claim {
    Acquired(Lease),
    Replay { response: Bytes, fence: u64 },
}

/// The bytes [`Once::run`] stores for a successful `value`: what work that completes the record
/// itself, inside a transaction of its own (`PostgresStore::complete_in`), must store, so that
/// the `complete` that `run` sends afterwards finds the same response and changes nothing.
pub fn stored_value<T: Serialize + ?Sized>(value: &T) -> Result<Bytes, serde_json::Error> {
    encode(&Stored::<&T, ()>::Ok(value))
}

fn encode<T: Serialize>(value: &T) -> Result<Bytes, serde_json::Error> {
    serde_json::to_vec(value).map(Bytes::from)
}

fn lease_error<E>(e: LeaseError) -> RunError<E> {
    match e {
        LeaseError::Stale(_) => RunError::LeaseLost,
        LeaseError::Store(e) => RunError::NotRecorded(e),
        // `LeaseError` is non-exhaustive; an unknown refusal means the result was not stored.
        _ => RunError::LeaseLost,
    }
}

/// Releases the key if the work never finished (its future was dropped, or it panicked).
struct ReleaseOnDrop<S: Store + Clone, C: Clock> {
    store: Option<S>,
    clock: C,
    key: Key,
    lease: Lease,
}

impl<S: Store + Clone, C: Clock> Drop for ReleaseOnDrop<S, C> {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        // Without a runtime the lease simply runs out.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (key, lease, now) = (self.key.clone(), self.lease, self.clock.now());
            handle.spawn(async move {
                let store: &dyn DynStore = &store;
                let _ = settle_retrying(|| store.release(&key, &lease, now)).await;
            });
        }
    }
}
