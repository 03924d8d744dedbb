//! `idem relay`: a queue's messages to an HTTP service, once each.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem_core::SystemClock;
use idem_gateway::listener::{self, Limits};
use tracing::info;

use super::listen::shutdown_signal;
use super::parse::{parse_lease, parse_purge_interval, parse_ttl, parse_upstream_timeout};
use super::{open_store, with_causes};

#[derive(clap::Args)]
pub(crate) struct RelayArgs {
    /// The broker: amqp://user:password@host:5672/vhost (RabbitMQ), nats://host:4222 (NATS
    /// JetStream), redis://host:6379 or redis+cluster://host:port,host:port (Redis Streams),
    /// kafka://host:9092[,host:port…] (Kafka, in a build with the kafka feature).
    #[arg(long, env = "IDEM_RELAY_FROM", value_name = "URL")]
    from: String,

    /// The queue to consume (RabbitMQ). Declared if missing, with a dead-letter queue
    /// NAME.dead beside it.
    #[arg(long, env = "IDEM_RELAY_QUEUE", value_name = "NAME")]
    queue: Option<String>,

    /// The stream to consume. NATS JetStream: dead letters are copied to the subject
    /// STREAM.dead, which a stream must store (the relay checks at start). Redis: dead letters
    /// are added to the stream STREAM:dead.
    #[arg(long, env = "IDEM_RELAY_STREAM", value_name = "NAME")]
    stream: Option<String>,

    /// The durable JetStream consumer (created if missing) [default: idem-relay]; on Redis,
    /// the relay's consumer name in the group [default: one per process].
    #[arg(long, env = "IDEM_RELAY_CONSUMER", value_name = "NAME")]
    consumer: Option<String>,

    /// The consumer group: a Redis stream's (created if missing, reading from the stream's
    /// first entry), or Kafka's (a new group starts at the topic's first record)
    /// [default: idem-relay].
    #[arg(long, env = "IDEM_RELAY_GROUP", value_name = "NAME")]
    group: Option<String>,

    /// Only the stream's messages on this subject (wildcards allowed), for a JetStream
    /// consumer the relay creates.
    #[arg(long, env = "IDEM_RELAY_SUBJECT", value_name = "SUBJECT")]
    subject: Option<String>,

    /// The Kafka topic to consume. Dead letters are produced to TOPIC.dead.
    #[arg(long, env = "IDEM_RELAY_TOPIC", value_name = "NAME")]
    topic: Option<String>,

    /// A librdkafka property of the Kafka consumer, as KEY=VALUE (repeatable):
    /// security.protocol=SASL_SSL, sasl.mechanism=…, session.timeout.ms=10000.
    #[arg(long, value_name = "KEY=VALUE")]
    kafka_config: Vec<String>,

    /// Where each message is POSTed: an http:// URL.
    #[arg(long, env = "IDEM_RELAY_TO", value_name = "URL")]
    to: String,

    /// Where the relay records which messages got an answer: sqlite://PATH (the embedded
    /// default), postgres://…, mysql://…, redis://… (see docs/stores.md).
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem-relay.db")]
    store: String,

    /// Take the key from this message header (a field of a Redis stream's entry) instead of
    /// the message id.
    #[arg(long, value_name = "NAME", conflicts_with = "key_json")]
    key_header: Option<String>,

    /// Take the key from this JSON pointer into the payload (e.g. /order/id).
    #[arg(long, value_name = "POINTER", value_parser = parse_json_pointer)]
    key_json: Option<String>,

    /// The records' namespace [default: the broker's kind and names, each escaped:
    /// amqp:QUEUE, nats:STREAM:CONSUMER, redis:STREAM:GROUP or kafka:GROUP:TOPIC]. Relays given one namespace
    /// share records.
    #[arg(long)]
    namespace: Option<String>,

    /// Do not fingerprint payloads: a key met again with another payload is then acked on the
    /// first payload's answer, instead of dead-lettered as `mismatch`.
    #[arg(long)]
    no_payload_fingerprint: bool,

    /// The Content-Type of each POST.
    #[arg(long, default_value = "application/json")]
    content_type: String,

    /// An extra header on each POST, as "Name: value" (repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE")]
    headers: Vec<String>,

    /// How long a POST may take, answer included.
    #[arg(long, default_value = "30s", value_parser = parse_upstream_timeout)]
    timeout: Duration,

    /// POSTs of a message (failed in a retryable way, or cut off by a relay that died) before
    /// it is dead-lettered.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=999))]
    max_attempts: u32,

    /// Messages in flight at once (the broker's prefetch, and POSTs at once).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,

    /// How long a message's key is held for a relay that stops answering (killed, cut off)
    /// before another may POST it again; renewed while a POST runs.
    #[arg(long, default_value = "60s", value_parser = parse_lease)]
    lease: Duration,

    /// How long an answer is remembered; a message redelivered later is POSTed again.
    #[arg(long, default_value = "24h", value_parser = parse_ttl)]
    ttl: Duration,

    /// Record and ack messages the target refuses with a 4xx that is a business answer (a
    /// refused order), instead of dead-lettering them. Answers that mean the relay or target
    /// is misconfigured (401, 403, 404, 405, 407, 413, 415, the gateway's key errors) and
    /// unknown outcomes are dead-lettered either way.
    #[arg(long)]
    ack_4xx: bool,

    /// Dead-letter messages the target refuses with a 4xx: the default, accepted for scripts
    /// written before it was.
    #[arg(long, hide = true, conflicts_with = "ack_4xx")]
    dead_letter_4xx: bool,

    /// Serve /metrics (Prometheus text) and /healthz on this address.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,

    /// How often to log a status line with the counts (when they changed).
    #[arg(long, default_value = "30s", value_parser = parse_purge_interval)]
    status_every: Duration,
}

/// `--key-json`: an RFC 6901 pointer, checked by the rule the consumer applies at start.
fn parse_json_pointer(pointer: &str) -> Result<String, String> {
    idem_mq::KeyFrom::JsonPointer(pointer.to_owned()).check()?;
    Ok(pointer.to_owned())
}

pub(crate) async fn relay(args: RelayArgs) -> Result<(), String> {
    use idem_gateway::relay;
    let from = relay::Broker::parse(
        &args.from,
        relay::Names {
            queue: args.queue.as_deref(),
            stream: args.stream.as_deref(),
            consumer: args.consumer.as_deref(),
            subject: args.subject.as_deref(),
            group: args.group.as_deref(),
            topic: args.topic.as_deref(),
        },
    )?
    .with_lease(args.lease)
    .with_kafka_config(&args.kafka_config)?;
    let mut target = relay::Target::parse(&args.to)?
        .timeout(args.timeout)
        .ack_4xx(args.ack_4xx && !args.dead_letter_4xx)
        .header("content-type", &args.content_type)?;
    for h in &args.headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("--header {h:?} must be \"Name: value\""))?;
        target = target.header(name, value)?;
    }
    let store = open_store(&args.store).await?;
    let mut consumer = idem_mq::Consumer::new(store.clone())
        .scope(idem_gateway::relay::SCOPE)
        .max_attempts(args.max_attempts)
        .lease(args.lease)
        .ttl(args.ttl)
        .fingerprint_payload(!args.no_payload_fingerprint);
    if let Some(name) = &args.key_header {
        consumer = consumer.key(idem_mq::KeyFrom::Header(name.clone()));
    }
    if let Some(pointer) = &args.key_json {
        consumer = consumer.key(idem_mq::KeyFrom::JsonPointer(pointer.clone()));
    }
    if let Some(ns) = &args.namespace {
        consumer = consumer.namespace(ns.clone());
    }
    if let Some(addr) = args.metrics_listen {
        // The recorder first: descriptions sent before it is installed are lost.
        idem_ops::metrics::Registry::global();
        idem_mq::describe_metrics();
        metrics::describe_counter!(
            "idem_relay_requests_total",
            "POSTs to the target, by result (2xx, 3xx, 4xx, 5xx, timeout, unreachable, failed)."
        );
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let addr = listener.local_addr().unwrap_or(addr);
        let registry = idem_ops::metrics::Registry::global();
        let app = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(move || std::future::ready(registry.response())),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        // The same connection limits as `serve` and `gateway`; it ends with the process.
        tokio::spawn(listener::serve(
            listener,
            app,
            Limits::new("/healthz"),
            std::future::pending(),
        ));
        info!("metrics on http://{addr}/metrics");
    }
    tokio::spawn(idem::purge::purge_loop(
        store,
        Arc::new(SystemClock),
        Duration::from_secs(60),
    ));
    let status = tokio::spawn(relay::status_line(consumer.clone(), args.status_every));
    info!(from = %from.display(), to = %idem_store::redact(&args.to), "relaying");
    let ran = from
        .relay(
            &consumer,
            relay::Relay::new(target),
            args.prefetch,
            shutdown_signal(),
        )
        .await;
    status.abort();
    let c = consumer.counts();
    info!(
        delivered = c.handled,
        replayed = c.replayed,
        requeued = c.requeued,
        dead_lettered = c.dead_lettered,
        "relay stopped"
    );
    ran.map_err(|e| with_causes(&e))
}
