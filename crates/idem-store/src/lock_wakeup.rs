//! Release notifications inside one process: a broadcast channel that a backend's releases
//! (its own, or those its server reports) are sent into, and the listener waiters read.

use std::sync::Arc;
#[cfg(any(feature = "postgres", feature = "redis"))]
use std::sync::atomic::Ordering;

use idem_core::{BoxFuture, ReleaseListener};
use tokio::sync::broadcast;

/// How many releases a slow listener may fall behind before it is told it missed some.
const CAPACITY: usize = 1024;

/// How long a feed task keeps its connection to the server open with nobody listening.
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) const FEED_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// The sending side, shared by a backend's clones, and whether a task feeds it from the
/// server.
#[derive(Debug, Clone)]
pub(crate) struct ReleaseFeed {
    tx: broadcast::Sender<Arc<str>>,
    /// Whether a task feeds this from the server (PostgreSQL, Redis).
    #[cfg(any(feature = "postgres", feature = "redis"))]
    feeding: Arc<std::sync::atomic::AtomicBool>,
}

impl ReleaseFeed {
    pub(crate) fn new() -> Self {
        Self {
            tx: broadcast::channel(CAPACITY).0,
            #[cfg(any(feature = "postgres", feature = "redis"))]
            feeding: Arc::default(),
        }
    }

    /// The right to run the task that feeds this from the server, if no task runs.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    pub(crate) fn claim(&self) -> Option<FeedTask> {
        (!self.feeding.swap(true, Ordering::AcqRel)).then(|| FeedTask {
            feed: self.clone(),
            stopped: false,
            idle_since: None,
        })
    }

    /// Tells every listener that releases may have been missed (a feed reconnected).
    #[cfg(any(feature = "postgres", feature = "redis"))]
    pub(crate) fn send_missed(&self) {
        let _ = self.tx.send(Arc::from(""));
    }

    /// Tells every listener that `name` was released (nobody listening is fine).
    pub(crate) fn send(&self, name: Arc<str>) {
        let _ = self.tx.send(name);
    }

    /// Whether anyone listens, so a backend may skip work nobody would read.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    pub(crate) fn has_listeners(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    pub(crate) fn listen(&self) -> Box<dyn ReleaseListener> {
        Box::new(Listener(self.tx.subscribe()))
    }
}

/// A running feed task's claim; given up when the task stops or is dropped (a runtime shut
/// down), so that a later listener starts a new one.
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) struct FeedTask {
    feed: ReleaseFeed,
    stopped: bool,
    /// Since when nobody has listened.
    idle_since: Option<tokio::time::Instant>,
}

#[cfg(any(feature = "postgres", feature = "redis"))]
impl FeedTask {
    /// Whether the task should stop because nobody has listened for [`FEED_IDLE`]; asked
    /// between the server's messages.
    pub(crate) fn idle_too_long(&mut self) -> bool {
        if self.feed.has_listeners() {
            self.idle_since = None;
            return false;
        }
        let since = *self
            .idle_since
            .get_or_insert_with(tokio::time::Instant::now);
        since.elapsed() >= FEED_IDLE && self.stop_if_idle()
    }

    /// Whether the task should stop because nobody listens. A listener that arrives while the
    /// claim is given up finds no task running and starts one; one that arrived just before
    /// keeps this one going.
    pub(crate) fn stop_if_idle(&mut self) -> bool {
        if self.feed.has_listeners() {
            return false;
        }
        self.feed.feeding.store(false, Ordering::Release);
        if self.feed.has_listeners() && !self.feed.feeding.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.stopped = true;
        true
    }
}

#[cfg(any(feature = "postgres", feature = "redis"))]
impl Drop for FeedTask {
    fn drop(&mut self) {
        if !self.stopped {
            self.feed.feeding.store(false, Ordering::Release);
        }
    }
}

struct Listener(broadcast::Receiver<Arc<str>>);

impl ReleaseListener for Listener {
    fn next(&mut self) -> BoxFuture<'_, Option<Arc<str>>> {
        Box::pin(async move {
            match self.0.recv().await {
                // An empty name (never a lock's) says releases may have been missed.
                Ok(name) if name.is_empty() => None,
                Ok(name) => Some(name),
                Err(broadcast::error::RecvError::Lagged(_)) => None,
                // Every sender is gone: nothing more will come.
                Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
            }
        })
    }
}

#[cfg(all(test, any(feature = "postgres", feature = "redis")))]
mod tests {
    use super::*;

    /// One feed task at a time; a task that stops for want of listeners gives its claim back
    /// (so the next listener starts one), but not while someone listens; a dropped task gives
    /// it back too.
    #[test]
    fn a_feed_task_claim_is_given_back_when_it_stops() {
        let feed = ReleaseFeed::new();
        let mut task = feed.claim().expect("nobody runs the feed yet");
        assert!(feed.claim().is_none(), "a second task while one runs");
        let listener = feed.listen();
        assert!(!task.stop_if_idle(), "someone listens");
        assert!(feed.claim().is_none());
        drop(listener);
        assert!(task.stop_if_idle());
        let again = feed.claim().expect("the stopped task gave its claim back");
        drop(again);
        assert!(
            feed.claim().is_some(),
            "a dropped task gives its claim back"
        );
    }
}
