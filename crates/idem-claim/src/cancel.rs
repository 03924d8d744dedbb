//! Store calls that run to their end even when their caller stops waiting.
//!
//! A future dropped at an `.await` stops there, but a store call it was waiting on may
//! already have reached the store: a `begin` that took a key, an acquire that took a lock.
//! Dropped unanswered, it would leave that key or lock held, until its lease ran out, for a
//! caller who is gone. [`finishing`] wraps such a call: polled to its end, it is the call
//! itself; dropped before, the call is carried on in a task of its own and its answer goes to
//! a clean-up that gives back whatever was taken.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use idem_core::BoxFuture;

/// A store call that is finished in the background if dropped unanswered; see [`finishing`].
struct Finishing<T: Send + 'static, F: Orphan<T>> {
    call: Option<BoxFuture<'static, T>>,
    orphan: Option<F>,
    /// Whether the call was ever polled: one never started has sent nothing.
    started: bool,
}

/// Wraps `call`, which owns everything it needs. If the wrapper is dropped after it was first
/// polled but before `call` has answered, `call` goes on in a task of its own (on the current
/// Tokio runtime; without one it is dropped too) and its answer is given to `orphan`.
pub fn finishing<T, F, Fut>(
    call: impl Future<Output = T> + Send + 'static,
    orphan: F,
) -> impl Future<Output = T> + Send + Unpin + 'static
where
    T: Send + 'static,
    F: FnOnce(T) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Finishing {
        call: Some(Box::pin(call)),
        orphan: Some(orphan),
        started: false,
    }
}

/// What to do with the answer of a call whose caller has gone.
trait Orphan<T>: Send + 'static {
    fn orphan(self, answer: T) -> BoxFuture<'static, ()>;
}

impl<T, F, Fut> Orphan<T> for F
where
    F: FnOnce(T) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    fn orphan(self, answer: T) -> BoxFuture<'static, ()> {
        Box::pin(self(answer))
    }
}

// The call is boxed and `orphan` is never pinned: moving a `Finishing` moves neither.
impl<T: Send + 'static, F: Orphan<T>> Unpin for Finishing<T, F> {}

impl<T: Send + 'static, F: Orphan<T>> Future for Finishing<T, F> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(call) = self.call.as_mut() else {
            // Polled again after answering: never, by `async` code.
            return Poll::Pending;
        };
        let polled = call.as_mut().poll(cx);
        self.started = true;
        let answer = std::task::ready!(polled);
        self.call = None;
        Poll::Ready(answer)
    }
}

impl<T: Send + 'static, F: Orphan<T>> Drop for Finishing<T, F> {
    fn drop(&mut self) {
        let (Some(call), Some(orphan), true) = (self.call.take(), self.orphan.take(), self.started)
        else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { orphan.orphan(call.await).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::sync::oneshot;

    use super::*;

    /// A call that answers what `answer` sends, marking `ran` once it started; and an orphan
    /// handler that passes the answer on to `orphaned`.
    fn call_and_orphan(
        answer: oneshot::Receiver<u32>,
        ran: &Arc<AtomicBool>,
        orphaned: oneshot::Sender<u32>,
    ) -> impl Future<Output = u32> + Send + 'static {
        let ran = Arc::clone(ran);
        finishing(
            async move {
                ran.store(true, Ordering::SeqCst);
                answer.await.unwrap_or(0)
            },
            move |n| async move {
                let _ = orphaned.send(n);
            },
        )
    }

    #[tokio::test]
    async fn an_answered_call_is_its_callers_alone() {
        let (tx, rx) = oneshot::channel();
        let (orphaned, heard) = oneshot::channel();
        tx.send(7).unwrap();
        assert_eq!(call_and_orphan(rx, &Arc::default(), orphaned).await, 7);
        // The orphan handler was dropped unused.
        assert!(heard.await.is_err());
    }

    #[tokio::test]
    async fn a_call_dropped_midway_is_finished_and_its_answer_handed_on() {
        let (tx, rx) = oneshot::channel();
        let (orphaned, heard) = oneshot::channel();
        let ran = Arc::default();
        let mut call = Box::pin(call_and_orphan(rx, &ran, orphaned));
        assert!(
            tokio::time::timeout(std::time::Duration::ZERO, call.as_mut())
                .await
                .is_err()
        );
        drop(call);
        tx.send(7).unwrap();
        assert_eq!(heard.await.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_call_dropped_before_it_started_is_not_made() {
        let (_tx, rx) = oneshot::channel();
        let (orphaned, heard) = oneshot::channel();
        let ran = Arc::default();
        drop(call_and_orphan(rx, &ran, orphaned));
        assert!(heard.await.is_err());
        assert!(!ran.load(Ordering::SeqCst));
    }
}
