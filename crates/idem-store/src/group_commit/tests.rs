//! The batcher's queueing, lanes and fallbacks, against runners that record the batches they
//! are given and stores whose batched calls fail.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::*;

struct Numbered(Key, usize);

impl Job for Numbered {
    fn key(&self) -> &Key {
        &self.0
    }

    fn bytes(&self) -> usize {
        0
    }
}

/// A runner that records each batch's job numbers, adds a permit to `started`, waits for
/// a permit of `gate` per batch, and answers each job with its number times ten.
#[derive(Clone)]
struct Recorder {
    batches: Arc<Mutex<Vec<Vec<usize>>>>,
    gate: Arc<Semaphore>,
    started: Arc<Semaphore>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            batches: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            started: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Recorder {
    fn runner(
        &self,
    ) -> impl Fn(Vec<Numbered>) -> std::pin::Pin<Box<dyn Future<Output = Vec<usize>> + Send>>
    + Send
    + 'static {
        let this = self.clone();
        move |jobs| {
            let this = this.clone();
            Box::pin(async move {
                let numbers: Vec<usize> = jobs.iter().map(|j| j.1).collect();
                this.batches.lock().unwrap().push(numbers.clone());
                this.started.add_permits(1);
                this.gate.acquire().await.unwrap().forget();
                numbers.iter().map(|n| n * 10).collect()
            })
        }
    }

    fn batches(&self) -> Vec<Vec<usize>> {
        self.batches.lock().unwrap().clone()
    }

    /// As [`Recorder::runner`], but a batch holding job `n` panics.
    fn runner_failing_on(
        &self,
        n: usize,
    ) -> impl Fn(Vec<Numbered>) -> std::pin::Pin<Box<dyn Future<Output = Vec<usize>> + Send>>
    + Send
    + 'static {
        let record = self.runner();
        move |jobs| {
            assert!(jobs.iter().all(|j| j.1 != n), "the runner failed");
            record(jobs)
        }
    }

    /// Waits until `n` batches have started in all.
    async fn until_started(&self, n: u32) {
        let started = self.started.acquire_many(n);
        let permits = tokio::time::timeout(std::time::Duration::from_secs(30), started);
        permits
            .await
            .expect("the batches started")
            .unwrap()
            .forget();
        self.started.add_permits(n as usize);
    }
}

fn key(k: &str) -> Key {
    Key::parse("s", "n", k).unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Spawns a submit of job `n` on key `k`.
fn submit(
    batcher: &Batcher<Numbered, usize>,
    recorder: &Recorder,
    k: &str,
    n: usize,
) -> tokio::task::JoinHandle<Result<usize, StoreError>> {
    let (batcher, recorder, key) = (batcher.clone(), recorder.clone(), key(k));
    tokio::spawn(async move { batcher.submit(Numbered(key, n), || recorder.runner()).await })
}

#[test]
fn calls_queued_behind_a_busy_lane_go_together_and_each_gets_its_own_answer() {
    runtime().block_on(async {
        let batcher = Batcher::new(1, 3);
        let recorder = Recorder::default();
        // Job 0 finds the batcher idle and runs inline; 1 starts the one lane; the rest
        // queue while both wait at the gate.
        let mut calls = Vec::new();
        for (n, k) in ["a", "b", "c", "c", "d", "e", "f"].into_iter().enumerate() {
            calls.push(submit(&batcher, &recorder, k, n));
            tokio::task::yield_now().await;
        }
        recorder.gate.add_permits(100);
        for (n, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.unwrap().unwrap(), n * 10, "job {n}");
        }
        let batches = recorder.batches();
        assert_eq!(batches[0], [0], "the idle caller ran alone");
        let mut ran: Vec<usize> = batches.concat();
        ran.sort_unstable();
        assert_eq!(ran, [0, 1, 2, 3, 4, 5, 6], "each job ran once: {batches:?}");
        assert!(batches.iter().all(|b| b.len() <= 3), "{batches:?}");
        assert!(
            batches.iter().any(|b| b.len() > 1),
            "nothing went together: {batches:?}"
        );
        assert!(
            !batches.iter().any(|b| b.contains(&2) && b.contains(&3)),
            "one record twice in a batch: {batches:?}"
        );
    });
}

#[test]
fn a_queued_caller_that_went_away_never_runs() {
    runtime().block_on(async {
        let batcher = Batcher::new(1, 8);
        let recorder = Recorder::default();
        let inline = submit(&batcher, &recorder, "a", 0);
        tokio::task::yield_now().await;
        let first = submit(&batcher, &recorder, "b", 1);
        tokio::task::yield_now().await;
        let gone = submit(&batcher, &recorder, "c", 2);
        let kept = submit(&batcher, &recorder, "d", 3);
        tokio::task::yield_now().await;
        gone.abort();
        let _ = gone.await;
        recorder.gate.add_permits(100);
        for (call, n) in [(inline, 0), (first, 1), (kept, 3)] {
            assert_eq!(call.await.unwrap().unwrap(), n * 10);
        }
        let batches = recorder.batches();
        assert!(!batches.concat().contains(&2), "{batches:?}");
    });
}

#[test]
fn a_lone_caller_runs_inline_every_time() {
    runtime().block_on(async {
        let batcher = Batcher::new(2, 8);
        let recorder = Recorder::default();
        recorder.gate.add_permits(100);
        for n in 0..5 {
            let r = batcher
                .submit(Numbered(key("k"), n), || recorder.runner())
                .await
                .unwrap();
            assert_eq!(r, n * 10);
            let state = batcher.shared.lock();
            assert_eq!((state.running, state.inline), (0, false));
        }
        assert_eq!(recorder.batches(), [[0], [1], [2], [3], [4]]);
    });
}

#[test]
fn a_batch_stops_at_its_byte_budget_but_takes_one_job_whatever_its_size() {
    struct Big(Key);
    impl Job for Big {
        fn key(&self) -> &Key {
            &self.0
        }
        fn bytes(&self) -> usize {
            MAX_BATCH_BYTES / 2 + 1
        }
    }
    let batcher: Batcher<Big, ()> = Batcher::new(1, 64);
    let mut receivers = Vec::new();
    {
        let mut state = batcher.shared.lock();
        for k in ["a", "b", "c"] {
            let (reply, receiver) = oneshot::channel();
            state.queue.push_back((Big(key(k)), reply));
            receivers.push(receiver);
        }
        state.running = 1;
    }
    let (jobs, _) = batcher.shared.next_batch().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(batcher.shared.lock().queue.len(), 2);
}

/// A store whose batched statements fail (or find no connection), and whose one-record
/// calls wait at a barrier for `parties` of them to be in flight together.
#[derive(Clone)]
struct Failing {
    no_connection: bool,
    alone: Arc<std::sync::atomic::AtomicUsize>,
    barrier: Arc<tokio::sync::Barrier>,
    /// The task each one-record call ran in.
    tasks: Arc<Mutex<Vec<Option<tokio::task::Id>>>>,
    /// The queues `begin` and `complete` go through, if any.
    batches: Option<GroupCommit>,
}

impl Failing {
    fn new(no_connection: bool, parties: usize) -> Self {
        Self {
            no_connection,
            alone: Arc::default(),
            barrier: Arc::new(tokio::sync::Barrier::new(parties)),
            tasks: Arc::default(),
            batches: None,
        }
    }

    fn failed(&self) -> Result<(), StoreError> {
        if self.no_connection {
            Err(StoreError::unavailable(
                "no connection",
                std::io::Error::other("refused"),
            ))
        } else {
            Ok(())
        }
    }

    async fn one(&self) {
        self.alone.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.tasks.lock().unwrap().push(tokio::task::try_id());
        self.barrier.wait().await;
    }
}

impl ManyAtOnce for Failing {
    fn group_commit(&self) -> Option<&GroupCommit> {
        self.batches.as_ref()
    }

    async fn begin_alone(
        &self,
        _: &BeginRequest,
        _: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        self.one().await;
        Ok(BeginOutcome::Mismatch)
    }

    async fn complete_alone(&self, _: CompleteJob) -> Result<(), LeaseError> {
        self.one().await;
        Ok(())
    }

    async fn begin_many(&self, _: &[BeginJob], _: &[Fresh]) -> Many<Acquired> {
        self.failed().map(|()| None)
    }

    async fn complete_many(&self, _: &[CompleteJob]) -> Many<bool> {
        self.failed().map(|()| None)
    }
}

fn begins(n: usize) -> Vec<BeginJob> {
    (0..n)
        .map(|i| BeginJob {
            req: BeginRequest::new(
                key(&format!("k{i}")),
                idem_core::Fingerprint::of_bytes(b"r"),
            ),
            now: Timestamp::now(),
        })
        .collect()
}

fn completes(n: usize) -> Vec<CompleteJob> {
    begins(n)
        .into_iter()
        .map(|j| {
            let (lease, _) = Record::acquired(&j.req, j.now, 1, idem_core::LeaseId::generate());
            CompleteJob {
                key: j.req.key,
                lease,
                response: Bytes::new(),
                now: j.now,
            }
        })
        .collect()
}

/// A failed batch statement leaves every job to the one-record path, all at once: the
/// barrier lets none through until all 16 are waiting at it, so calls made one after
/// another would never finish (the timeout only turns that hang into a failure).
#[test]
fn a_failed_batch_tries_its_jobs_on_their_own_all_at_once() {
    runtime().block_on(async {
        let store = Failing::new(false, 16);
        let done = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            begin_batch(&store, begins(16)),
        )
        .await
        .expect("the jobs ran one after another");
        assert!(done.iter().all(|r| matches!(r, Ok(BeginOutcome::Mismatch))));
        let store = Failing::new(false, 16);
        let done = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            complete_batch(&store, completes(16)),
        )
        .await
        .expect("the jobs ran one after another");
        assert!(done.iter().all(Result::is_ok));
    });
}

/// A lone caller's `begin` and `complete` run in the caller's own task, as they would
/// unbatched: no task is spawned for a batch of one.
#[test]
fn a_lone_call_runs_in_the_callers_task() {
    runtime().block_on(async {
        let store = Failing {
            batches: GroupCommit::with_lanes(2, 64),
            ..Failing::new(false, 1)
        };
        let (caller, job, key) = {
            let store = store.clone();
            tokio::spawn(async move {
                let [job] = <[BeginJob; 1]>::try_from(begins(1)).ok().unwrap();
                let [done] = <[CompleteJob; 1]>::try_from(completes(1)).ok().unwrap();
                super::begin(&store, &job.req, job.now).await.unwrap();
                let CompleteJob {
                    key,
                    lease,
                    response,
                    now,
                } = done;
                super::complete(&store, &key, &lease, response, now)
                    .await
                    .unwrap();
                (tokio::task::id(), job, key)
            })
            .await
            .unwrap()
        };
        drop((job, key));
        assert_eq!(*store.tasks.lock().unwrap(), vec![Some(caller); 2]);
    });
}

/// Without a connection every job gets that error at once, none tried again on its own.
#[test]
fn a_batch_without_a_connection_fails_every_job_with_its_error() {
    runtime().block_on(async {
        let store = Failing::new(true, 1);
        let done = begin_batch(&store, begins(5)).await;
        assert_eq!(done.len(), 5);
        assert!(done.iter().all(|r| matches!(r, Err(e) if e.is_transient())));
        let done = complete_batch(&store, completes(5)).await;
        assert_eq!(done.len(), 5);
        assert!(done.iter().all(Result::is_err));
        assert_eq!(store.alone.load(std::sync::atomic::Ordering::SeqCst), 0);
    });
}

/// Drops the call `task` makes, as a caller that goes away does.
async fn leave<T>(task: tokio::task::JoinHandle<T>) {
    task.abort();
    assert!(task.await.is_err_and(|e| e.is_cancelled()));
}

/// Whether the batcher is idle: no lane running, nobody inline, nothing queued.
fn idle<T: Job, R>(batcher: &Batcher<T, R>) -> bool {
    let state = batcher.shared.lock();
    state.running == 0 && !state.inline && state.queue.is_empty()
}

/// A caller that goes away while its batch is in flight leaves the batch to finish and the
/// lane to serve the next callers; the batcher ends idle.
#[test]
fn a_caller_that_leaves_while_its_batch_is_in_flight_leaves_the_lane_serving() {
    runtime().block_on(async {
        let batcher = Batcher::new(1, 8);
        let recorder = Recorder::default();
        let inline = submit(&batcher, &recorder, "a", 0);
        recorder.until_started(1).await;
        let gone = submit(&batcher, &recorder, "b", 1);
        recorder.until_started(2).await;
        leave(gone).await;
        let next = submit(&batcher, &recorder, "c", 2);
        recorder.gate.add_permits(100);
        assert_eq!(inline.await.unwrap().unwrap(), 0);
        assert_eq!(next.await.unwrap().unwrap(), 20);
        assert_eq!(recorder.batches(), [[0], [1], [2]]);
        assert!(idle(&batcher));
    });
}

/// A caller running its job inline that goes away leaves the batcher free for the next
/// one to run inline too.
#[test]
fn an_inline_caller_that_leaves_lets_the_next_run_inline() {
    runtime().block_on(async {
        let batcher = Batcher::new(2, 8);
        let recorder = Recorder::default();
        let gone = submit(&batcher, &recorder, "a", 0);
        recorder.until_started(1).await;
        leave(gone).await;
        assert!(idle(&batcher));
        recorder.gate.add_permits(100);
        let next = batcher
            .submit(Numbered(key("a"), 1), || recorder.runner())
            .await
            .unwrap();
        assert_eq!(next, 10);
        assert!(idle(&batcher));
    });
}

/// A lane whose runner panics fails the calls it held and gives its place back: the next
/// caller is served, and the batcher ends idle.
#[test]
fn a_lane_that_panics_fails_its_calls_and_the_next_is_served() {
    runtime().block_on(async {
        let batcher: Batcher<Numbered, usize> = Batcher::new(1, 8);
        let recorder = Recorder::default();
        let call = |k: &str, n| {
            let (batcher, recorder, key) = (batcher.clone(), recorder.clone(), key(k));
            tokio::spawn(async move {
                batcher
                    .submit(Numbered(key, n), || recorder.runner_failing_on(1))
                    .await
            })
        };
        let inline = call("a", 0);
        recorder.until_started(1).await;
        let failed = call("b", 1);
        assert!(
            failed.await.unwrap().is_err(),
            "the lane's call got an answer"
        );
        recorder.gate.add_permits(100);
        assert_eq!(inline.await.unwrap().unwrap(), 0);
        assert_eq!(call("c", 2).await.unwrap().unwrap(), 20);
        assert!(idle(&batcher));
    });
}
