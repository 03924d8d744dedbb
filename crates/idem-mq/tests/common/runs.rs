//! What the broker suites share: a record of the handlers' runs, waiting for a condition,
//! a switch that stops a consumer, and a message whose store fails.

// Each suite uses a part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_mq::{Delivery, Failure, Message, Outcome, Source};
use idem_testkit::{Fault, FaultyStore, Op, within};

/// What a test handler's run returns.
pub(crate) type Run = std::pin::Pin<Box<dyn Future<Output = Result<(), Failure<String>>> + Send>>;

/// A handler that records each run in `runs` and takes `takes` to finish.
pub(crate) fn timed_handler(runs: &Arc<Runs>, takes: Duration) -> impl Fn(Message) -> Run + use<> {
    let runs = Arc::clone(runs);
    move |msg: Message| {
        let runs = Arc::clone(&runs);
        Box::pin(async move {
            let _run = runs.start(msg.message_id.as_deref().unwrap_or(""));
            tokio::time::sleep(takes).await;
            Ok::<_, Failure<String>>(())
        })
    }
}

/// A handler that records each run in `runs` and fails by payload: `poison` for good
/// ("malformed order"), `flaky` every time (retryable), `once` on its first run only;
/// anything else succeeds.
pub(crate) fn failing_handler(runs: &Arc<Runs>) -> impl Fn(Message) -> Run + use<> {
    let runs = Arc::clone(runs);
    move |msg: Message| {
        let runs = Arc::clone(&runs);
        Box::pin(async move {
            let _run = runs.start(msg.message_id.as_deref().unwrap_or(""));
            match &msg.payload[..] {
                b"poison" => Err(Failure::Permanent("malformed order".to_owned())),
                b"flaky" => Err(Failure::Retry("database down".to_owned())),
                b"once" if msg.attempt == 1 => Err(Failure::Retry("blip".to_owned())),
                _ => Ok(()),
            }
        })
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the handlers did: runs per id, and how many ran one id at once at most.
#[derive(Default)]
pub(crate) struct Runs {
    pub(crate) runs: Mutex<HashMap<String, u32>>,
    pub(crate) running: Mutex<HashMap<String, u32>>,
    pub(crate) most_at_once: Mutex<u32>,
}

impl Runs {
    /// Marks a run of `id` as started; the guard marks it ended, also when the run is dropped.
    pub(crate) fn start(self: &Arc<Self>, id: &str) -> RunGuard {
        *lock(&self.runs).entry(id.to_owned()).or_default() += 1;
        let now = {
            let mut running = lock(&self.running);
            let n = running.entry(id.to_owned()).or_default();
            *n += 1;
            *n
        };
        let mut most = lock(&self.most_at_once);
        *most = (*most).max(now);
        RunGuard {
            runs: Arc::clone(self),
            id: id.to_owned(),
        }
    }

    pub(crate) fn of(&self, id: &str) -> u32 {
        lock(&self.runs).get(id).copied().unwrap_or(0)
    }

    pub(crate) fn ids(&self) -> usize {
        lock(&self.runs).len()
    }
}

pub(crate) struct RunGuard {
    runs: Arc<Runs>,
    id: String,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.runs.running).get_mut(&self.id) {
            *n -= 1;
        }
    }
}

/// Waits (bounded by `bound`) until `done` holds, checking every 50 ms.
pub(crate) async fn until(bound: Duration, what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(bound, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within {bound:?}: {what}"));
}

/// Runs `consumer` on `source` with a [`timed_handler`] that takes no time, until `n`
/// deliveries are settled (handled or replayed); the runs it recorded.
pub(crate) async fn run_until_settled<S, C, Src>(
    consumer: &idem_mq::Consumer<S, C>,
    source: Src,
    n: usize,
) -> Arc<Runs>
where
    S: idem::Store + Clone + 'static,
    C: idem::Clock + Clone + 'static,
    Src: Source,
{
    let runs = Arc::new(Runs::default());
    let handler = timed_handler(&runs, Duration::ZERO);
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(idem_testkit::PATIENCE, "every delivery settled", || {
        let c = consumer.counts();
        c.handled + c.replayed >= n as u64
    })
    .await;
    stop.notify_one();
    run.await.expect("task").expect("run");
    runs
}

/// A shutdown switch for [`Consumer::run`].
pub(crate) fn shutdown_switch() -> (Arc<tokio::sync::Notify>, impl Future<Output = ()> + Send) {
    let notify = Arc::new(tokio::sync::Notify::new());
    let waiter = Arc::clone(&notify);
    (notify, async move { waiter.notified().await })
}

/// The next delivery of `source` (an error is printed and the source asked again).
pub(crate) async fn next<S: Source>(source: &mut S) -> S::Delivery {
    within("a delivery", async {
        loop {
            match source.next().await {
                Some(Ok(d)) => return d,
                Some(Err(e)) => eprintln!("next: {e}"),
                None => panic!("the source closed"),
            }
        }
    })
    .await
}

/// A message `id` waiting in `source` whose store fails `op` `times` in a row (a
/// [`FaultyStore`] over a memory store; the engine tries a `complete` three times before it
/// gives up): its first delivery is requeued, never acked, once the handler ran `ran_first`
/// times, and `held` checks the broker still holds it; the broker delivers it again, and that
/// delivery runs the handler once more and is acked. The suite checks then that nothing is
/// left.
pub(crate) async fn store_failure_requeues<S: Source>(
    source: &mut S,
    id: &str,
    (op, times): (Op, usize),
    ran_first: u32,
    held: impl AsyncFnOnce(),
) {
    let store = FaultyStore::new(idem::MemoryStore::new());
    for _ in 0..times {
        store.fail_next(op, Fault::Unavailable);
    }
    let consumer = idem_mq::Consumer::new(store)
        .lease(Duration::from_millis(300))
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let runs = Arc::new(Runs::default());
    let handler = timed_handler(&runs, Duration::ZERO);

    let d = next(source).await;
    let outcome = consumer
        .process(source, d, &handler)
        .await
        .expect("process");
    assert_eq!(outcome, Outcome::Requeued, "not acked");
    assert_eq!(runs.of(id), ran_first);
    held().await;

    let d = next(source).await;
    assert_eq!(d.message_id(), Some(id), "the broker kept it");
    assert_eq!(d.delivery_count(), Some(2));
    let outcome = consumer
        .process(source, d, &handler)
        .await
        .expect("process");
    assert_eq!(outcome, Outcome::Handled);
    assert_eq!(runs.of(id), ran_first + 1);
}
