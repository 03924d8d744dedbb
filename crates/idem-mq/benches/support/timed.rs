//! What the consumer and relay benches share: a source wrapper that notes the first delivery
//! and the last settle of a timed consume. Included by `crates/idem-mq/benches/consumer.rs` and
//! `crates/idem-server/benches/relay.rs` (`#[path]`), so both time the same way.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use idem_mq::{Delivery, Disposition, Horizon, MqError, Source};
use tokio::sync::Notify;

/// The longest a timed consume may take.
pub(crate) const WAIT: Duration = Duration::from_secs(300);

pub(crate) fn hex() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// When a timed consume started and ended, and how many deliveries were settled.
pub(crate) struct Meter {
    pub(crate) want: usize,
    pub(crate) first: OnceLock<Instant>,
    pub(crate) last: OnceLock<Instant>,
    pub(crate) settled: AtomicUsize,
    pub(crate) failed: AtomicUsize,
    pub(crate) done: Notify,
}

impl Meter {
    pub(crate) fn new(want: usize) -> Arc<Self> {
        Arc::new(Self {
            want,
            first: OnceLock::new(),
            last: OnceLock::new(),
            settled: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            done: Notify::new(),
        })
    }

    pub(crate) fn elapsed(&self) -> Duration {
        let (first, last) = (self.first.get().unwrap(), self.last.get().unwrap());
        last.duration_since(*first)
    }
}

pub(crate) struct Timed<S> {
    pub(crate) inner: S,
    pub(crate) meter: Arc<Meter>,
}

pub(crate) struct TimedDelivery<D> {
    inner: D,
    meter: Arc<Meter>,
}

impl<S: Source> Source for Timed<S> {
    type Delivery = TimedDelivery<S::Delivery>;

    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn next(&mut self) -> Option<Result<Self::Delivery, MqError>> {
        let next = self.inner.next().await?;
        Some(next.map(|inner| {
            let _ = self.meter.first.set(Instant::now());
            TimedDelivery {
                inner,
                meter: Arc::clone(&self.meter),
            }
        }))
    }

    fn ack_wait(&self) -> Option<Duration> {
        self.inner.ack_wait()
    }

    fn redelivery_horizon(&self) -> Horizon {
        self.inner.redelivery_horizon()
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

impl<D: Delivery> Delivery for TimedDelivery<D> {
    fn message_id(&self) -> Option<&str> {
        self.inner.message_id()
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.inner.header(name)
    }

    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }

    fn delivery_count(&self) -> Option<u32> {
        self.inner.delivery_count()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        self.inner.in_progress().await
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        let meter = self.meter;
        let settled = self.inner.settle(how).await;
        if settled.is_ok() {
            if meter.settled.fetch_add(1, Ordering::AcqRel) + 1 == meter.want {
                let _ = meter.last.set(Instant::now());
                meter.done.notify_one();
            }
        } else {
            meter.failed.fetch_add(1, Ordering::Relaxed);
        }
        settled
    }
}

/// Completes when every message is settled; panics after [`WAIT`].
pub(crate) async fn all_settled(meter: Arc<Meter>) {
    tokio::time::timeout(WAIT, meter.done.notified())
        .await
        .expect("every message settled within the bench's bound");
}
