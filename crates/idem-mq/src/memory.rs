//! An in-process queue with a broker's delivery semantics, for tests of handlers and of the
//! consumer itself: competing consumers, redelivery of a delivery dropped unsettled (as a
//! broker redelivers when a consumer's channel closes), requeue with a delay, delivery counts,
//! and a dead letter that keeps the reason.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::MqError;
use crate::source::{DeadLetter, Delivery, Disposition, Horizon, Identity, Source};

/// A message as published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Its message id.
    pub id: Option<String>,
    /// Its headers.
    pub headers: Vec<(String, String)>,
    /// Its body.
    pub payload: Bytes,
}

#[derive(Debug, Clone)]
struct Held {
    message: Published,
    deliveries: u32,
}

#[derive(Debug, Default)]
struct State {
    ready: VecDeque<Held>,
    delayed: Vec<(Instant, Held)>,
    in_flight: usize,
    acked: usize,
    dead: Vec<(Published, DeadLetter)>,
    closed: bool,
}

impl State {
    fn is_empty(&self) -> bool {
        self.ready.is_empty() && self.delayed.is_empty() && self.in_flight == 0
    }

    /// Moves requeued messages whose delay is over to the ready list; answers when the next
    /// delayed one is due.
    fn promote(&mut self, now: Instant) -> Option<Instant> {
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                let (_, held) = self.delayed.swap_remove(i);
                self.ready.push_back(held);
            } else {
                i += 1;
            }
        }
        self.delayed.iter().map(|(at, _)| *at).min()
    }
}

#[derive(Debug)]
struct Inner {
    name: String,
    horizon: Horizon,
    state: Mutex<State>,
    changed: Notify,
}

/// An in-process queue. Clones share it.
#[derive(Debug, Clone)]
pub struct Queue {
    inner: Arc<Inner>,
}

impl Queue {
    /// An empty queue named `name` (the consumer's default namespace).
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_horizon(name, Horizon::Unknown)
    }

    /// A queue whose sources report `horizon` as their redelivery horizon.
    pub fn with_horizon(name: impl Into<String>, horizon: Horizon) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: name.into(),
                horizon,
                state: Mutex::default(),
                changed: Notify::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn change(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state());
        self.inner.changed.notify_waiters();
    }

    /// Publishes a message with message id `id`.
    pub fn publish(&self, id: Option<&str>, payload: impl Into<Bytes>) {
        self.publish_message(Published {
            id: id.map(str::to_owned),
            headers: Vec::new(),
            payload: payload.into(),
        });
    }

    /// Publishes a message with headers.
    pub fn publish_message(&self, message: Published) {
        self.change(|s| {
            s.ready.push_back(Held {
                message,
                deliveries: 0,
            });
        });
    }

    /// A consumer's handle on the queue; several compete for its messages.
    pub fn source(&self) -> MemorySource {
        MemorySource {
            queue: self.clone(),
            closed: false,
        }
    }

    /// How many messages were acked.
    pub fn acked(&self) -> usize {
        self.state().acked
    }

    /// The dead-lettered messages, with their reasons.
    pub fn dead_letters(&self) -> Vec<(Published, DeadLetter)> {
        self.state().dead.clone()
    }

    /// Messages not yet settled for good: ready, waiting out a requeue delay, or delivered
    /// and not settled.
    pub fn pending(&self) -> usize {
        let s = self.state();
        s.ready.len() + s.delayed.len() + s.in_flight
    }

    /// Closes the queue: sources answer `None` once nothing is ready.
    pub fn close(&self) {
        self.change(|s| s.closed = true);
    }

    /// Completes once every message published so far is settled for good (acked or
    /// dead-lettered): a shutdown signal for a test that consumes everything.
    pub async fn drained(self) {
        loop {
            let changed = self.inner.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if self.state().is_empty() {
                return;
            }
            changed.await;
        }
    }
}

/// A consumer's handle on a [`Queue`].
#[derive(Debug)]
pub struct MemorySource {
    queue: Queue,
    closed: bool,
}

impl Source for MemorySource {
    type Delivery = MemoryDelivery;

    fn name(&self) -> &str {
        &self.queue.inner.name
    }

    fn identity(&self) -> Identity<'_> {
        Identity::new("memory", [self.name()])
    }

    async fn next(&mut self) -> Option<Result<MemoryDelivery, MqError>> {
        loop {
            let changed = self.queue.inner.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let due = {
                let mut s = self.queue.state();
                let due = s.promote(Instant::now());
                if !self.closed
                    && let Some(mut held) = s.ready.pop_front()
                {
                    held.deliveries += 1;
                    s.in_flight += 1;
                    return Some(Ok(MemoryDelivery {
                        queue: self.queue.clone(),
                        held: Some(held),
                    }));
                }
                if self.closed || (s.closed && s.delayed.is_empty()) {
                    return None;
                }
                due
            };
            match due {
                Some(at) => {
                    tokio::select! {
                        () = changed => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    fn redelivery_horizon(&self) -> Horizon {
        self.queue.inner.horizon
    }

    async fn close(&mut self) {
        self.closed = true;
    }
}

/// A delivery from a [`Queue`]. Dropped unsettled, it goes back to the front of the queue,
/// as a broker redelivers the unacked messages of a consumer whose channel closed.
#[derive(Debug)]
pub struct MemoryDelivery {
    queue: Queue,
    held: Option<Held>,
}

impl MemoryDelivery {
    fn message(&self) -> Option<&Published> {
        self.held.as_ref().map(|h| &h.message)
    }
}

impl Delivery for MemoryDelivery {
    fn message_id(&self) -> Option<&str> {
        self.message()?.id.as_deref()
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.message()?
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| Cow::Borrowed(v.as_str()))
    }

    fn payload(&self) -> &[u8] {
        self.message().map_or(&[], |m| &m.payload)
    }

    fn delivery_count(&self) -> Option<u32> {
        self.held.as_ref().map(|h| h.deliveries)
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        Ok(())
    }

    async fn settle(mut self, how: Disposition) -> Result<(), MqError> {
        let Some(held) = self.held.take() else {
            return Ok(());
        };
        self.queue.change(|s| {
            s.in_flight -= 1;
            match how {
                Disposition::Ack => s.acked += 1,
                Disposition::Requeue { delay } => s.delayed.push((Instant::now() + delay, held)),
                Disposition::DeadLetter(why) => s.dead.push((held.message, why)),
            }
        });
        Ok(())
    }
}

impl Drop for MemoryDelivery {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.queue.change(|s| {
                s.in_flight -= 1;
                s.ready.push_front(held);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Reason;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn deliveries_count_requeue_after_their_delay_and_come_back_when_dropped() {
        let q = Queue::new("q");
        q.publish(Some("a"), b"1".as_slice());
        let mut src = q.source();
        let d = src.next().await.expect("open").expect("delivery");
        assert_eq!((d.message_id(), d.delivery_count()), (Some("a"), Some(1)));
        drop(d);
        let d = src.next().await.expect("open").expect("delivery");
        assert_eq!(
            d.delivery_count(),
            Some(2),
            "dropped unsettled: delivered again"
        );
        let start = Instant::now();
        d.settle(Disposition::Requeue {
            delay: Duration::from_secs(5),
        })
        .await
        .expect("settle");
        let d = src.next().await.expect("open").expect("delivery");
        assert!(start.elapsed() >= Duration::from_secs(5));
        assert_eq!(d.delivery_count(), Some(3));
        d.settle(Disposition::DeadLetter(DeadLetter {
            reason: Reason::Permanent,
            detail: "no".into(),
        }))
        .await
        .expect("settle");
        q.clone().drained().await;
        assert_eq!(q.dead_letters()[0].1.reason, Reason::Permanent);
        q.close();
        assert!(src.next().await.is_none());
    }
}
