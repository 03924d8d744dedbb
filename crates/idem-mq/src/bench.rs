//! What the message benches share (feature `bench`): a source wrapper that notes the first
//! delivery and the last settle of a timed consume, the bare consume loop the idempotent
//! consumer is compared with, and filling a RabbitMQ queue. The consumer bench of `idem-mq`
//! and the relay bench of `idem-server` both use it, so both time and fill the same way.

// Bench support: a broker that does not answer as expected is meant to panic.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    clippy::cast_precision_loss
)]

use std::borrow::Cow;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::amqp::lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use crate::amqp::lapin::types::ShortString;
use crate::amqp::lapin::{Connection, ConnectionProperties};
use crate::amqp::{AmqpSource, BasicProperties};
use crate::{Delivery, Disposition, Horizon, MqError, Source};
use tokio::sync::{Notify, Semaphore};

/// How long [`get_one`] waits for a message that should arrive.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The body of every message: a small order, as a JSON API would carry it.
pub const BODY: &[u8] =
    br#"{"order":"ord_000000","sku":"A1","qty":2,"amount":1999,"currency":"eur"}"#;

/// The longest a timed consume may take.
pub const WAIT: Duration = Duration::from_secs(300);

/// Sixteen random hex digits, for fresh queue, stream, table and prefix names.
pub fn hex() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// When a timed consume started and ended, and how many deliveries were settled.
#[derive(Debug)]
pub struct Meter {
    /// How many settles end the consume.
    pub want: usize,
    /// When the first delivery arrived.
    pub first: OnceLock<Instant>,
    /// When the `want`-th delivery was settled.
    pub last: OnceLock<Instant>,
    /// Deliveries settled.
    pub settled: AtomicUsize,
    /// Settles the broker refused.
    pub failed: AtomicUsize,
    /// Summed over the deliveries settled, in microseconds: from a delivery's arrival to the
    /// start of its settle (the consumer's claim, handler and record), and the settle itself.
    pub before_settle_us: AtomicU64,
    /// See `before_settle_us`.
    pub settling_us: AtomicU64,
    /// Notified when the `want`-th delivery is settled.
    pub done: Notify,
}

impl Meter {
    /// A meter that is done after `want` settles.
    pub fn new(want: usize) -> Arc<Self> {
        Arc::new(Self {
            want,
            first: OnceLock::new(),
            last: OnceLock::new(),
            settled: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            before_settle_us: AtomicU64::new(0),
            settling_us: AtomicU64::new(0),
            done: Notify::new(),
        })
    }

    /// From the first delivery to the last settle; panics before both happened.
    pub fn elapsed(&self) -> Duration {
        let (first, last) = (self.first.get().unwrap(), self.last.get().unwrap());
        last.duration_since(*first)
    }
}

/// A source whose deliveries report to a [`Meter`].
#[derive(Debug)]
pub struct Timed<S> {
    /// The source timed.
    pub inner: S,
    /// Where its deliveries report.
    pub meter: Arc<Meter>,
}

/// A delivery of a [`Timed`] source.
#[derive(Debug)]
pub struct TimedDelivery<D> {
    inner: D,
    meter: Arc<Meter>,
    arrived: Instant,
}

impl<S: Source> Source for Timed<S> {
    type Delivery = TimedDelivery<S::Delivery>;

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn identity(&self) -> crate::Identity<'_> {
        self.inner.identity()
    }

    async fn next(&mut self) -> Option<Result<Self::Delivery, MqError>> {
        let next = self.inner.next().await?;
        Some(next.map(|inner| {
            let arrived = Instant::now();
            let _ = self.meter.first.set(arrived);
            TimedDelivery {
                inner,
                meter: Arc::clone(&self.meter),
                arrived,
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
        let settling = Instant::now();
        let settled = self.inner.settle(how).await;
        if settled.is_ok() {
            let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            let before = micros(settling.duration_since(self.arrived));
            meter.before_settle_us.fetch_add(before, Ordering::Relaxed);
            meter
                .settling_us
                .fetch_add(micros(settling.elapsed()), Ordering::Relaxed);
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
pub async fn all_settled(meter: Arc<Meter>) {
    tokio::time::timeout(WAIT, meter.done.notified())
        .await
        .expect("every message settled within the bench's bound");
}

/// What one timed consume measured.
#[derive(Debug)]
pub struct Row {
    /// From the first delivery to the last settle.
    pub seconds: f64,
    /// Messages per second.
    pub rate: f64,
    /// Empty when all went as it should; else what did not.
    pub note: String,
    /// The mean time, in milliseconds, a delivery settled took from its arrival to the start
    /// of its settle (claim, handler, record), and to settle.
    pub before_settle_ms: f64,
    /// See `before_settle_ms`.
    pub settle_ms: f64,
}

impl Row {
    /// The row of the consume `meter` timed, with `note` and the settles that failed.
    pub fn of(meter: &Meter, note: String) -> Self {
        let failed = meter.failed.load(Ordering::Relaxed);
        let note = if failed > 0 {
            format!("{note} {failed} settles failed").trim().to_owned()
        } else {
            note
        };
        let seconds = meter.elapsed().as_secs_f64();
        let settled = meter.settled.load(Ordering::Relaxed).max(1) as f64;
        let mean_ms = |sum: &AtomicU64| sum.load(Ordering::Relaxed) as f64 / settled / 1000.0;
        Row {
            seconds,
            rate: meter.want as f64 / seconds,
            note,
            before_settle_ms: mean_ms(&meter.before_settle_us),
            settle_ms: mean_ms(&meter.settling_us),
        }
    }
}

/// The bare consumer `who` (`bare consumer`, `bare relay`): `concurrency` deliveries at once,
/// each given to `work` in a task of its own, nothing recorded; the shape of `Consumer::run`
/// (a slot, the next delivery, a task that settles it), until `shutdown` completes.
pub async fn bare<S, F, Fut>(
    mut source: S,
    who: &str,
    concurrency: usize,
    shutdown: impl Future<Output = ()>,
    work: F,
) where
    S: Source,
    F: Fn(S::Delivery) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(concurrency));
    let mut running = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            biased;
            () = &mut shutdown => break,
            slot = slots.clone().acquire_owned() => slot.unwrap(),
        };
        let next = tokio::select! {
            biased;
            () = &mut shutdown => break,
            next = source.next() => next,
        };
        match next {
            None => break,
            Some(Err(e)) => {
                eprintln!("{who}: cannot receive: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(Ok(delivery)) => {
                let work = work(delivery);
                running.spawn(async move {
                    let _slot = slot;
                    work.await;
                });
            }
        }
        while running.try_join_next().is_some() {}
    }
    source.close().await;
    while running.join_next().await.is_some() {}
}

/// Declares `queue` as the source declares it (a quorum queue) with `prefetch`, then publishes
/// `n` messages of [`BODY`] to it (message ids `m-0`, `m-1`, …, persistent), with publisher
/// confirms, a thousand at a time.
pub async fn fill_amqp(url: &str, queue: &str, prefetch: u16, n: usize) {
    // The topology as the source declares it; closed before anything is published.
    AmqpSource::builder(url, queue)
        .prefetch(prefetch)
        .connect()
        .await
        .unwrap()
        .shutdown()
        .await;
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let routing_key = ShortString::try_new(queue).unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for i in chunk {
            let props = BasicProperties::default()
                .with_message_id(ShortString::try_new(format!("m-{i}")).unwrap())
                .with_delivery_mode(2);
            let confirm = channel
                .basic_publish(
                    ShortString::try_new("").unwrap(),
                    routing_key.clone(),
                    BasicPublishOptions::default(),
                    BODY,
                    props,
                )
                .await
                .unwrap();
            confirms.push(confirm);
        }
        for confirm in confirms {
            assert!(confirm.await.unwrap().is_ack(), "publish confirmed");
        }
    }
    let _ = connection.close(200, "OK".into()).await;
}

/// Takes one message off `queue` (waiting up to [`PATIENCE`] for one) and
/// acks it: how a test reads a dead letter.
pub async fn get_one(url: &str, queue: &str) -> crate::amqp::lapin::message::BasicGetMessage {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .expect("basic.get")
        {
            m.delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .expect("ack");
            let _ = conn.close(200, "OK".into()).await;
            return m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no message on {queue} within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A header of a message, as text (a long string's bytes; anything else in its debug form).
pub fn header_text(props: &BasicProperties, name: &str) -> Option<String> {
    use crate::amqp::lapin::types::AMQPValue;
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}
