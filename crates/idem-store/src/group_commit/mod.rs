//! Group commit for the stores on servers: PostgreSQL, MySQL and Redis.
//!
//! A small write on PostgreSQL or MariaDB spends most of its time on what every statement
//! pays whatever its size: the round trip, parsing and executor start-up, the commit and its
//! log flush; on Redis, a command's parsing, dispatch and reply, and a script's start-up. When many tasks begin (or complete) records at once, the calls that arrive while
//! a statement is in flight wait for it and then go to the server together, as one statement
//! over many rows: one round trip and one flush serve them all. A caller that finds a lane free
//! is sent at once, as a batch of one, so nothing waits for company that is not coming.
//!
//! No crate does this for sqlx (its pool hands out connections, one statement each) or for
//! redis-rs (its multiplexed connection pipelines commands, but each stays a command), hence this
//! module: a queue, at most `lanes` tasks draining it, and a reply channel per call.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Key, Lease, LeaseError, Record, StoreError, Timestamp,
};
use tokio::sync::oneshot;

/// One call waiting for its batch.
pub(crate) trait Job: Send + 'static {
    /// The record it changes: two jobs on one record never share a batch, since one statement
    /// may change a row only once.
    fn key(&self) -> &Key;
    /// The bytes it adds to a statement (a response body, say); a batch stops growing at
    /// [`MAX_BATCH_BYTES`].
    fn bytes(&self) -> usize;
}

/// The most jobs a batch may be set to hold: MySQL takes at most 65,535 parameters per
/// statement, and a batched row binds 11.
pub(crate) const MAX_JOBS: usize = 1024;

/// A batch holds at most this many bytes of payload, unless its one job is bigger.
const MAX_BATCH_BYTES: usize = 1 << 20;

/// Jobs of one kind (`begin`s, or `complete`s), queued for at most `lanes` concurrent batches of
/// at most `max_jobs` each. Clones share the queue.
pub(crate) struct Batcher<T, R> {
    shared: Arc<Shared<T, R>>,
}

struct Shared<T, R> {
    state: Mutex<State<T, R>>,
    lanes: usize,
    max_jobs: usize,
}

struct State<T, R> {
    queue: VecDeque<(T, oneshot::Sender<R>)>,
    /// Lanes draining the queue now.
    running: usize,
    /// Whether a caller is running its job itself (it found nothing queued or in flight).
    inline: bool,
}

impl<T, R> Clone for Batcher<T, R> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T, R> fmt::Debug for Batcher<T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batcher")
            .field("lanes", &self.shared.lanes)
            .field("max_jobs", &self.shared.max_jobs)
            .finish_non_exhaustive()
    }
}

impl<T: Job, R: Send + 'static> Batcher<T, R> {
    /// At most `lanes` batches in flight at once (at least 1), each of at most `max_jobs` jobs
    /// (1 to [`MAX_JOBS`]).
    pub(crate) fn new(lanes: usize, max_jobs: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    running: 0,
                    inline: false,
                }),
                lanes: lanes.max(1),
                max_jobs: max_jobs.clamp(1, MAX_JOBS),
            }),
        }
    }

    /// Runs `job` and returns its result.
    ///
    /// When nothing else is queued or in flight, the caller runs it at once as a batch of one
    /// (a lone sequential caller pays nothing for batching). Otherwise it is queued, and if
    /// fewer than `lanes` lanes are running one is spawned on the caller's runtime with the
    /// runner `start` makes: it drains the queue batch by batch, `run` getting the jobs of a
    /// batch and returning their results in order. A queued caller that goes away before its
    /// batch is taken is dropped from the queue and never runs; one that goes away later leaves
    /// its batch to finish.
    pub(crate) async fn submit<F, Fut>(
        &self,
        job: T,
        start: impl FnOnce() -> F,
    ) -> Result<R, StoreError>
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let queued = {
            let mut state = self.shared.lock();
            if state.running == 0 && !state.inline && state.queue.is_empty() {
                state.inline = true;
                Err(job)
            } else {
                let (reply, result) = oneshot::channel();
                state.queue.push_back((job, reply));
                let free = state.running < self.shared.lanes;
                if free {
                    state.running += 1;
                }
                Ok((free, result))
            }
        };
        match queued {
            Err(job) => {
                let _inline = Inline(&self.shared);
                start()(vec![job]).await.pop().ok_or_else(lost)
            }
            Ok((spawn, result)) => {
                if spawn {
                    tokio::spawn(drain(Lane(Some(self.shared.clone())), start()));
                }
                result.await.map_err(|_| lost())
            }
        }
    }
}

impl<T: Job, R> Shared<T, R> {
    fn lock(&self) -> MutexGuard<'_, State<T, R>> {
        // The state is a queue and a count, changed in single steps: a panic elsewhere while
        // it was held leaves it whole.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next batch, in queue order: jobs whose caller went away are dropped, a job whose
    /// record is already in the batch waits for the next one. `None` (and the lane stops) when
    /// the queue is empty.
    fn next_batch(&self) -> Option<(Vec<T>, Vec<oneshot::Sender<R>>)> {
        let mut state = self.lock();
        let mut jobs = Vec::new();
        let mut replies = Vec::new();
        let mut keys = HashSet::new();
        let mut bytes = 0usize;
        let mut later = VecDeque::new();
        while let Some((job, reply)) = state.queue.pop_front() {
            if reply.is_closed() {
                continue;
            }
            let fits = jobs.is_empty() || bytes.saturating_add(job.bytes()) <= MAX_BATCH_BYTES;
            if !fits || jobs.len() == self.max_jobs {
                state.queue.push_front((job, reply));
                break;
            }
            if !keys.insert(job.key().clone()) {
                later.push_back((job, reply));
                continue;
            }
            bytes = bytes.saturating_add(job.bytes());
            jobs.push(job);
            replies.push(reply);
        }
        while let Some(waiting) = later.pop_back() {
            state.queue.push_front(waiting);
        }
        if jobs.is_empty() {
            state.running -= 1;
            return None;
        }
        Some((jobs, replies))
    }
}

/// A caller running its own job; however it ends (done, or the caller went away), the next
/// idle caller may run inline again.
struct Inline<'a, T: Job, R>(&'a Shared<T, R>);

impl<T: Job, R> Drop for Inline<'_, T, R> {
    fn drop(&mut self) {
        self.0.lock().inline = false;
    }
}

/// A running lane's place in the count. Dropped while still held (the runner panicked, or the
/// runtime shut down under it), it gives the place back and fails the jobs still queued: their
/// callers get an error now rather than wait for a lane that a later call might start.
struct Lane<T: Job, R: Send + 'static>(Option<Arc<Shared<T, R>>>);

impl<T: Job, R: Send + 'static> Drop for Lane<T, R> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            let mut state = shared.lock();
            state.running -= 1;
            state.queue.clear();
        }
    }
}

async fn drain<T, R, F, Fut>(mut lane: Lane<T, R>, run: F)
where
    T: Job,
    R: Send + 'static,
    F: Fn(Vec<T>) -> Fut + Send + 'static,
    Fut: Future<Output = Vec<R>> + Send + 'static,
{
    let Some(shared) = lane.0.clone() else {
        return;
    };
    while let Some((jobs, replies)) = shared.next_batch() {
        let results = run(jobs).await;
        debug_assert_eq!(results.len(), replies.len());
        for (reply, result) in replies.into_iter().zip(results) {
            // The caller may have gone away meanwhile.
            let _ = reply.send(result);
        }
    }
    // `next_batch` gave the place back with the empty queue it found.
    lane.0 = None;
}

/// A `begin` waiting for its batch.
pub(crate) struct BeginJob {
    pub(crate) req: BeginRequest,
    pub(crate) now: Timestamp,
}

impl Job for BeginJob {
    fn key(&self) -> &Key {
        &self.req.key
    }

    fn bytes(&self) -> usize {
        key_bytes(&self.req.key)
    }
}

/// A `complete` waiting for its batch.
pub(crate) struct CompleteJob {
    pub(crate) key: Key,
    pub(crate) lease: Lease,
    pub(crate) response: Bytes,
    pub(crate) now: Timestamp,
}

impl Job for CompleteJob {
    fn key(&self) -> &Key {
        &self.key
    }

    fn bytes(&self) -> usize {
        key_bytes(&self.key).saturating_add(self.response.len())
    }
}

fn key_bytes(key: &Key) -> usize {
    key.scope().as_str().len() + key.namespace().as_str().len() + key.client_key().as_str().len()
}

/// A row a batched `begin` acquired: its lease id and fence.
pub(crate) type Acquired = (Vec<u8>, i64);

/// The fresh lease of one job of a batched `begin`, and the record it would write.
pub(crate) type Fresh = (Lease, Record);

/// What a batched statement reports: one answer per job, `Ok(None)` if the statement failed,
/// or the error if no connection was to be had.
pub(crate) type Many<T> = Result<Option<Vec<T>>, StoreError>;

/// A store that begins and completes many records in one statement. The statements only
/// report what they did; deciding everything else is left to the one-record calls.
pub(crate) trait ManyAtOnce: Clone + Send + Sync + 'static {
    /// The store's queues; `None` when every call goes on its own.
    fn group_commit(&self) -> Option<&GroupCommit>;

    /// `begin` of one record, as the store does it unbatched.
    fn begin_alone(
        &self,
        req: &BeginRequest,
        now: Timestamp,
    ) -> impl Future<Output = Result<BeginOutcome, StoreError>> + Send;

    /// `complete` of one record, as the store does it unbatched.
    fn complete_alone(
        &self,
        job: CompleteJob,
    ) -> impl Future<Output = Result<(), LeaseError>> + Send;

    /// Takes every key of `jobs` (at least two, each key once) that may be acquired, with the
    /// fresh lease and record of the same index. Returns the lease id and fence of each row it
    /// acquired, `Ok(None)` if the statement failed, or the error if no connection was to be
    /// had (which every job would meet on its own too).
    ///
    /// Each job not among the rows returned, and every job after `Ok(None)`, is decided by a
    /// `begin` of its own, so the answer must be exact: every row this call acquired is
    /// returned (read in the same atomic step as the write, never after other callers could
    /// change the row), and `Ok(None)` only when nothing was written. When that cannot be
    /// known (a reply lost after the write may have been applied), the answer is an error.
    fn begin_many(
        &self,
        jobs: &[BeginJob],
        fresh: &[Fresh],
    ) -> impl Future<Output = Many<Acquired>> + Send;

    /// Completes every job's record that its lease still holds. The jobs (at least two) have
    /// distinct keys and distinct lease ids. Returns, per job, whether the statement surely
    /// completed it, `Ok(None)` if the statement failed, or the error if no connection was to
    /// be had.
    fn complete_many(&self, jobs: &[CompleteJob]) -> impl Future<Output = Many<bool>> + Send;
}

/// The `begin` and `complete` queues of one store.
#[derive(Clone, Debug)]
pub(crate) struct GroupCommit {
    begins: Batcher<BeginJob, Result<BeginOutcome, StoreError>>,
    completes: Batcher<CompleteJob, Result<(), LeaseError>>,
}

impl GroupCommit {
    /// For a pool of `connections`: each queue runs at most an eighth of them at once (at
    /// least one), in batches of at most `max_jobs`. `None` (every call on its own) if
    /// `max_jobs` is 1 or less.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn new(connections: u32, max_jobs: usize) -> Option<Self> {
        Self::with_lanes(usize::try_from(connections / 8).unwrap_or(1), max_jobs)
    }

    /// At most `lanes` batches of each kind at once (at least one), of at most `max_jobs`
    /// each; `None` if `max_jobs` is 1 or less.
    pub(crate) fn with_lanes(lanes: usize, max_jobs: usize) -> Option<Self> {
        let lanes = lanes.max(1);
        (max_jobs > 1).then(|| Self {
            begins: Batcher::new(lanes, max_jobs),
            completes: Batcher::new(lanes, max_jobs),
        })
    }
}

/// `begin` through the store's queues, or on its own when it has none.
pub(crate) async fn begin<S: ManyAtOnce>(
    store: &S,
    req: &BeginRequest,
    now: Timestamp,
) -> Result<BeginOutcome, StoreError> {
    let Some(batches) = store.group_commit() else {
        return store.begin_alone(req, now).await;
    };
    let job = BeginJob {
        req: req.clone(),
        now,
    };
    batches
        .begins
        .submit(job, || {
            let store = store.clone();
            move |jobs| {
                let store = store.clone();
                async move { begin_batch(&store, jobs).await }
            }
        })
        .await?
}

/// `complete` through the store's queues, or on its own when it has none.
pub(crate) async fn complete<S: ManyAtOnce>(
    store: &S,
    key: &Key,
    lease: &Lease,
    response: Bytes,
    now: Timestamp,
) -> Result<(), LeaseError> {
    let job = CompleteJob {
        key: key.clone(),
        lease: *lease,
        response,
        now,
    };
    let Some(batches) = store.group_commit() else {
        return store.complete_alone(job).await;
    };
    batches
        .completes
        .submit(job, || {
            let store = store.clone();
            move |jobs| {
                let store = store.clone();
                async move { complete_batch(&store, jobs).await }
            }
        })
        .await?
}

/// `begin` for a batch: one statement. A job it did not acquire is decided on its own, as
/// `begin` decides a refused upsert (the statement left its row as it was, so that is the job's
/// one `begin`); if the statement failed, every job is tried on its own, so
/// one record's trouble (a lock wait that timed out) stays its own. Those run concurrently, so
/// the batch takes as long as its slowest job, not their sum. Without a connection every job
/// fails at once with that error.
async fn begin_batch<S: ManyAtOnce>(
    store: &S,
    mut jobs: Vec<BeginJob>,
) -> Vec<Result<BeginOutcome, StoreError>> {
    // A batch of one (a lone caller, inline) is the one-record call, in the caller's task.
    if jobs.len() == 1 {
        let job = jobs.remove(0);
        return vec![store.begin_alone(&job.req, job.now).await];
    }
    let fresh: Vec<_> = jobs
        .iter()
        .map(|j| {
            Record::acquired(
                &j.req,
                j.now,
                Lease::first_fence(j.now),
                idem_core::LeaseId::generate(),
            )
        })
        .collect();
    let rows = match store.begin_many(&jobs, &fresh).await {
        Ok(rows) => rows,
        Err(e) => return jobs.iter().map(|_| Err(copy(&e))).collect(),
    };
    let decided: Vec<Option<Result<BeginOutcome, StoreError>>> = fresh
        .into_iter()
        .map(|(lease, _)| {
            let id = lease.id.to_bytes();
            let (_, fence) = rows.as_ref()?.iter().find(|(got, _)| got[..] == id[..])?;
            Some(
                u64::try_from(*fence)
                    .map(|fence| BeginOutcome::Acquired(Lease { fence, ..lease }))
                    .map_err(|_| StoreError::Corrupt("the stored fence is negative".into())),
            )
        })
        .collect();
    let left = jobs
        .into_iter()
        .zip(&decided)
        .enumerate()
        .filter(|(_, (_, d))| d.is_none())
        .map(|(i, (job, _))| (i, job));
    let alone = each_alone(left, |job| {
        let store = store.clone();
        async move { store.begin_alone(&job.req, job.now).await }
    })
    .await;
    let mut results: Vec<_> = decided
        .into_iter()
        .map(|d| d.unwrap_or_else(|| Err(lost())))
        .collect();
    for (i, result) in alone {
        results[i] = result;
    }
    results
}

/// `complete` for a batch: one statement; a job it did not surely complete (a stale lease, a
/// repeated call), or every job if it failed, is settled on its own (concurrently), which finds
/// one this statement did complete already done. Without a connection every job fails at once.
async fn complete_batch<S: ManyAtOnce>(
    store: &S,
    mut jobs: Vec<CompleteJob>,
) -> Vec<Result<(), LeaseError>> {
    if jobs.len() == 1 {
        let job = jobs.remove(0);
        return vec![store.complete_alone(job).await];
    }
    // The statements tell rows apart by lease id: two jobs under one id (a caller completing
    // a key with another key's lease) go on their own instead.
    let mut ids = HashSet::new();
    let distinct = jobs.iter().all(|j| ids.insert(j.lease.id.to_bytes()));
    let done = if distinct {
        match store.complete_many(&jobs).await {
            Ok(done) => done,
            Err(e) => return jobs.iter().map(|_| Err(copy(&e).into())).collect(),
        }
    } else {
        None
    };
    let done = done
        .filter(|d| d.len() == jobs.len())
        .unwrap_or_else(|| vec![false; jobs.len()]);
    let left = jobs
        .into_iter()
        .zip(&done)
        .enumerate()
        .filter(|(_, (_, done))| !**done)
        .map(|(i, (job, _))| (i, job));
    let alone = each_alone(left, |job| {
        let store = store.clone();
        async move { store.complete_alone(job).await }
    })
    .await;
    let mut results: Vec<Result<(), LeaseError>> = done
        .iter()
        .map(|d| if *d { Ok(()) } else { Err(lost().into()) })
        .collect();
    for (i, result) in alone {
        results[i] = result;
    }
    results
}

/// Runs `run` for each job in a task of its own, all at once; answers with each job's index.
async fn each_alone<T, R, F, Fut>(jobs: impl Iterator<Item = (usize, T)>, run: F) -> Vec<(usize, R)>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let mut tasks = tokio::task::JoinSet::new();
    for (i, job) in jobs {
        let fut = run(job);
        tasks.spawn(async move { (i, fut.await) });
    }
    let mut out = Vec::new();
    // A task that panicked leaves its job's result as `lost()`.
    while let Some(done) = tasks.join_next().await {
        if let Ok(done) = done {
            out.push(done);
        }
    }
    out
}

/// The error for a job whose answer was lost (its task panicked, or its lane stopped).
fn lost() -> StoreError {
    StoreError::Unavailable {
        message: "the batch this call was in failed".into(),
        source: None,
    }
}

/// The same error again, for each job of a batch (errors are not `Clone`: the source stays
/// with the first).
fn copy(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable { message, .. } => StoreError::Unavailable {
            message: message.clone(),
            source: None,
        },
        other => StoreError::Backend {
            message: other.to_string(),
            source: None,
        },
    }
}

#[cfg(test)]
mod tests;
