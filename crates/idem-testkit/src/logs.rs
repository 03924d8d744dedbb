//! What a test's `tracing` subscriber writes, kept for the test to read.
//!
//! A subscriber set with `tracing::subscriber::set_default` (or `with_default`) hears only its
//! own thread: run what logs on that thread (a current-thread runtime), or call it there.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The text a [`Log::subscriber`] wrote, shared by the clones.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    /// A subscriber that writes every event here as plain text (no colours), at every level
    /// the subscriber's default filter lets through (`INFO` and above).
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }

    /// Forgets what was written so far.
    pub fn clear(&self) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// The text once it holds `needle` `n` times: a line may be written by a task that runs
    /// after the answer the test waited for went out. Panics after [`crate::PATIENCE`].
    pub async fn text_with(&self, needle: &str, n: usize) -> String {
        crate::within(&format!("a log line with {needle:?}"), async {
            loop {
                let text = self.text();
                if text.matches(needle).count() >= n {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
    }
}

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
