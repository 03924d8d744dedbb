//! RabbitMQ and other AMQP 0-9-1 brokers, over [`lapin`].
//!
//! [`AmqpSource`] consumes one queue and implements [`Source`]; its deliveries
//! ([`AmqpDelivery`]) implement [`Delivery`]. [`AmqpPublisher`] and [`publish_once`] publish
//! with the message id taken from an idempotency key, persistent, and wait for the broker's
//! publisher confirm.
//!
//! # Topology
//!
//! By default the source declares, idempotently, what it needs (all durable):
//!
//! | name | what |
//! | --- | --- |
//! | `<queue>` | the work queue; a quorum queue by default (`x-queue-type=quorum`), so the broker counts deliveries (`x-delivery-count`); its `x-dead-letter-exchange` is the exchange below |
//! | `<queue>.dlx` | the dead-letter exchange (fanout) |
//! | `<queue>.dead` | the dead-letter queue, bound to it |
//! | `<queue>.delay.<ms>` | one delay queue per delay bucket, declared on first use, of the work queue's type: `x-message-ttl=<ms>`, dead-lettering to the work queue (at least once, for quorum queues) |
//!
//! A declaration with other arguments than an existing queue's is refused by the broker
//! (`PRECONDITION_FAILED`): turn declarations off ([`AmqpSourceBuilder::declare`]) to consume
//! a queue managed elsewhere. The delay queues are declared either way: they are idem's own.
//!
//! # Settling
//!
//! * [`Disposition::Ack`] is a `basic.ack`.
//! * [`Disposition::Requeue`] publishes a copy of the message (same properties and headers,
//!   persistent, with the attempt header `x-idem-attempt` set to the deliveries so far) to the
//!   delay queue of the smallest bucket at least as long as the delay (to the work queue itself
//!   for a zero delay), waits for the publisher confirm, and only then acks the original. One
//!   delay queue per bucket, rather than one queue with a per-message `expiration`, because
//!   RabbitMQ only expires messages at the head of a queue: a long delay would hold back the
//!   short ones queued behind it. A crash (or a lost connection) between the confirm and the
//!   ack leaves two copies, the original redelivered and the delayed one: a duplicate, which
//!   the idempotency record absorbs like any other. If the copy is not confirmed (a nack, no
//!   queue for it, no confirm within [`CONFIRM_TIMEOUT`]), the original is given back to the
//!   queue at once (`basic.nack` with requeue) and the settle fails.
//! * [`Disposition::DeadLetter`] publishes a copy to the dead-letter exchange with the headers
//!   `x-idem-reason` ([`Reason::code`](crate::Reason::code)) and `x-idem-detail`, waits for the
//!   confirm, then acks the original. A plain `basic.reject` would dead-letter through the
//!   queue's `x-dead-letter-exchange` too, but cannot add headers, and the reason would be lost.
//!   The same crash window gives, at worst, the message both dead-lettered and redelivered;
//!   the redelivery finds its stored outcome and is dead-lettered again (the dead-letter queue
//!   may then hold two copies).
//!
//! # Delivery count
//!
//! [`Delivery::delivery_count`] adds the attempt header of a republished copy to the broker's
//! count of the copy: a quorum queue's `x-delivery-count` plus one, or one for a copy the broker
//! has not delivered before (`redelivered` unset). A classic queue does not count redeliveries
//! after a lost connection: there a redelivered message without a quorum count answers `None`.
//! The consumer counts a message's runs by its record, not by this count (see
//! [`Consumer::max_attempts`](crate::Consumer::max_attempts)); the count matters for
//! messages without a key, which have no record: use a quorum queue so that a crash loop
//! among those is counted too.
//!
//! # Timers
//!
//! AMQP has no progress ack: [`Delivery::in_progress`] is a no-op. RabbitMQ closes a channel
//! whose delivery stays unacknowledged longer than its `consumer_timeout` (30 minutes by
//! default) and redelivers everything the channel held: a handler must finish well within it.
//! The timeout is a broker setting (`consumer_timeout` in `rabbitmq.conf`); RabbitMQ 3.12 and
//! later also take it per queue from the `x-consumer-timeout` argument
//! ([`AmqpSourceBuilder::consumer_timeout`]).
//!
//! # Redelivery horizon
//!
//! An AMQP queue keeps a message until it is acked, however long no consumer takes it; a
//! delivery limit (`x-delivery-limit` on a quorum queue) bounds how many times it is delivered,
//! not when. So the horizon is [`Horizon::Unbounded`]: a record whose TTL has passed no longer
//! guards a message that comes back later. An operator who bounds it (a queue
//! `x-message-ttl`, and a bounded number of requeues each with a bounded delay) states the bound
//! with [`AmqpSourceBuilder::redelivery_horizon`].
//!
//! # Reconnection
//!
//! [`Source::next`] reconnects by itself after the connection or the channel is lost (a
//! broker restart, a connection closed by an operator), waiting 100 ms, doubling to 5 s between
//! failed attempts, then declares the topology and consumes again. Deliveries handed out on the
//! lost channel cannot be settled any more: their [`Delivery::settle`] fails with
//! [`MqError::Broker`], and the broker delivers the messages again.

use std::borrow::Cow;
use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use tokio::time::Instant;

use crate::MqError;
use crate::source::{DeadLetter, Delivery, Disposition, Horizon, Source};

pub use lapin;
pub use lapin::BasicProperties;

/// The header a republished copy carries: how many deliveries the message had before the copy.
pub const ATTEMPT_HEADER: &str = "x-idem-attempt";
/// The header a dead-lettered copy carries: the reason's stable code
/// ([`Reason::code`](crate::Reason::code)).
pub const REASON_HEADER: &str = "x-idem-reason";
/// The header a dead-lettered copy carries: the reason as a sentence (at most
/// [`MAX_DETAIL_BYTES`] bytes; longer details are cut at a character boundary).
pub const DETAIL_HEADER: &str = "x-idem-detail";
/// The longest `x-idem-detail` header, in bytes.
pub const MAX_DETAIL_BYTES: usize = 4096;
/// The header a quorum queue counts earlier deliveries in.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// The delay buckets, in milliseconds: a requeue waits for the smallest bucket at least as long
/// as its delay (the largest for longer delays).
pub const DELAY_BUCKETS_MS: &[u64] = &[
    100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000,
    1_800_000, 3_600_000,
];

const DEFAULT_PREFETCH: u16 = 64;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const PERSISTENT: u8 = 2;
/// How long a publish waits for the broker's confirm (a broker short of memory or disk blocks
/// publishers) before it fails: the message may or may not have been taken.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long any other broker operation (connecting, declaring, acking, cancelling, closing)
/// may take before it fails.
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// The kind of queue the source declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A quorum queue (`x-queue-type=quorum`): replicated, and it counts deliveries, so a
    /// message that crashes its consumer again and again is dead-lettered.
    #[default]
    Quorum,
    /// A classic queue: the broker does not count redeliveries after a lost connection.
    Classic,
}

impl QueueType {
    fn argument(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// The names and arguments of the queues and exchanges a source uses.
#[derive(Debug, Clone)]
struct Topology {
    queue: String,
    queue_type: QueueType,
    dead_letter_exchange: String,
    dead_letter_queue: String,
    delivery_limit: Option<u32>,
    consumer_timeout: Option<Duration>,
    declare: bool,
}

impl Topology {
    fn delay_queue(&self, bucket_ms: u64) -> String {
        format!("{}.delay.{bucket_ms}", self.queue)
    }

    fn work_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.argument().into()),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dead_letter_exchange.as_str().into()),
        );
        if let Some(limit) = self.delivery_limit {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(limit)),
            );
        }
        if let Some(timeout) = self.consumer_timeout {
            args.insert(
                "x-consumer-timeout".into(),
                AMQPValue::LongLongInt(millis_i64(timeout)),
            );
        }
        args
    }

    fn dead_queue_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.argument().into()),
        );
        args
    }

    fn delay_queue_arguments(&self, bucket_ms: u64) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.argument().into()),
        );
        if self.queue_type == QueueType::Quorum {
            // A quorum queue moves an expired message to its dead-letter target only once the
            // target confirmed it (RabbitMQ 3.10 and later): a delayed copy survives a node
            // failure. The strategy requires `reject-publish` overflow.
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(i64::try_from(bucket_ms).unwrap_or(i64::MAX)),
        );
        // The default exchange routes by queue name: expired copies go back to the work queue.
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.queue.as_str().into()),
        );
        args
    }

    /// Declares the work queue, the dead-letter exchange and queue (if declarations are on).
    async fn declare(&self, channel: &Channel) -> Result<(), MqError> {
        if !self.declare {
            return Ok(());
        }
        channel
            .exchange_declare(
                short(&self.dead_letter_exchange)?,
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .bounded("declaring the dead-letter exchange")
            .await?;
        channel
            .queue_declare(
                short(&self.dead_letter_queue)?,
                durable(),
                self.dead_queue_arguments(),
            )
            .bounded("declaring the dead-letter queue")
            .await?;
        channel
            .queue_bind(
                short(&self.dead_letter_queue)?,
                short(&self.dead_letter_exchange)?,
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .bounded("binding the dead-letter queue")
            .await?;
        channel
            .queue_declare(short(&self.queue)?, durable(), self.work_queue_arguments())
            .bounded("declaring the work queue")
            .await?;
        Ok(())
    }
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

fn millis_i64(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn short(s: &str) -> Result<ShortString, MqError> {
    ShortString::try_new(s)
        .map_err(|_| MqError::Config(format!("AMQP name longer than 255 bytes: {s:.40}…")))
}

fn bucket_for(delay: Duration) -> Option<u64> {
    if delay.is_zero() {
        return None;
    }
    let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    DELAY_BUCKETS_MS
        .iter()
        .copied()
        .find(|b| *b >= ms)
        .or(DELAY_BUCKETS_MS.last().copied())
}

/// Options of an [`AmqpSource`]; made by [`AmqpSource::builder`].
#[derive(Debug, Clone)]
pub struct AmqpSourceBuilder {
    url: String,
    prefetch: u16,
    connection_name: Option<String>,
    redelivery_horizon: Option<Duration>,
    topology: Topology,
}

impl AmqpSourceBuilder {
    /// How many unacknowledged deliveries the broker hands this source at once (`basic.qos`);
    /// 64 by default. At least the consumer's concurrency, or handlers wait for messages.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Whether to declare the work queue, the dead-letter exchange and the dead-letter queue
    /// (on by default; the declarations are idempotent). Off, they must exist. The delay queues
    /// are declared either way.
    pub fn declare(mut self, declare: bool) -> Self {
        self.topology.declare = declare;
        self
    }

    /// The type of the work queue and the dead-letter queue, when declared; quorum by default.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.topology.queue_type = queue_type;
        self
    }

    /// The dead-letter exchange (`<queue>.dlx` by default): dead-lettered copies are published
    /// to it, and it is the work queue's `x-dead-letter-exchange`.
    pub fn dead_letter_exchange(mut self, name: impl Into<String>) -> Self {
        self.topology.dead_letter_exchange = name.into();
        self
    }

    /// The dead-letter queue bound to the dead-letter exchange (`<queue>.dead` by default).
    pub fn dead_letter_queue(mut self, name: impl Into<String>) -> Self {
        self.topology.dead_letter_queue = name.into();
        self
    }

    /// Declares the work queue with `x-delivery-limit` (quorum queues): the broker itself
    /// dead-letters a message returned this many times (through the dead-letter exchange, with
    /// its `x-death` header but no `x-idem-reason`). None by default; the consumer's own
    /// attempt limit dead-letters with the reason before it.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.topology.delivery_limit = Some(limit);
        self
    }

    /// Declares the work queue with `x-consumer-timeout` (RabbitMQ 3.12 and later; older
    /// brokers ignore it): how long a delivery may stay unacknowledged before the broker closes
    /// the channel and redelivers. A handler must finish within it.
    pub fn consumer_timeout(mut self, timeout: Duration) -> Self {
        self.topology.consumer_timeout = Some(timeout);
        self
    }

    /// States that the broker does not deliver a message again later than this after its first
    /// delivery (for instance a queue `x-message-ttl` plus the longest retry schedule); the
    /// source then reports [`Horizon::Bounded`] instead of [`Horizon::Unbounded`].
    pub fn redelivery_horizon(mut self, horizon: Duration) -> Self {
        self.redelivery_horizon = Some(horizon);
        self
    }

    /// The connection's name, as the broker shows it (`rabbitmqctl list_connections name`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Connects, declares the topology and starts consuming.
    pub async fn connect(self) -> Result<AmqpSource, MqError> {
        let names = [
            &self.topology.queue,
            &self.topology.dead_letter_exchange,
            &self.topology.dead_letter_queue,
        ];
        for name in names {
            short(name)?;
        }
        // The longest delay queue name must fit too.
        short(&self.topology.delay_queue(u64::MAX))?;
        let config = Arc::new(Config {
            url: self.url,
            prefetch: self.prefetch,
            connection_name: self.connection_name,
            redelivery_horizon: self.redelivery_horizon,
            topology: self.topology,
        });
        let live = Live::connect(&config).await?;
        Ok(AmqpSource {
            config,
            live: Some(live),
            closed: false,
            retry_at: None,
            backoff: FIRST_BACKOFF,
        })
    }
}

#[derive(Debug)]
struct Config {
    url: String,
    prefetch: u16,
    connection_name: Option<String>,
    redelivery_horizon: Option<Duration>,
    topology: Topology,
}

/// One connection's worth of state, shared with the deliveries it handed out: the connection
/// stays open while the source or any of them holds it.
struct Link {
    /// Shared, so that the close sent when the link is dropped can own it.
    connection: Arc<Connection>,
    /// The channel the deliveries arrived on (and are acked on).
    consume: Channel,
    /// A channel in confirm mode, for the copies requeues and dead letters publish.
    publish: Channel,
    topology: Topology,
    /// The delay buckets declared on this connection.
    delays: Mutex<HashSet<u64>>,
}

/// Closes the connection once the source and every delivery of it are gone, explicitly:
/// lapin closes a connection by itself only when the last handle to it and to each of its
/// channels is gone, and a connection left open keeps its unacknowledged deliveries from
/// every other consumer until the process exits.
impl Drop for Link {
    fn drop(&mut self) {
        let connection = self.connection.clone();
        if connection.status().connected()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                let _ = connection.close(200, "OK".into()).bounded("closing").await;
            });
        }
    }
}

impl Link {
    async fn ensure_delay_queue(&self, bucket_ms: u64) -> Result<String, MqError> {
        let name = self.topology.delay_queue(bucket_ms);
        let known = self
            .delays
            .lock()
            .map(|d| d.contains(&bucket_ms))
            .unwrap_or(false);
        if known {
            return Ok(name);
        }
        // A separate channel: a refused declaration closes its channel, and must not take the
        // publishing channel with it.
        let channel = self
            .connection
            .create_channel()
            .bounded("opening a channel")
            .await?;
        channel
            .queue_declare(
                short(&name)?,
                durable(),
                self.topology.delay_queue_arguments(bucket_ms),
            )
            .bounded("declaring a delay queue")
            .await?;
        let _ = channel.close(200, "OK".into()).bounded("closing").await;
        if let Ok(mut d) = self.delays.lock() {
            d.insert(bucket_ms);
        }
        Ok(name)
    }
}

struct Live {
    link: Arc<Link>,
    consumer: lapin::Consumer,
    tag: ShortString,
}

impl Live {
    async fn connect(config: &Config) -> Result<Self, MqError> {
        let mut props = ConnectionProperties::default();
        if let Some(name) = &config.connection_name {
            props = props.with_connection_name(LongString::from(name.as_str()));
        }
        let connection = Connection::connect(&config.url, props)
            .bounded("connecting to the AMQP broker")
            .await?;
        let setup = connection
            .create_channel()
            .bounded("opening a channel")
            .await?;
        config.topology.declare(&setup).await?;
        let _ = setup.close(200, "OK".into()).bounded("closing").await;

        let publish = connection
            .create_channel()
            .bounded("opening a channel")
            .await?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .bounded("enabling publisher confirms")
            .await?;
        let consume = connection
            .create_channel()
            .bounded("opening a channel")
            .await?;
        consume
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .bounded("setting the prefetch")
            .await?;
        let consumer = consume
            .basic_consume(
                short(&config.topology.queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .bounded("consuming the queue")
            .await?;
        let tag = consumer.tag();
        Ok(Self {
            link: Arc::new(Link {
                connection: Arc::new(connection),
                consume,
                publish,
                topology: config.topology.clone(),
                delays: Mutex::new(HashSet::new()),
            }),
            consumer,
            tag,
        })
    }
}

/// A RabbitMQ queue as a [`Source`]: connects, declares the topology idem needs, consumes with
/// a prefetch, and reconnects by itself (see the [module docs](self)).
///
/// ```no_run
/// # async fn example() -> Result<(), idem_mq::MqError> {
/// use idem_mq::amqp::{AmqpPublisher, AmqpSource, BasicProperties};
/// use idem_mq::{Consumer, Failure, Message};
///
/// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let source = AmqpSource::builder(url, "orders").prefetch(32).connect().await?;
///
/// // The message id is the idempotency key: publishing it twice runs the handler once.
/// let publisher = AmqpPublisher::connect(url).await?;
/// let order = br#"{"sku":"A1","qty":2}"#;
/// publisher.publish_once("", "orders", "order-1042", order, BasicProperties::default()).await?;
/// publisher.publish_once("", "orders", "order-1042", order, BasicProperties::default()).await?;
///
/// // Records in memory for the example; a shared store (PostgreSQL, Redis) in production.
/// let consumer = Consumer::new(idem::MemoryStore::new()).concurrency(32);
/// let handler = |msg: Message| async move {
///     // deduct the stock for msg.payload ...
///     Ok::<_, Failure<String>>(msg.payload.len())
/// };
/// let shutdown = std::future::pending::<()>(); // a signal handler, in a real service
/// consumer.run(source, handler, shutdown).await?;
/// # Ok(()) }
/// ```
///
/// Without the consumer, a source is a stream of [`AmqpDelivery`]s, each settled once:
///
/// ```no_run
/// # async fn example(mut source: idem_mq::amqp::AmqpSource) -> Result<(), idem_mq::MqError> {
/// use idem_mq::{Delivery, Disposition, Source};
///
/// while let Some(delivery) = source.next().await {
///     let delivery = delivery?;
///     // ... handle delivery.payload() ...
///     delivery.settle(Disposition::Ack).await?;
/// }
/// # Ok(()) }
/// ```
pub struct AmqpSource {
    config: Arc<Config>,
    live: Option<Live>,
    closed: bool,
    retry_at: Option<Instant>,
    backoff: Duration,
}

impl std::fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSource")
            .field("queue", &self.config.topology.queue)
            .field("connected", &self.live.is_some())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl AmqpSource {
    /// The options of a source consuming `queue` at `url`
    /// (`amqp://guest:guest@127.0.0.1:5672/%2f`).
    pub fn builder(url: impl Into<String>, queue: impl Into<String>) -> AmqpSourceBuilder {
        let queue = queue.into();
        AmqpSourceBuilder {
            url: url.into(),
            prefetch: DEFAULT_PREFETCH,
            connection_name: None,
            redelivery_horizon: None,
            topology: Topology {
                dead_letter_exchange: format!("{queue}.dlx"),
                dead_letter_queue: format!("{queue}.dead"),
                queue,
                queue_type: QueueType::default(),
                delivery_limit: None,
                consumer_timeout: None,
                declare: true,
            },
        }
    }

    /// A source consuming `queue` at `url` with the default options.
    pub async fn connect(url: &str, queue: &str) -> Result<Self, MqError> {
        Self::builder(url, queue).connect().await
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue(&self) -> &str {
        &self.config.topology.dead_letter_queue
    }

    /// Whether the source holds a live connection now.
    pub fn is_connected(&self) -> bool {
        self.live
            .as_ref()
            .is_some_and(|l| l.link.connection.status().connected())
    }

    /// Closes the connection now (deliveries not yet settled go back to the queue). Dropping
    /// the source closes it too, once the deliveries it handed out are dropped.
    pub async fn shutdown(mut self) {
        self.closed = true;
        if let Some(live) = self.live.take() {
            let _ = live
                .link
                .connection
                .close(200, "OK".into())
                .bounded("closing")
                .await;
        }
    }

    /// Deletes the work queue, the dead-letter queue and exchange, and every delay queue
    /// (messages in them are lost). For tests and teardown; runs on its own connection.
    pub async fn delete_topology(url: &str, queue: &str) -> Result<(), MqError> {
        let topology = Self::builder(url, queue).topology;
        let connection = Connection::connect(url, ConnectionProperties::default())
            .bounded("connecting to the AMQP broker")
            .await?;
        let mut queues = vec![topology.queue.clone(), topology.dead_letter_queue.clone()];
        queues.extend(DELAY_BUCKETS_MS.iter().map(|b| topology.delay_queue(*b)));
        // One channel per deletion, going on after a failure (a refusal closes its channel):
        // as much as possible is deleted, and the first failure reported.
        let mut first_error = None;
        for queue in &queues {
            let deleted = async {
                let channel = connection
                    .create_channel()
                    .bounded("opening a channel")
                    .await?;
                channel
                    .queue_delete(short(queue)?, QueueDeleteOptions::default())
                    .bounded("deleting a queue")
                    .await?;
                let _ = channel.close(200, "OK".into()).bounded("closing").await;
                Ok::<_, MqError>(())
            }
            .await;
            if let Err(e) = deleted {
                first_error.get_or_insert(e);
            }
        }
        let deleted = async {
            let channel = connection
                .create_channel()
                .bounded("opening a channel")
                .await?;
            channel
                .exchange_delete(
                    short(&topology.dead_letter_exchange)?,
                    ExchangeDeleteOptions::default(),
                )
                .bounded("deleting an exchange")
                .await
        }
        .await;
        if let Err(e) = deleted {
            first_error.get_or_insert(e);
        }
        let _ = connection.close(200, "OK".into()).bounded("closing").await;
        first_error.map_or(Ok(()), Err)
    }

    fn lost(&mut self) {
        self.live = None;
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}

impl Source for AmqpSource {
    type Delivery = AmqpDelivery;

    fn name(&self) -> &str {
        &self.config.topology.queue
    }

    async fn next(&mut self) -> Option<Result<AmqpDelivery, MqError>> {
        loop {
            if self.closed {
                return None;
            }
            if self.live.is_none() {
                if let Some(at) = self.retry_at {
                    tokio::time::sleep_until(at).await;
                }
                match Live::connect(&self.config).await {
                    Ok(live) => {
                        tracing::info!(queue = %self.config.topology.queue, "AMQP source connected again");
                        self.retry_at = None;
                        self.live = Some(live);
                    }
                    Err(e) => {
                        self.lost();
                        return Some(Err(e));
                    }
                }
            }
            let Some(live) = self.live.as_mut() else {
                continue;
            };
            match live.consumer.next().await {
                Some(Ok(delivery)) => {
                    // A delivery means the link works: the next loss starts the backoff anew.
                    self.backoff = FIRST_BACKOFF;
                    return Some(Ok(AmqpDelivery {
                        inner: delivery,
                        link: Arc::clone(&live.link),
                    }));
                }
                Some(Err(e)) => {
                    self.lost();
                    return Some(Err(MqError::broker("AMQP consumer lost its channel", e)));
                }
                None => {
                    if self.closed {
                        return None;
                    }
                    // Cancelled by the broker (queue deleted, node down) or the channel ended.
                    self.lost();
                    return Some(Err(MqError::Broker {
                        message: "AMQP consumer cancelled by the broker".into(),
                        source: None,
                    }));
                }
            }
        }
    }

    fn redelivery_horizon(&self) -> Horizon {
        match self.config.redelivery_horizon {
            Some(h) => Horizon::Bounded(h),
            None => Horizon::Unbounded,
        }
    }

    async fn close(&mut self) {
        self.closed = true;
        if let Some(live) = &self.live {
            // Deliveries prefetched but not handed out stay unacked on the channel and go back
            // to the queue when the connection closes.
            let _ = live
                .link
                .consume
                .basic_cancel(live.tag.clone(), BasicCancelOptions::default())
                .bounded("cancelling the consumer")
                .await;
        }
    }
}

/// A message delivered by an [`AmqpSource`].
pub struct AmqpDelivery {
    inner: lapin::message::Delivery,
    link: Arc<Link>,
}

impl std::fmt::Debug for AmqpDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpDelivery")
            .field("delivery_tag", &self.inner.delivery_tag)
            .field("redelivered", &self.inner.redelivered)
            .finish_non_exhaustive()
    }
}

impl AmqpDelivery {
    /// The message's AMQP properties (headers included).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// Whether the broker marked the delivery as a redelivery.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    fn header_value(&self, name: &str) -> Option<&AMQPValue> {
        self.inner
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
    }

    fn header_u64(&self, name: &str) -> Option<u64> {
        self.header_value(name).and_then(value_u64)
    }

    /// Publishes a copy of the message (confirmed), then acks the original.
    async fn republish_then_ack(
        self,
        exchange: &str,
        routing_key: &str,
        headers: FieldTable,
    ) -> Result<(), MqError> {
        let props = self
            .inner
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(PERSISTENT);
        let published = publish_confirmed(
            &self.link.publish,
            exchange,
            routing_key,
            &self.inner.data,
            props,
            true,
        )
        .await;
        if let Err(e) = published {
            // The copy may not exist: give the original back to the queue now rather than
            // leave it unacknowledged until the channel closes. (If the broker did take the
            // copy, both come back: a duplicate the record absorbs.)
            let _ = self
                .inner
                .acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .bounded("giving a delivery back")
                .await;
            return Err(e);
        }
        // Between the confirm above and this ack a crash leaves both copies: a duplicate, which
        // the idempotency record absorbs.
        ack(&self.inner, &self.link).await
    }

    fn copied_headers(&self) -> FieldTable {
        let mut headers = FieldTable::default();
        if let Some(h) = self.inner.properties.headers() {
            for (k, v) in h.inner() {
                if k.as_str() != DELIVERY_COUNT_HEADER {
                    headers.insert(k.clone(), v.clone());
                }
            }
        }
        headers
    }
}

async fn ack(delivery: &lapin::message::Delivery, link: &Link) -> Result<(), MqError> {
    let closed = || MqError::Broker {
        message: "delivery cannot be acked: its channel is closed (the broker redelivers it)"
            .into(),
        source: None,
    };
    if !link.consume.status().connected() {
        return Err(closed());
    }
    match delivery
        .acker
        .ack(BasicAckOptions::default())
        .bounded("acking a delivery")
        .await?
    {
        true => Ok(()),
        false => Err(closed()),
    }
}

/// A broker operation with a deadline: lapin can leave an operation unanswered when its
/// connection dies under it, and a consumer must not wait for it forever.
trait Bounded<T>: Future<Output = lapin::Result<T>> + Sized {
    fn bounded(self, what: &'static str) -> BoundedOp<Self> {
        BoundedOp {
            inner: Box::pin(tokio::time::timeout(OP_TIMEOUT, self)),
            what,
        }
    }
}

impl<T, F: Future<Output = lapin::Result<T>>> Bounded<T> for F {}

struct BoundedOp<F> {
    inner: Pin<Box<tokio::time::Timeout<F>>>,
    what: &'static str,
}

impl<T, F: Future<Output = lapin::Result<T>>> Future for BoundedOp<F> {
    type Output = Result<T, MqError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let what = self.what;
        self.inner.as_mut().poll(cx).map(|done| match done {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(MqError::broker(what, e)),
            Err(_) => Err(MqError::Broker {
                message: format!("{what}: no answer from the broker within {OP_TIMEOUT:?}"),
                source: None,
            }),
        })
    }
}

fn value_u64(v: &AMQPValue) -> Option<u64> {
    match v {
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::Timestamp(n) => Some(*n),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        _ => None,
    }
}

fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Delivery for AmqpDelivery {
    fn message_id(&self) -> Option<&str> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        match self.header_value(name)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(Cow::Borrowed),
            AMQPValue::ShortString(s) => Some(Cow::Borrowed(s.as_str())),
            AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).ok().map(Cow::Borrowed),
            AMQPValue::Boolean(b) => Some(Cow::Owned(b.to_string())),
            AMQPValue::Float(x) => Some(Cow::Owned(x.to_string())),
            AMQPValue::Double(x) => Some(Cow::Owned(x.to_string())),
            AMQPValue::ShortShortInt(n) => Some(Cow::Owned(n.to_string())),
            AMQPValue::ShortInt(n) => Some(Cow::Owned(n.to_string())),
            AMQPValue::LongInt(n) => Some(Cow::Owned(n.to_string())),
            AMQPValue::LongLongInt(n) => Some(Cow::Owned(n.to_string())),
            v => value_u64(v).map(|n| Cow::Owned(n.to_string())),
        }
    }

    fn payload(&self) -> &[u8] {
        &self.inner.data
    }

    fn delivery_count(&self) -> Option<u32> {
        let earlier = self.header_u64(ATTEMPT_HEADER).unwrap_or(0);
        let this_copy = match self.header_u64(DELIVERY_COUNT_HEADER) {
            Some(returned) => returned.saturating_add(1),
            None if !self.inner.redelivered => 1,
            // Redelivered by a classic queue: it does not say how often.
            None => return None,
        };
        u32::try_from(earlier.saturating_add(this_copy)).ok()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        Ok(())
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        match how {
            Disposition::Ack => ack(&self.inner, &self.link).await,
            Disposition::Requeue { delay } => {
                let attempts = self
                    .delivery_count()
                    .map(u64::from)
                    .unwrap_or_else(|| self.header_u64(ATTEMPT_HEADER).unwrap_or(0) + 1);
                let mut headers = self.copied_headers();
                headers.insert(
                    ATTEMPT_HEADER.into(),
                    AMQPValue::LongLongInt(i64::try_from(attempts).unwrap_or(i64::MAX)),
                );
                let routing_key = match bucket_for(delay) {
                    Some(bucket) => self.link.ensure_delay_queue(bucket).await?,
                    None => self.link.topology.queue.clone(),
                };
                self.republish_then_ack("", &routing_key, headers).await
            }
            Disposition::DeadLetter(DeadLetter { reason, detail }) => {
                let mut headers = self.copied_headers();
                headers.insert(
                    REASON_HEADER.into(),
                    AMQPValue::LongString(reason.code().into()),
                );
                headers.insert(
                    DETAIL_HEADER.into(),
                    AMQPValue::LongString(cut(&detail, MAX_DETAIL_BYTES).into()),
                );
                let exchange = self.link.topology.dead_letter_exchange.clone();
                let routing_key = self.link.topology.queue.clone();
                self.republish_then_ack(&exchange, &routing_key, headers)
                    .await
            }
        }
    }
}

/// Publishes and waits for the broker's confirm; a nack, or (when `mandatory`) a message no
/// queue took, is an error.
async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    props: BasicProperties,
    mandatory: bool,
) -> Result<(), MqError> {
    let confirm = channel
        .basic_publish(
            short(exchange)?,
            short(routing_key)?,
            BasicPublishOptions {
                mandatory,
                immediate: false,
            },
            payload,
            props,
        )
        .bounded("publishing")
        .await?;
    let confirm = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| MqError::Broker {
            message: format!("no publisher confirm within {CONFIRM_TIMEOUT:?}"),
            source: None,
        })?
        .map_err(|e| MqError::broker("waiting for the publisher confirm", e))?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(MqError::Broker {
            message: "the broker returned the message: no queue is bound for its routing key"
                .into(),
            source: None,
        }),
        Confirmation::Nack(_) => Err(MqError::Broker {
            message: "the broker refused the message (publisher nack)".into(),
            source: None,
        }),
        Confirmation::NotRequested => Err(MqError::Broker {
            message: "the channel is not in confirm mode (call confirm_select first)".into(),
            source: None,
        }),
    }
}

/// Publishes `payload` once per idempotency `key`: the message id is the key, the message
/// persistent, and the call returns when the broker confirmed it.
///
/// `channel` must be in confirm mode (`confirm_select`); without a confirm within
/// [`CONFIRM_TIMEOUT`] the call fails. The publish is mandatory: a message no
/// queue takes is returned by the broker and reported as an error. A publisher that retries
/// after an error may publish twice; the consumer's records absorb the duplicate, since both
/// copies carry the same message id.
pub async fn publish_once(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    key: &str,
    payload: &[u8],
    props: BasicProperties,
) -> Result<(), MqError> {
    idem_core::ClientKey::new(key)
        .map_err(|e| MqError::Config(format!("not a valid idempotency key: {e}")))?;
    let props = props
        .with_message_id(short(key)?)
        .with_delivery_mode(PERSISTENT);
    publish_confirmed(channel, exchange, routing_key, payload, props, true).await
}

/// A connection and a channel in confirm mode, for [`publish_once`].
pub struct AmqpPublisher {
    connection: Option<Arc<Connection>>,
    channel: Channel,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// Connects to `url` and opens a channel in confirm mode. The connection closes when the
    /// publisher is dropped.
    pub async fn connect(url: &str) -> Result<Self, MqError> {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .bounded("connecting to the AMQP broker")
            .await?;
        let channel = connection
            .create_channel()
            .bounded("opening a channel")
            .await?;
        let mut publisher = Self::on_channel(channel).await?;
        publisher.connection = Some(Arc::new(connection));
        Ok(publisher)
    }

    /// Uses `channel` (of a connection the caller keeps open), putting it in confirm mode.
    pub async fn on_channel(channel: Channel) -> Result<Self, MqError> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .bounded("enabling publisher confirms")
            .await?;
        Ok(Self {
            connection: None,
            channel,
        })
    }

    /// The channel, in confirm mode.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// [`publish_once`] on this publisher's channel.
    pub async fn publish_once(
        &self,
        exchange: &str,
        routing_key: &str,
        key: &str,
        payload: &[u8],
        props: BasicProperties,
    ) -> Result<(), MqError> {
        publish_once(&self.channel, exchange, routing_key, key, payload, props).await
    }

    /// Closes the connection (if this publisher opened it).
    pub async fn close(self) {
        if let Some(connection) = &self.connection {
            let _ = connection.close(200, "OK".into()).bounded("closing").await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_a_bucket() {
        assert_eq!(bucket_for(Duration::ZERO), None);
        assert_eq!(bucket_for(Duration::from_millis(1)), Some(100));
        assert_eq!(bucket_for(Duration::from_millis(100)), Some(100));
        assert_eq!(bucket_for(Duration::from_millis(101)), Some(250));
        assert_eq!(bucket_for(Duration::from_secs(7)), Some(10_000));
        assert_eq!(bucket_for(Duration::from_secs(86_400)), Some(3_600_000));
    }

    #[test]
    fn details_are_cut_at_a_character_boundary() {
        assert_eq!(cut("abc", 5), "abc");
        assert_eq!(cut("aé", 2), "a");
        assert_eq!(cut("aéb", 3), "aé");
    }
}
