//! The source: its options, its connection, and reconnecting.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeleteOptions,
    QueueDeleteOptions,
};
use lapin::types::{FieldTable, LongString, ShortString};
use lapin::{Connection, ConnectionProperties};
use tokio::time::Instant;

use super::delivery::AmqpDelivery;
use super::link::{Link, open_confirm_channel};
use super::topology::{Topology, short};
use super::{
    Bounded, DEFAULT_PREFETCH, DELAY_BUCKETS_MS, FIRST_BACKOFF, MAX_BACKOFF, QueueType,
    open_channel,
};
use crate::MqError;
use crate::source::{Horizon, Identity, Source};

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
        let setup = open_channel(&connection).await?;
        config.topology.declare(&setup).await?;
        let _ = setup.close(200, "OK".into()).bounded("closing").await;

        let publish = open_confirm_channel(&connection).await?;
        let consume = open_channel(&connection).await?;
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
            link: Arc::new(Link::new(
                connection,
                consume,
                publish,
                config.topology.clone(),
            )),
            consumer,
            tag,
        })
    }
}

/// A RabbitMQ queue as a [`Source`]: connects, declares the topology idem needs, consumes with
/// a prefetch, and reconnects by itself (see the [module docs](super)).
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
                let channel = open_channel(&connection).await?;
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
            let channel = open_channel(&connection).await?;
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

    fn identity(&self) -> Identity<'_> {
        Identity::new("amqp", [self.config.topology.queue.as_str()])
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
