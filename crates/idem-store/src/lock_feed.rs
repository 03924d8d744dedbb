//! Release notifications inside one process: a broadcast channel that a backend's releases
//! (its own, or those its server reports) are sent into, and the listener waiters read.

use std::sync::Arc;
#[cfg(any(feature = "postgres", feature = "redis"))]
use std::sync::atomic::Ordering;

use idem_core::{BoxFuture, ReleaseListener};
use tokio::sync::broadcast;

/// How many releases a slow listener may fall behind before it is told it missed some.
const CAPACITY: usize = 1024;

/// The sending side, shared by a backend's clones, and whether a task feeds it from the
/// server.
#[derive(Debug, Clone)]
pub(crate) struct ReleaseFeed(
    broadcast::Sender<Arc<str>>,
    Arc<std::sync::atomic::AtomicBool>,
);

impl ReleaseFeed {
    pub(crate) fn new() -> Self {
        Self(broadcast::channel(CAPACITY).0, Arc::default())
    }

    /// The right to run the task that feeds this from the server, if no task runs.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    pub(crate) fn claim(&self) -> Option<FeedTask> {
        (!self.1.swap(true, Ordering::AcqRel)).then(|| FeedTask {
            feed: self.clone(),
            stopped: false,
        })
    }

    /// Tells every listener that releases may have been missed (a feed reconnected).
    #[cfg(any(feature = "postgres", feature = "redis"))]
    pub(crate) fn send_missed(&self) {
        let _ = self.0.send(Arc::from(""));
    }

    /// Tells every listener that `name` was released (nobody listening is fine).
    pub(crate) fn send(&self, name: Arc<str>) {
        let _ = self.0.send(name);
    }

    /// Whether anyone listens, so a backend may skip work nobody would read.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    pub(crate) fn has_listeners(&self) -> bool {
        self.0.receiver_count() > 0
    }

    pub(crate) fn listen(&self) -> Box<dyn ReleaseListener> {
        Box::new(Listener(self.0.subscribe()))
    }
}

/// A running feed task's claim; given up when the task stops or is dropped (a runtime shut
/// down), so that a later listener starts a new one.
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) struct FeedTask {
    feed: ReleaseFeed,
    stopped: bool,
}

#[cfg(any(feature = "postgres", feature = "redis"))]
impl FeedTask {
    /// Whether the task should stop because nobody listens. A listener that arrives while the
    /// claim is given up finds no task running and starts one; one that arrived just before
    /// keeps this one going.
    pub(crate) fn stop_if_idle(&mut self) -> bool {
        if self.feed.has_listeners() {
            return false;
        }
        self.feed.1.store(false, Ordering::Release);
        if self.feed.has_listeners() && !self.feed.1.swap(true, Ordering::AcqRel) {
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
            self.feed.1.store(false, Ordering::Release);
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
