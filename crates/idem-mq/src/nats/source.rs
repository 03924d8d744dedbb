//! The source: its builder, its durable consumer, and pulling.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{self, AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind};
use futures_util::{FutureExt, StreamExt};

use super::delivery::{NatsDelivery, Shared};
use super::{DeadLetterTarget, PULL_EXPIRES, PULL_HEARTBEAT};
use crate::{Horizon, Identity, MqError, Source};

/// How a [`NatsSource`] finds or makes its durable consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binding {
    /// Use the consumer if it exists, else create it from the builder's settings.
    CreateIfMissing,
    /// Use an existing consumer only; its own settings apply.
    Bind,
}

/// Builds a [`NatsSource`]: the stream, the durable consumer, and how to settle.
#[derive(Debug, Clone)]
pub struct NatsSourceBuilder {
    stream: String,
    consumer: String,
    binding: Binding,
    ack_wait: Duration,
    max_deliver: i64,
    filter_subject: Option<String>,
    batch: usize,
    max_ack_pending: Option<i64>,
    dead_letter: Option<DeadLetterTarget>,
    confirm_acks: bool,
    max_requeue_delay: Duration,
    retry_first: Duration,
    retry_max: Duration,
}

impl NatsSourceBuilder {
    /// How long the server waits for an ack before it redelivers, for a consumer this builder
    /// creates (default 30 s). The consumer reports progress (`+WPI`) while a handler runs.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// How many times the server delivers one message at most, for a consumer this builder
    /// creates; `-1` (the default, JetStream's own) for no limit. Set it well above the
    /// consumer's `max_attempts` (deliveries that only waited for a running attempt count here,
    /// not there), so that the consumer dead-letters a message with its reason before the
    /// server silently stops delivering it; a finite value bounds the
    /// [redelivery horizon](super#redelivery-horizon).
    pub fn max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = max_deliver;
        self
    }

    /// Only messages on subjects matching `filter` (wildcards allowed), for a consumer this
    /// builder creates.
    pub fn filter_subject(mut self, filter: impl Into<String>) -> Self {
        self.filter_subject = Some(filter.into());
        self
    }

    /// Use the durable consumer as it exists, with its own settings; never create it. The
    /// settings above are then ignored, and [`Source::ack_wait`] reports the consumer's own.
    pub fn bind(mut self) -> Self {
        self.binding = Binding::Bind;
        self
    }

    /// How many messages one pull request asks for (the prefetch; default 64, at least 1).
    /// A consumer this builder creates also gets `max_ack_pending` set to it, unless
    /// [`max_ack_pending`](Self::max_ack_pending) says otherwise.
    ///
    /// A prefetched message's ack timer runs from its delivery, while it waits in the buffer
    /// for a free handler: with slow handlers keep the batch near the consumer's concurrency,
    /// or a buffered message times out and is delivered again elsewhere (harmless with the
    /// records, but wasted). Likewise, when a process crashes, every message it held (running
    /// or buffered) comes back with its delivery count raised; the consumer counts runs by the
    /// record, not by this count, so a buffered bystander of a crash loop is not dead-lettered
    /// with the message that crashes its consumer.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How many delivered, unacked messages the server allows across every instance pulling
    /// from the consumer (default: the batch). Several instances sharing one durable consumer
    /// want about instances × batch.
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = Some(max_ack_pending);
        self
    }

    /// Dead-lettered copies go to this JetStream subject (default `<stream>.dead`); shorthand
    /// for [`dead_letter`](Self::dead_letter) with [`DeadLetterTarget::Stream`].
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter = Some(DeadLetterTarget::Stream(subject.into()));
        self
    }

    /// Where dead-lettered messages go (default: [`DeadLetterTarget::Stream`] on
    /// `<stream>.dead`).
    pub fn dead_letter(mut self, target: DeadLetterTarget) -> Self {
        self.dead_letter = Some(target);
        self
    }

    /// Whether acks, naks and terms wait for the server to confirm them (default on).
    ///
    /// A confirmed ack costs one round trip, paid concurrently with other messages. It buys
    /// two things: [`Delivery::settle`](crate::Delivery::settle) fails when the ack did not reach the server (so the
    /// consumer counts it, and knows the message will come back and be replayed from its
    /// record), and a graceful shutdown that has settled everything knows every ack arrived
    /// before it closes the connection. Without it an ack is fire-and-forget: a lost ack still
    /// does no harm (the redelivery is acked from the stored record without running), it is
    /// just not seen.
    pub fn confirm_acks(mut self, confirm: bool) -> Self {
        self.confirm_acks = confirm;
        self
    }

    /// The longest delay a requeue may ask for (default 5 minutes); longer delays are
    /// shortened to it. It enters the [redelivery horizon](super#redelivery-horizon).
    pub fn max_requeue_delay(mut self, max: Duration) -> Self {
        self.max_requeue_delay = max;
        self
    }

    /// Backoff between attempts to make the pull subscription again after it failed (the
    /// server restarted, the consumer was deleted): `first`, doubling up to `max` (defaults
    /// 100 ms and 5 s).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.retry_first = first;
        self.retry_max = max.max(first);
        self
    }

    /// Connects to `url` (`nats://127.0.0.1:4222`) and builds the source. The client
    /// reconnects by itself, without limit, after the server goes away.
    pub async fn connect(self, url: &str) -> Result<NatsSource, MqError> {
        let client = async_nats::ConnectOptions::new()
            .max_reconnects(None)
            .connect(url)
            .await
            .map_err(|e| MqError::broker("cannot connect to NATS", e))?;
        self.build(client).await
    }

    /// Builds the source on an existing client (for credentials, TLS or other options).
    pub async fn build(self, client: async_nats::Client) -> Result<NatsSource, MqError> {
        let js = jetstream::new(client);
        let dead_letter = self
            .dead_letter
            .clone()
            .unwrap_or_else(|| DeadLetterTarget::Stream(format!("{}.dead", self.stream)));
        let stream = js
            .get_stream(&self.stream)
            .await
            .map_err(|e| MqError::broker(format!("stream {} not found", self.stream), e))?;
        let wanted_filter = self.filter_subject.clone().unwrap_or_default();
        // A consumer made earlier is checked as it is, whatever filter this builder names.
        let exists =
            self.binding == Binding::Bind || stream.consumer_info(&self.consumer).await.is_ok();
        if !exists {
            // Before creating anything, with the filter the consumer would get.
            check_dead_letter(&js, stream.cached_info(), &wanted_filter, &dead_letter).await?;
        }
        let consumer = open_consumer(&stream, &self).await?;
        let info = consumer.cached_info().clone();
        if exists || info.config.filter_subject != wanted_filter {
            // The consumer as it is (bound, made earlier, or by another at the same time).
            check_dead_letter(
                &js,
                stream.cached_info(),
                &info.config.filter_subject,
                &dead_letter,
            )
            .await?;
        }

        let shared = Arc::new(Shared {
            stream: self.stream.clone(),
            dead_letter,
            confirm_acks: self.confirm_acks,
            max_requeue_delay: self.max_requeue_delay,
        });
        let mut source = NatsSource {
            name: format!("{}.{}", self.stream, self.consumer),
            js,
            settings: self,
            shared,
            consumer: Some(consumer),
            messages: None,
            ack_wait: Duration::ZERO,
            horizon: Horizon::Unknown,
            retry_wait: None,
            closed: false,
        };
        source.learn(&info.config);
        Ok(source)
    }
}

/// A durable JetStream pull consumer as a [`Source`].
///
/// It pulls in batches through the consumer's `messages()` stream, and makes that stream
/// again (with capped backoff) whenever it fails: after the server restarts, or after the
/// consumer was deleted (it is then created again, unless the source [binds](NatsSourceBuilder::bind)
/// to an existing one). The NATS client itself reconnects without limit.
///
/// # Example
///
/// ```no_run
/// # async fn example() -> Result<(), idem_mq::MqError> {
/// use std::time::Duration;
/// use idem_mq::nats::NatsSource;
/// use idem_mq::{Consumer, Failure, Message};
///
/// let source = NatsSource::builder("ORDERS", "inventory")
///     .ack_wait(Duration::from_secs(30))
///     // Above the consumer's max_attempts; bounds the redelivery horizon.
///     .max_deliver(20)
///     .batch(64)
///     .connect("nats://127.0.0.1:4222")
///     .await?;
/// let consumer = Consumer::new(idem::MemoryStore::new()).max_attempts(5);
/// let handler = |msg: Message| async move {
///     // Deduct stock for msg.payload; msg.fence() can guard writes elsewhere.
///     Ok::<_, Failure<String>>(())
/// };
/// // Until the shutdown future completes (a signal, say): then it drains and closes.
/// consumer.run(source, handler, std::future::pending()).await?;
/// # Ok(())
/// # }
/// ```
pub struct NatsSource {
    /// `<stream>.<consumer>`, for logs.
    name: String,
    js: jetstream::Context,
    settings: NatsSourceBuilder,
    shared: Arc<Shared>,
    consumer: Option<PullConsumer>,
    messages: Option<pull::Stream>,
    ack_wait: Duration,
    horizon: Horizon,
    retry_wait: Option<Duration>,
    closed: bool,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSource")
            .field("stream", &self.settings.stream)
            .field("consumer", &self.settings.consumer)
            .field("pulling", &self.messages.is_some())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl NatsSource {
    /// A builder for a source on `stream`, pulling from the durable consumer `consumer`.
    pub fn builder(stream: impl Into<String>, consumer: impl Into<String>) -> NatsSourceBuilder {
        NatsSourceBuilder {
            stream: stream.into(),
            consumer: consumer.into(),
            binding: Binding::CreateIfMissing,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            filter_subject: None,
            batch: 64,
            max_ack_pending: None,
            dead_letter: None,
            confirm_acks: true,
            max_requeue_delay: Duration::from_secs(300),
            retry_first: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
        }
    }

    /// The JetStream context the source uses (to publish with [`publish_once`](super::publish_once), or to manage
    /// streams).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The durable consumer's name.
    pub fn consumer_name(&self) -> &str {
        &self.settings.consumer
    }

    /// Where dead-lettered messages go.
    pub fn dead_letter_target(&self) -> &DeadLetterTarget {
        &self.shared.dead_letter
    }

    /// Takes the consumer's timing settings: its ack wait and the redelivery horizon.
    fn learn(&mut self, config: &consumer::Config) {
        self.ack_wait = if config.ack_wait.is_zero() {
            // The server's default for a consumer created without one.
            Duration::from_secs(30)
        } else {
            config.ack_wait
        };
        self.horizon = horizon(
            config.max_deliver,
            self.ack_wait,
            &config.backoff,
            self.shared.max_requeue_delay,
        );
    }

    /// Makes the pull subscription, finding (or making) the consumer first if needed.
    async fn open(&mut self) -> Result<pull::Stream, MqError> {
        let consumer = match self.consumer.take() {
            Some(consumer) => consumer,
            None => {
                let stream = self
                    .js
                    .get_stream(&self.settings.stream)
                    .await
                    .map_err(|e| {
                        MqError::broker(format!("stream {} not found", self.settings.stream), e)
                    })?;
                let consumer = open_consumer(&stream, &self.settings).await?;
                let config = consumer.cached_info().config.clone();
                self.learn(&config);
                consumer
            }
        };
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.settings.batch)
            .expires(PULL_EXPIRES)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|e| MqError::broker("cannot start pulling", e))?;
        Ok(messages)
    }

    /// Remembers a failure: the next attempt to pull waits, doubling up to the cap.
    fn failed(&mut self) {
        let next = match self.retry_wait {
            None => self.settings.retry_first,
            Some(wait) => (wait * 2).min(self.settings.retry_max),
        };
        self.retry_wait = Some(next);
    }
}

impl Source for NatsSource {
    type Delivery = NatsDelivery;

    fn name(&self) -> &str {
        &self.name
    }

    fn identity(&self) -> Identity<'_> {
        Identity::new("nats", [&*self.settings.stream, &self.settings.consumer])
    }

    async fn next(&mut self) -> Option<Result<NatsDelivery, MqError>> {
        if self.closed {
            return None;
        }
        if self.messages.is_none() {
            if let Some(wait) = self.retry_wait {
                tokio::time::sleep(wait).await;
            }
            match self.open().await {
                Ok(messages) => self.messages = Some(messages),
                Err(e) => {
                    self.failed();
                    return Some(Err(e));
                }
            }
        }
        let messages = self.messages.as_mut()?;
        match messages.next().await {
            Some(Ok(message)) => {
                self.retry_wait = None;
                Some(Ok(NatsDelivery {
                    message,
                    shared: Arc::clone(&self.shared),
                }))
            }
            Some(Err(e)) => {
                // Missed heartbeats, a deleted consumer, a failed pull request: start over.
                // Messages buffered in the dropped subscription come back after ack_wait.
                self.messages = None;
                self.failed();
                Some(Err(MqError::broker("pulling from the consumer failed", e)))
            }
            None => {
                self.messages = None;
                self.failed();
                Some(Err(MqError::Broker {
                    message: "the pull subscription ended".to_owned(),
                    source: None,
                }))
            }
        }
    }

    fn ack_wait(&self) -> Option<Duration> {
        Some(self.ack_wait)
    }

    fn redelivery_horizon(&self) -> Horizon {
        self.horizon
    }

    async fn close(&mut self) {
        self.closed = true;
        if let Some(mut messages) = self.messages.take() {
            // Hand back at once what was pulled but not handed out, rather than letting it
            // wait for its ack timer. Only what is already buffered: never wait here.
            while let Some(Some(Ok(message))) = messages.next().now_or_never() {
                let _ = message.ack_with(AckKind::Nak(None)).await;
            }
            drop(messages);
        }
        let _ = self.js.client().flush().await;
    }
}

/// Finds the durable consumer, or creates it from the builder's settings.
async fn open_consumer(
    stream: &jetstream::stream::Stream,
    settings: &NatsSourceBuilder,
) -> Result<PullConsumer, MqError> {
    let name = &settings.consumer;
    match settings.binding {
        Binding::Bind => stream
            .get_consumer(name)
            .await
            .map_err(|e| MqError::broker(format!("consumer {name} not found"), e)),
        Binding::CreateIfMissing => {
            let batch = i64::try_from(settings.batch).unwrap_or(i64::MAX);
            let config = pull::Config {
                durable_name: Some(name.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: settings.ack_wait,
                max_deliver: settings.max_deliver,
                filter_subject: settings.filter_subject.clone().unwrap_or_default(),
                max_ack_pending: settings.max_ack_pending.unwrap_or(batch),
                ..Default::default()
            };
            stream
                .get_or_create_consumer(name, config)
                .await
                .map_err(|e| MqError::broker(format!("cannot create consumer {name}"), e))
        }
    }
}

/// Refuses a dead-letter subject the consumer would read back, or one no stream stores.
async fn check_dead_letter(
    js: &jetstream::Context,
    stream: &jetstream::stream::Info,
    filter: &str,
    target: &DeadLetterTarget,
) -> Result<(), MqError> {
    let subject = match target {
        DeadLetterTarget::Stream(s) | DeadLetterTarget::Subject(s) => s,
        DeadLetterTarget::TermOnly => return Ok(()),
    };
    let captured = stream
        .config
        .subjects
        .iter()
        .any(|p| subject_matches(p, subject));
    let filtered_in = filter.is_empty() || subject_matches(filter, subject);
    if captured && filtered_in {
        return Err(MqError::Config(format!(
            "the dead-letter subject {subject} is stored in stream {} and read by the consumer \
             itself; choose a subject outside the stream or filter the consumer",
            stream.config.name
        )));
    }
    if let DeadLetterTarget::Stream(_) = target
        && let Err(e) = js.stream_by_subject(subject.as_str()).await
    {
        return Err(MqError::Config(format!(
            "no stream stores the dead-letter subject {subject} ({e}); create one, or \
             dead-letter to a core subject or with a term only"
        )));
    }
    Ok(())
}

/// The redelivery horizon of a consumer (see [the module docs](super#redelivery-horizon)).
fn horizon(
    max_deliver: i64,
    ack_wait: Duration,
    backoff: &[Duration],
    max_requeue_delay: Duration,
) -> Horizon {
    let Ok(redeliveries) = u32::try_from(max_deliver.saturating_sub(1)) else {
        return Horizon::Unbounded;
    };
    let longest_wait = backoff.iter().copied().fold(ack_wait, Duration::max);
    let gap = longest_wait.saturating_add(max_requeue_delay);
    Horizon::Bounded(gap.saturating_mul(redeliveries))
}

/// Whether the subject `subject` matches the NATS subject pattern `pattern` (`*` one token,
/// `>` one or more trailing tokens).
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_like_nats() {
        assert!(subject_matches("ORDERS.>", "ORDERS.dead"));
        assert!(subject_matches("ORDERS.>", "ORDERS.a.b"));
        assert!(!subject_matches("ORDERS.>", "ORDERS"));
        assert!(subject_matches("ORDERS.*", "ORDERS.dead"));
        assert!(!subject_matches("ORDERS.*", "ORDERS.a.b"));
        assert!(subject_matches("ORDERS.dead", "ORDERS.dead"));
        assert!(!subject_matches("ORDERS.in", "ORDERS.dead"));
        assert!(!subject_matches("ORDERS", "ORDERS.dead"));
    }

    #[test]
    fn horizon_counts_every_redelivery_gap() {
        let s = Duration::from_secs;
        assert_eq!(horizon(-1, s(30), &[], s(300)), Horizon::Unbounded);
        assert_eq!(horizon(0, s(30), &[], s(300)), Horizon::Unbounded);
        assert_eq!(horizon(1, s(30), &[], s(300)), Horizon::Bounded(s(0)));
        assert_eq!(horizon(5, s(30), &[], s(300)), Horizon::Bounded(s(4 * 330)));
        assert_eq!(
            horizon(3, s(30), &[s(10), s(600)], s(60)),
            Horizon::Bounded(s(2 * 660))
        );
    }
}
