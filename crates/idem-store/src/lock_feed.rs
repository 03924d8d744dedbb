//! Release notifications inside one process: a broadcast channel that a backend's releases
//! (its own, or those its server reports) are sent into, and the listener waiters read.

use std::sync::Arc;

use idem_core::{BoxFuture, ReleaseListener};
use tokio::sync::broadcast;

/// How many releases a slow listener may fall behind before it is told it missed some.
const CAPACITY: usize = 1024;

/// The sending side, shared by a backend's clones.
#[derive(Debug, Clone)]
pub(crate) struct ReleaseFeed(broadcast::Sender<Arc<str>>);

impl ReleaseFeed {
    pub(crate) fn new() -> Self {
        Self(broadcast::channel(CAPACITY).0)
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
