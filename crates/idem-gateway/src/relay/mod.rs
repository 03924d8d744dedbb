//! `idem relay`: feeds a queue's messages to an HTTP service, once each.
//!
//! Each message's body is POSTed to the target with `Idempotency-Key` set to the message's
//! key, written so that the target reads back exactly that key ([`idem_http::encode_key`]).
//! What follows each answer is `answer::verdict`: a message is acked only when the target
//! took it; an answer that says it was not processed is retried with the same key (so a
//! target that honours `Idempotency-Key`, such as `idem gateway`, runs it once); an answer
//! that says its effect did not happen, or may not have (an unknown outcome, a relay or
//! target that is misconfigured), dead-letters it with the answer, and records nothing.

mod answer;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::uri::Scheme;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use idem_mq::{Failure, Handler, Message};
use serde::{Deserialize, Serialize};

/// The scope `idem relay` keeps its records under.
pub const SCOPE: &str = "relay";

/// The most of an answer's body the relay reads (to find a problem's `code`); the rest is
/// dropped with the connection.
const MAX_ANSWER_BODY: usize = 64 * 1024;

/// Where and how the relay delivers messages.
#[derive(Debug, Clone)]
pub struct Target {
    uri: Uri,
    headers: HeaderMap,
    timeout: Duration,
    ack_4xx: bool,
}

impl Target {
    /// A target at `url` (`http://host:port/path`), with the defaults: `Content-Type:
    /// application/json`, a 30 s timeout, 4xx answers dead-lettered. Errors show the URL
    /// through [`idem_store::redact`].
    pub fn parse(url: &str) -> Result<Self, String> {
        let shown = idem_store::redact(url);
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("--to {shown:?} is not a URL: {e}"))?;
        if uri.scheme() != Some(&Scheme::HTTP) || uri.authority().is_none() {
            return Err(format!(
                "--to {shown:?} must be an http:// URL with a host (put TLS termination in \
                 front of the target)"
            ));
        }
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(Self {
            uri,
            headers,
            timeout: Duration::from_secs(30),
            ack_4xx: false,
        })
    }

    /// Sets a header on every request (`Content-Type` replaces the default). Refuses
    /// `Idempotency-Key`, which the relay sets itself, and names or values HTTP does not allow.
    pub fn header(mut self, name: &str, value: &str) -> Result<Self, String> {
        let name: HeaderName = name
            .trim()
            .parse()
            .map_err(|_| format!("{name:?} is not a header name"))?;
        if name.as_str() == "idempotency-key" {
            return Err("the relay sets Idempotency-Key itself, from the message's key".into());
        }
        let mut value = HeaderValue::from_str(value.trim())
            .map_err(|_| format!("the value of header {name} is not a valid header value"))?;
        // It may be a credential (`Authorization`): kept out of `Debug` output.
        value.set_sensitive(true);
        self.headers.insert(name, value);
        Ok(self)
    }

    /// How long a request may take, answer included.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Record and ack messages the target answers with a 4xx that is a business answer (a
    /// refused order), instead of dead-lettering them (the default). Answers that say the
    /// relay or target is misconfigured, the gateway's key errors and unknown outcomes are
    /// dead-lettered either way.
    pub fn ack_4xx(mut self, on: bool) -> Self {
        self.ack_4xx = on;
        self
    }
}

/// What the relay records of a delivered message: the target's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// The HTTP status the target answered.
    pub status: u16,
}

/// Why a delivery failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayError(pub String);

impl fmt::Display for RelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The relay's handler: one POST per message.
#[derive(Clone)]
pub struct Relay {
    target: Arc<Target>,
    client: crate::gateway::proxy::UpstreamClient,
}

impl Relay {
    /// A relay to `target`.
    pub fn new(target: Target) -> Self {
        Self {
            client: crate::gateway::proxy::client(target.timeout),
            target: Arc::new(target),
        }
    }

    async fn post(&self, message: Message) -> Result<Answer, Failure<RelayError>> {
        let retry = |why: String| Failure::Retry(RelayError(why));
        let refuse = |why: String| Failure::DeadLetter(RelayError(why));
        // Without its key the target could not tell a resend from a new request: a message
        // whose key cannot be sent is dead-lettered, not sent.
        let key = match &message.key {
            Some(key) => idem_http::encode_key(key.client_key().as_str())
                .map_err(|e| refuse(format!("its key cannot be sent as Idempotency-Key: {e}")))?,
            None => return Err(refuse("the message has no key".into())),
        };
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.target.uri.clone());
        if let Some(headers) = req.headers_mut() {
            headers.clone_from(&self.target.headers);
            headers.insert(idem_http::IDEMPOTENCY_KEY, key);
            // The attempt's fence, as the gateway sends it, for a target that refuses an
            // attempt overtaken by a later one.
            if let Some(lease) = message.lease {
                headers.insert(
                    idem_http::FENCE_HEADER,
                    axum::http::HeaderValue::from(lease.fence),
                );
            }
        }
        let req = req
            .body(Body::from(message.payload))
            .map_err(|e| refuse(format!("cannot build the request: {e}")))?;
        let sent = tokio::time::timeout(self.target.timeout, async {
            let res = self.client.request(req).await?;
            let (head, body) = res.into_parts();
            // The body, if it fits and arrives whole: only a problem's `code` is read from it.
            let body = axum::body::to_bytes(Body::new(body), MAX_ANSWER_BODY)
                .await
                .ok();
            Ok::<_, hyper_util::client::legacy::Error>((head, body))
        })
        .await;
        let (head, body) = match sent {
            Err(_) => {
                metrics::counter!("idem_relay_requests_total", "result" => "timeout").increment(1);
                return Err(retry(format!(
                    "the target did not answer within {:?}",
                    self.target.timeout
                )));
            }
            Ok(Err(e)) => {
                let result = if e.is_connect() {
                    "unreachable"
                } else {
                    "failed"
                };
                metrics::counter!("idem_relay_requests_total", "result" => result).increment(1);
                return Err(retry(format!("the request to the target failed: {e}")));
            }
            Ok(Ok(answer)) => answer,
        };
        let status = head.status;
        metrics::counter!("idem_relay_requests_total", "result" => status_class(status))
            .increment(1);
        let problem = body
            .as_deref()
            .map_or_else(idem_wire::Problem::default, idem_wire::Problem::from_json);
        let code = problem.code.clone();
        // The answer, as the dead letter and the log carry it: the status and the problem
        // code, never the body.
        let answered = match &code {
            Some(code) => format!("the target answered {status} ({code})"),
            None => format!("the target answered {status}"),
        };
        match answer::verdict(status, &head.headers, &problem, self.target.ack_4xx) {
            answer::Verdict::Delivered => {
                if status.is_client_error() {
                    tracing::info!(%status, code = code.as_deref(), "the target refused a message with a business answer; recorded and acked");
                }
                Ok(Answer {
                    status: status.as_u16(),
                })
            }
            answer::Verdict::Retry(None) => Err(retry(answered)),
            answer::Verdict::Retry(Some(after)) => {
                Err(Failure::RetryAfter(RelayError(answered), after))
            }
            answer::Verdict::DeadLetter(why) => {
                tracing::warn!(%status, code = code.as_deref(), "{why}; the message is dead-lettered");
                Err(refuse(format!("{answered}: {why}")))
            }
        }
    }
}

impl Handler for Relay {
    type Output = Answer;
    type Error = RelayError;

    fn handle(
        &self,
        message: Message,
    ) -> impl Future<Output = Result<Answer, Failure<RelayError>>> + Send {
        self.post(message)
    }
}

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// Logs the consumer's counts every `every` until dropped: what an operator watching the
/// relay's output sees (the same counts are metrics).
pub async fn status_line<S, C>(consumer: idem_mq::Consumer<S, C>, every: Duration)
where
    S: idem_core::Store + Clone,
    C: idem_core::Clock + Clone,
{
    let mut last = consumer.counts();
    loop {
        tokio::time::sleep(every).await;
        let now = consumer.counts();
        if now != last {
            tracing::info!(
                received = now.received,
                delivered = now.handled,
                replayed = now.replayed,
                requeued = now.requeued,
                dead_lettered = now.dead_lettered,
                unsettled = now.unsettled,
                "relay status"
            );
            last = now;
        }
    }
}

/// Where the relay takes messages from.
#[derive(Debug, Clone)]
pub enum Broker {
    /// A RabbitMQ queue (`amqp://` or `amqps://`).
    Amqp {
        /// The broker's URL.
        url: String,
        /// The queue.
        queue: String,
    },
    /// A durable JetStream consumer of a stream (`nats://`).
    Nats {
        /// The server's URL.
        url: String,
        /// The stream.
        stream: String,
        /// The durable consumer (created if missing).
        consumer: String,
        /// The subjects it takes, for a consumer the relay creates (default: all the
        /// stream's).
        subject: Option<String>,
    },
    /// A Redis stream's consumer group (`redis://`, `redis+cluster://`).
    Redis {
        /// The server's URL.
        url: String,
        /// The stream.
        stream: String,
        /// The consumer group (created if missing).
        group: String,
        /// The relay's consumer name in the group (default: one per process).
        consumer: Option<String>,
        /// How long an entry stays pending without progress before another relay claims it.
        claim_idle: Duration,
    },
    /// A Kafka consumer group on a topic (`kafka://host:port[,host:port…]`).
    Kafka {
        /// The bootstrap brokers, `host:port,…`.
        brokers: String,
        /// The topic.
        topic: String,
        /// The consumer group.
        group: String,
        /// librdkafka properties (`--kafka-config KEY=VALUE`): TLS, SASL, timeouts.
        config: Vec<(String, String)>,
    },
}

/// What `--from` is read with: the flags that name what to consume.
#[derive(Debug, Clone, Copy, Default)]
pub struct Names<'a> {
    /// `--queue` (RabbitMQ).
    pub queue: Option<&'a str>,
    /// `--stream` (NATS JetStream, Redis).
    pub stream: Option<&'a str>,
    /// `--consumer`: the durable consumer (NATS), or the consumer name in the group (Redis).
    pub consumer: Option<&'a str>,
    /// `--subject` (NATS).
    pub subject: Option<&'a str>,
    /// `--group` (Redis, Kafka).
    pub group: Option<&'a str>,
    /// `--topic` (Kafka).
    pub topic: Option<&'a str>,
}

/// The relay's durable consumer (NATS) or consumer group (Redis) unless named.
const DEFAULT_CONSUMER: &str = "idem-relay";

impl Broker {
    /// Reads `--from` with `--queue`; `--stream` and `--consumer`; or `--stream` and
    /// `--group`.
    pub fn parse(url: &str, names: Names<'_>) -> Result<Self, String> {
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        let only = |allowed: &[&str], scheme: &str| -> Result<(), String> {
            let given = [
                ("--queue", names.queue),
                ("--stream", names.stream),
                ("--consumer", names.consumer),
                ("--subject", names.subject),
                ("--group", names.group),
                ("--topic", names.topic),
            ];
            match given
                .iter()
                .find(|(flag, value)| value.is_some() && !allowed.contains(flag))
            {
                Some((flag, _)) => Err(format!(
                    "{flag} is not for {scheme}:// (use {})",
                    allowed.join(", ")
                )),
                None => Ok(()),
            }
        };
        match scheme {
            "amqp" | "amqps" => {
                let queue = names.queue.ok_or("--from amqp://… needs --queue NAME")?;
                only(&["--queue"], scheme)?;
                Ok(Broker::Amqp {
                    url: url.to_owned(),
                    queue: queue.to_owned(),
                })
            }
            "nats" => {
                let stream = names.stream.ok_or("--from nats://… needs --stream NAME")?;
                only(&["--stream", "--consumer", "--subject"], scheme)?;
                Ok(Broker::Nats {
                    url: url.to_owned(),
                    stream: stream.to_owned(),
                    consumer: names.consumer.unwrap_or(DEFAULT_CONSUMER).to_owned(),
                    subject: names.subject.map(str::to_owned),
                })
            }
            "redis" | "redis+cluster" => {
                let stream = names.stream.ok_or("--from redis://… needs --stream NAME")?;
                only(&["--stream", "--group", "--consumer"], scheme)?;
                Ok(Broker::Redis {
                    url: url.to_owned(),
                    stream: stream.to_owned(),
                    group: names.group.unwrap_or(DEFAULT_CONSUMER).to_owned(),
                    consumer: names.consumer.map(str::to_owned),
                    claim_idle: Duration::from_secs(120),
                })
            }
            "kafka" if !cfg!(feature = "kafka") => {
                Err("this idem was built without Kafka (build it with --features kafka)".to_owned())
            }
            "kafka" => {
                let topic = names.topic.ok_or("--from kafka://… needs --topic NAME")?;
                only(&["--topic", "--group"], scheme)?;
                let brokers = url["kafka://".len()..].trim_end_matches('/');
                if brokers.is_empty() || brokers.contains(['@', '/', '?']) {
                    return Err(format!(
                        "--from kafka:// takes host:port[,host:port…] and nothing else, not {:?}",
                        idem_store::redact(url)
                    ));
                }
                Ok(Broker::Kafka {
                    brokers: brokers.to_owned(),
                    topic: topic.to_owned(),
                    group: names.group.unwrap_or(DEFAULT_CONSUMER).to_owned(),
                    config: Vec::new(),
                })
            }
            _ => Err(format!(
                "--from must be an amqp://, amqps://, nats://, redis://, redis+cluster:// or \
                 kafka:// URL, not {:?}",
                idem_store::redact(url)
            )),
        }
    }

    /// Ties what the broker waits for to the records' lease: a Redis stream's pending entry
    /// is claimed by another relay after twice the lease without progress (the relay reports
    /// progress well within it while a POST runs).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        if let Broker::Redis { claim_idle, .. } = &mut self {
            *claim_idle = lease.saturating_mul(2);
        }
        self
    }

    /// Sets librdkafka properties of a Kafka source, each `KEY=VALUE` (`security.protocol=SSL`,
    /// `session.timeout.ms=10000`); refused for another broker, or when one is not `KEY=VALUE`.
    pub fn with_kafka_config(mut self, properties: &[String]) -> Result<Self, String> {
        if properties.is_empty() {
            return Ok(self);
        }
        let Broker::Kafka { config, .. } = &mut self else {
            return Err("--kafka-config is for --from kafka:// only".to_owned());
        };
        for property in properties {
            let Some((key, value)) = property.split_once('=') else {
                return Err(format!(
                    "--kafka-config takes KEY=VALUE (a librdkafka property), not {property:?}"
                ));
            };
            config.push((key.trim().to_owned(), value.trim().to_owned()));
        }
        Ok(self)
    }

    /// The broker's URL with any password hidden, for messages.
    pub fn display(&self) -> String {
        match self {
            Broker::Amqp { url, queue } => format!("{} queue {queue}", idem_store::redact(url)),
            Broker::Nats {
                url,
                stream,
                consumer,
                ..
            } => format!(
                "{} stream {stream} consumer {consumer}",
                idem_store::redact(url)
            ),
            Broker::Redis {
                url, stream, group, ..
            } => format!("{} stream {stream} group {group}", idem_store::redact(url)),
            Broker::Kafka {
                brokers,
                topic,
                group,
                ..
            } => format!("kafka://{brokers} topic {topic} group {group}"),
        }
    }

    /// Connects to the broker and relays until `shutdown` completes: up to `prefetch`
    /// messages at once.
    pub async fn relay<S, C>(
        &self,
        consumer: &idem_mq::Consumer<S, C>,
        relay: Relay,
        prefetch: u16,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), idem_mq::MqError>
    where
        S: idem_core::Store + Clone,
        C: idem_core::Clock + Clone,
    {
        let consumer = consumer.clone().concurrency(usize::from(prefetch));
        match self {
            Broker::Amqp { url, queue } => {
                let source = idem_mq::amqp::AmqpSource::builder(url.clone(), queue.clone())
                    .prefetch(prefetch)
                    .connection_name("idem relay")
                    .connect()
                    .await?;
                consumer.run(source, relay, shutdown).await
            }
            Broker::Nats {
                url,
                stream,
                consumer: name,
                subject,
            } => {
                let mut builder = idem_mq::nats::NatsSource::builder(stream.clone(), name.clone())
                    .batch(usize::from(prefetch));
                if let Some(subject) = subject {
                    builder = builder.filter_subject(subject.clone());
                }
                let source = builder.connect(url).await?;
                consumer.run(source, relay, shutdown).await
            }
            Broker::Redis {
                url,
                stream,
                group,
                consumer: name,
                claim_idle,
            } => {
                let mut builder = idem_mq::redis_streams::RedisStreamSource::builder(stream, group)
                    .batch(usize::from(prefetch))
                    .claim_idle(*claim_idle);
                if let Some(name) = name {
                    builder = builder.consumer(name.clone());
                }
                let source = builder.connect(url).await?;
                consumer.run(source, relay, shutdown).await
            }
            #[cfg(feature = "kafka")]
            Broker::Kafka {
                brokers,
                topic,
                group,
                config,
            } => {
                let mut builder = idem_mq::kafka::KafkaSource::builder(brokers, group, topic)
                    .max_held(usize::from(prefetch));
                for (key, value) in config {
                    builder = builder.set(key, value);
                }
                let source = builder.connect().await?;
                consumer.run(source, relay, shutdown).await
            }
            #[cfg(not(feature = "kafka"))]
            Broker::Kafka { .. } => Err(idem_mq::MqError::Config(
                "this idem was built without Kafka (build it with --features kafka)".to_owned(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_read_from_the_flags_and_passwords_never_shown() {
        let amqp = Broker::parse(
            "amqp://guest:secret@127.0.0.1:5672/%2f",
            Names {
                queue: Some("orders"),
                ..Names::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(!amqp.display().contains("secret"), "{}", amqp.display());
        let queue = |q| Names {
            queue: Some(q),
            ..Names::default()
        };
        let stream = |s| Names {
            stream: Some(s),
            ..Names::default()
        };
        assert!(Broker::parse("amqp://h/", Names::default()).is_err());
        let with = |names: Names<'static>, f: fn(&mut Names<'static>)| {
            let mut names = names;
            f(&mut names);
            names
        };
        assert!(Broker::parse("amqp://h/", with(queue("q"), |n| n.stream = Some("s"))).is_err());
        assert!(Broker::parse("amqp://h/", with(queue("q"), |n| n.subject = Some("a.>"))).is_err());
        let nats = Broker::parse("nats://127.0.0.1:4222", stream("ORDERS"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(nats, Broker::Nats { ref consumer, .. } if consumer == "idem-relay"));
        assert!(Broker::parse("nats://h", with(stream("S"), |n| n.queue = Some("q"))).is_err());
        assert!(Broker::parse("nats://h", with(stream("S"), |n| n.group = Some("g"))).is_err());
        let redis = Broker::parse("redis://:pw@127.0.0.1:6379", stream("orders"))
            .unwrap_or_else(|e| panic!("{e}"))
            .with_lease(Duration::from_secs(5));
        assert!(matches!(
            redis,
            Broker::Redis { ref group, claim_idle, consumer: None, .. }
                if group == "idem-relay" && claim_idle == Duration::from_secs(10)
        ));
        assert!(!redis.display().contains("pw"), "{}", redis.display());
        assert!(Broker::parse("redis://h", Names::default()).is_err());
        assert!(Broker::parse("redis://h", with(stream("s"), |n| n.subject = Some("x"))).is_err());
        let cluster = Broker::parse(
            "redis+cluster://h1:7000,h2:7001",
            with(stream("s"), |n| {
                n.group = Some("g");
                n.consumer = Some("relay-1");
            }),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            matches!(cluster, Broker::Redis { ref consumer, .. } if consumer.as_deref() == Some("relay-1"))
        );
        let err = Broker::parse("kafka://u:pw@h", queue("q")).unwrap_err();
        assert!(!err.contains("pw"), "{err}");
        #[cfg(feature = "kafka")]
        {
            let topic = |t| Names {
                topic: Some(t),
                ..Names::default()
            };
            let kafka = Broker::parse("kafka://127.0.0.1:9092,h2:9093/", topic("orders"))
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(matches!(
                kafka,
                Broker::Kafka { ref brokers, ref group, ref topic, .. }
                    if brokers == "127.0.0.1:9092,h2:9093" && group == "idem-relay" && topic == "orders"
            ));
            assert!(Broker::parse("kafka://h:9092", Names::default()).is_err());
            assert!(
                Broker::parse("kafka://h:9092", with(topic("t"), |n| n.stream = Some("s")))
                    .is_err()
            );
            let err = Broker::parse("kafka://u:pw@h:9092", topic("t")).unwrap_err();
            assert!(!err.contains("pw"), "{err}");
        }
    }
}
