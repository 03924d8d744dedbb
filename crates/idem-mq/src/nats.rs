//! NATS JetStream: a durable pull consumer as a [`Source`], and publishing with `Nats-Msg-Id`.
//!
//! [`NatsSource`] pulls from a durable consumer with explicit acks. A message's id (the
//! consumer's default key) is its `Nats-Msg-Id` header; its delivery count is JetStream's own
//! `num_delivered`, so a consumer that crashes in a loop on one message still sees the count
//! rise and dead-letters it.
//!
//! | disposition | what the broker is told |
//! | --- | --- |
//! | [`Disposition::Ack`] | `+ACK`, confirmed by the server when [`NatsSourceBuilder::confirm_acks`] is on (the default) |
//! | [`Disposition::Requeue`] | `-NAK {"delay": …}`: redelivered after the delay |
//! | [`Disposition::DeadLetter`] | a copy published to the dead-letter subject with the reason, then `+TERM` |
//!
//! # Two duplicate filters, and what each one catches
//!
//! JetStream drops a publish whose `Nats-Msg-Id` it has seen on the same stream within the
//! stream's `duplicate_window` (two minutes unless configured). [`publish_once`] sets that
//! header from the idempotency key, so a publisher that retries after a lost publish ack does
//! not store the message twice. The window is short by design: the server keeps every id of
//! the window in memory.
//!
//! idem's records sit on the consumer side and live for hours or days (their TTL). They catch
//! what the window cannot: every redelivery of one stored message (a lost ack, an ack timer
//! that fired, a consumer that crashed mid-handler), and a re-publish of the same key after
//! the window closed (a publisher replaying its outbox the next morning). Use both: the window
//! keeps the stream small, the records make the handler's effect happen once.
//!
//! # Redelivery horizon
//!
//! [`Source::redelivery_horizon`] is how long after a delivery JetStream may still deliver the
//! same message again; the consumer refuses to run with a record TTL shorter than it. With a
//! finite `max_deliver` the adapter reports
//! `(max_deliver - 1) × (longest ack wait + longest requeue delay)`, where the longest ack
//! wait is the larger of `ack_wait` and the consumer's `backoff` steps and the longest requeue
//! delay is [`NatsSourceBuilder::max_requeue_delay`] (requeue delays are clamped to it, so the
//! bound holds). It counts from the moment a delivery ends (settled or timed out): the time a
//! handler runs while reporting progress is not in it, and neither is time during which no
//! instance pulls from the consumer (a message waits for a puller, then comes back). With
//! `max_deliver` unlimited (`-1`, JetStream's default) the horizon is
//! [`Horizon::Unbounded`].

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::consumer::{self, AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use idem_core::ClientKey;

use crate::{DeadLetter, Delivery, Disposition, Horizon, MqError, Source};

/// Header carrying [`crate::Reason::code`] on a dead-lettered copy.
pub const REASON_HEADER: &str = "Idem-Reason";
/// Header carrying the sentence of a [`DeadLetter`] on a dead-lettered copy.
pub const DETAIL_HEADER: &str = "Idem-Detail";
/// Header carrying the stream the dead-lettered message came from.
pub const STREAM_HEADER: &str = "Idem-Stream";
/// Header carrying the subject the dead-lettered message was published to.
pub const SUBJECT_HEADER: &str = "Idem-Subject";
/// Header carrying the stream sequence of the dead-lettered message.
pub const SEQUENCE_HEADER: &str = "Idem-Sequence";
/// Header carrying how many times the dead-lettered message was delivered.
pub const DELIVERIES_HEADER: &str = "Idem-Deliveries";
/// Header carrying the original `Nats-Msg-Id` of a dead-lettered message. The copy's own
/// `Nats-Msg-Id` is `<stream>:<sequence>`, so that dead-lettering one message twice (a crash
/// between the copy and the `+TERM`, then a redelivery) stores one copy, within the
/// dead-letter stream's duplicate window.
pub const MSG_ID_HEADER: &str = "Idem-Msg-Id";

/// Longest `Idem-Detail` value, in bytes; longer sentences are cut at a character boundary.
const MAX_DETAIL_LEN: usize = 1024;
/// How long a pull request stays open at the server.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
/// Idle heartbeat of a pull request: two missed ones end the pull and it is made again.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// Where a dead-lettered message goes before it is terminated (`+TERM`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterTarget {
    /// Publish a copy through JetStream to this subject and wait for the stream's ack; the
    /// message is terminated only once the copy is stored. A stream must capture the subject
    /// (checked when the source is built). The default, on `<stream>.dead`.
    Stream(String),
    /// Publish a copy on core NATS to this subject (no stream needed; whoever subscribes at
    /// that moment gets it, nobody stores it).
    Subject(String),
    /// Publish nothing: only `+TERM` (with the reason code on servers from 2.11), which the
    /// server announces as a `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED` advisory.
    TermOnly,
}

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
    /// [redelivery horizon](self#redelivery-horizon).
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
    /// two things: [`Delivery::settle`] fails when the ack did not reach the server (so the
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
    /// shortened to it. It enters the [redelivery horizon](self#redelivery-horizon).
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
        if self.binding == Binding::CreateIfMissing {
            // Before creating anything, with the filter the consumer would get.
            check_dead_letter(&js, stream.cached_info(), &wanted_filter, &dead_letter).await?;
        }
        let consumer = open_consumer(&stream, &self).await?;
        let info = consumer.cached_info().clone();
        if self.binding == Binding::Bind || info.config.filter_subject != wanted_filter {
            // The consumer as it is (bound, or made earlier with another filter).
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
    /// `<stream>.<consumer>`: each durable consumer of a stream sees every message, so each
    /// keeps records of its own (the consumer's default namespace).
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

    /// The JetStream context the source uses (to publish with [`publish_once`], or to manage
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

/// What every delivery of one source shares.
#[derive(Debug)]
struct Shared {
    stream: String,
    dead_letter: DeadLetterTarget,
    confirm_acks: bool,
    max_requeue_delay: Duration,
}

/// One JetStream message, held until it is settled.
#[derive(Debug)]
pub struct NatsDelivery {
    message: jetstream::Message,
    shared: Arc<Shared>,
}

impl NatsDelivery {
    /// The JetStream message (subject, headers, payload, reply subject).
    pub fn message(&self) -> &jetstream::Message {
        &self.message
    }

    /// The subject the message was published to.
    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    /// The message's sequence number in its stream, if its metadata can be read.
    pub fn stream_sequence(&self) -> Option<u64> {
        self.message.info().ok().map(|info| info.stream_sequence)
    }

    /// Sends one acknowledgement (`+ACK`, `-NAK`, `+TERM`, `+WPI`) for this message, waiting
    /// for the server's confirmation if `confirm`.
    ///
    /// A confirmed acknowledgement is what `async-nats` calls a double ack, sent as a request
    /// on the client's one shared reply subscription: its `double_ack` subscribes a fresh
    /// inbox for every ack, two more protocol messages per message.
    async fn send(&self, payload: Bytes, confirm: bool) -> Result<(), MqError> {
        let Some(reply) = self.message.reply.clone() else {
            return Err(MqError::Broker {
                message: "the message has no reply subject to acknowledge on".to_owned(),
                source: None,
            });
        };
        let client = self.message.context.client();
        if confirm {
            client
                .request(reply, payload)
                .await
                .map(|_| ())
                .map_err(|e| MqError::broker("the server did not confirm the acknowledgement", e))
        } else {
            client
                .publish(reply, payload)
                .await
                .map_err(|e| MqError::broker("cannot send the acknowledgement", e))
        }
    }

    /// Publishes the dead-lettered copy, with the reason and where the message came from.
    async fn publish_dead_letter(&self, dead: &DeadLetter) -> Result<(), MqError> {
        let subject = match &self.shared.dead_letter {
            DeadLetterTarget::Stream(s) | DeadLetterTarget::Subject(s) => s.clone(),
            DeadLetterTarget::TermOnly => return Ok(()),
        };
        let info = self.message.info().ok();
        let mut headers = HeaderMap::new();
        if let Some(original) = &self.message.headers {
            for (name, values) in original.iter() {
                let text: &str = name.as_ref();
                // JetStream's own headers would steer the copy's publish (dedupe, expected
                // sequences, TTL, rollups); the original id is kept under MSG_ID_HEADER.
                if text.starts_with("Nats-") {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        if let Some(id) = self.message_id() {
            headers.insert(MSG_ID_HEADER, HeaderValue::from(id));
        }
        headers.insert(REASON_HEADER, HeaderValue::from(dead.reason.code()));
        headers.insert(DETAIL_HEADER, HeaderValue::from(header_text(&dead.detail)));
        headers.insert(
            STREAM_HEADER,
            HeaderValue::from(self.shared.stream.as_str()),
        );
        headers.insert(SUBJECT_HEADER, HeaderValue::from(self.subject()));
        if let Some(info) = &info {
            headers.insert(SEQUENCE_HEADER, HeaderValue::from(info.stream_sequence));
            headers.insert(DELIVERIES_HEADER, HeaderValue::from(info.delivered));
        }
        let client = self.message.context.client();
        match &self.shared.dead_letter {
            DeadLetterTarget::Stream(_) => {
                if let Some(info) = &info {
                    let id = format!("{}:{}", info.stream, info.stream_sequence);
                    headers.insert(NATS_MESSAGE_ID, HeaderValue::from(id));
                }
                let publish = PublishMessage::build()
                    .headers(headers)
                    .payload(self.message.payload.clone());
                self.message
                    .context
                    .send_publish(subject, publish)
                    .await
                    .map_err(|e| MqError::broker("cannot publish to the dead letter", e))?
                    .await
                    .map_err(|e| MqError::broker("the dead letter did not store the copy", e))?;
            }
            DeadLetterTarget::Subject(_) => {
                client
                    .publish_with_headers(subject, headers, self.message.payload.clone())
                    .await
                    .map_err(|e| MqError::broker("cannot publish to the dead letter", e))?;
            }
            DeadLetterTarget::TermOnly => {}
        }
        Ok(())
    }
}

impl Delivery for NatsDelivery {
    fn message_id(&self) -> Option<&str> {
        self.message
            .headers
            .as_ref()?
            .get(NATS_MESSAGE_ID)
            .map(HeaderValue::as_str)
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        // A name the client cannot represent is in no message.
        let name = HeaderName::from_str(name).ok()?;
        self.message
            .headers
            .as_ref()?
            .get(name)
            .map(|v| Cow::Borrowed(v.as_str()))
    }

    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn delivery_count(&self) -> Option<u32> {
        let delivered = self.message.info().ok()?.delivered;
        u32::try_from(delivered).ok()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        // Fire and forget: progress is repeated at a third of ack_wait, so one lost `+WPI` is
        // made up by the next.
        self.send(AckKind::Progress.into(), false).await
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        let confirm = self.shared.confirm_acks;
        match how {
            Disposition::Ack => self.send(AckKind::Ack.into(), confirm).await,
            Disposition::Requeue { delay } => {
                let delay = delay.min(self.shared.max_requeue_delay);
                let nak = if delay.is_zero() {
                    AckKind::Nak(None)
                } else {
                    AckKind::Nak(Some(delay))
                };
                self.send(nak.into(), confirm).await
            }
            Disposition::DeadLetter(dead) => {
                // The copy first: if it cannot be stored the message is not terminated, and
                // comes back after ack_wait to be dead-lettered again.
                self.publish_dead_letter(&dead).await?;
                let client = self.message.context.client();
                // Servers before 2.11 compare the whole payload with `+TERM` and ignore one
                // with a reason, which would leave the message to be redelivered.
                let term = if client.is_server_compatible(2, 11, 0) {
                    Bytes::from(format!("+TERM {}", dead.reason.code()))
                } else {
                    AckKind::Term.into()
                };
                self.send(term, confirm).await
            }
        }
    }
}

/// What [`publish_once`] learnt from the stream's ack.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// The stream that stored the message.
    pub stream: String,
    /// Its sequence in that stream (for a duplicate, the sequence of the first copy).
    pub sequence: u64,
    /// The server had already stored a message with this `Nats-Msg-Id` within the stream's
    /// `duplicate_window`, and dropped this one.
    pub duplicate: bool,
}

/// Publishes `payload` to `subject` with `Nats-Msg-Id` set to `key`, and waits for the
/// stream's ack.
///
/// The key must be a valid idempotency key (visible ASCII, 1 to 255 bytes): it becomes the
/// message's key on the consumer side. A re-publish within the stream's `duplicate_window` is
/// dropped by the server ([`Published::duplicate`]); a later one is stored again and the
/// consumer's records catch it (see [the module docs](self#two-duplicate-filters-and-what-each-one-catches)).
///
/// ```no_run
/// # async fn example() -> Result<(), idem_mq::MqError> {
/// use idem_mq::nats::publish_once;
///
/// let client = async_nats::connect("nats://127.0.0.1:4222")
///     .await
///     .map_err(|e| idem_mq::MqError::broker("connect", e))?;
/// let js = async_nats::jetstream::new(client);
/// // The payment's id is the key: a retry of this publish is the same message.
/// let published = publish_once(&js, "ORDERS.paid", "payment-8812", "{}".into()).await?;
/// if published.duplicate {
///     // Published before within the stream's duplicate window; the server kept the first.
/// }
/// # Ok(())
/// # }
/// ```
pub async fn publish_once(
    js: &jetstream::Context,
    subject: impl Into<String>,
    key: &str,
    payload: Bytes,
) -> Result<Published, MqError> {
    publish_once_with_headers(js, subject, key, HeaderMap::new(), payload).await
}

/// [`publish_once`] with more headers (`Nats-Msg-Id` among them is replaced by `key`).
pub async fn publish_once_with_headers(
    js: &jetstream::Context,
    subject: impl Into<String>,
    key: &str,
    headers: HeaderMap,
    payload: Bytes,
) -> Result<Published, MqError> {
    let key = ClientKey::new(key)
        .map_err(|e| MqError::Config(format!("the message key is not a valid key: {e}")))?;
    let publish = PublishMessage::build()
        .headers(headers)
        .message_id(key.as_str())
        .payload(payload);
    let ack = js
        .send_publish(subject.into(), publish)
        .await
        .map_err(|e| MqError::broker("cannot publish", e))?
        .await
        .map_err(|e| MqError::broker("the stream did not acknowledge the publish", e))?;
    Ok(Published {
        stream: ack.stream,
        sequence: ack.sequence,
        duplicate: ack.duplicate,
    })
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

/// The redelivery horizon of a consumer (see [the module docs](self#redelivery-horizon)).
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

/// `text` made fit for a header value: control characters become spaces, and it is cut to
/// [`MAX_DETAIL_LEN`] bytes at a character boundary.
fn header_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_DETAIL_LEN));
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > MAX_DETAIL_LEN {
            break;
        }
        out.push(c);
    }
    out
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

    #[test]
    fn header_text_has_no_line_breaks_and_a_bound() {
        assert_eq!(header_text("a\r\nb"), "a  b");
        let long = "é".repeat(MAX_DETAIL_LEN);
        let cut = header_text(&long);
        assert!(cut.len() <= MAX_DETAIL_LEN);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
