//! `idem relay`: feeds a queue's messages to an HTTP service, once each.
//!
//! Each message's body is POSTed to the target with `Idempotency-Key` set to the message's
//! key. An answer the gateway would store (2xx, and 4xx other than 408, 409 "in progress",
//! 425 and 429) is recorded in the relay's store and the message acked; a redelivery of it
//! is acked without calling the target again. 5xx, 408, 425, 429, a 409 "in progress", a
//! connection that fails and a timeout are retried with backoff (the same key every time, so
//! a target that honours `Idempotency-Key`, such as `idem gateway`, runs the request once),
//! and dead-lettered after the last attempt; a `Retry-After` in seconds sets the delay.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::uri::Scheme;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use idem_http::ProblemCode;
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
    dead_letter_4xx: bool,
}

impl Target {
    /// A target at `url` (`http://host:port/path`), with the defaults: `Content-Type:
    /// application/json`, a 30 s timeout, 4xx answers recorded and acked.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("--to {url:?} is not a URL: {e}"))?;
        if uri.scheme() != Some(&Scheme::HTTP) || uri.authority().is_none() {
            return Err(format!(
                "--to {url:?} must be an http:// URL with a host (put TLS termination in front \
                 of the target)"
            ));
        }
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(Self {
            uri,
            headers,
            timeout: Duration::from_secs(30),
            dead_letter_4xx: false,
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
        let value = HeaderValue::from_str(value.trim())
            .map_err(|_| format!("the value of header {name} is not a valid header value"))?;
        self.headers.insert(name, value);
        Ok(self)
    }

    /// How long a request may take, answer included.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Dead-letter messages the target answers with a stored 4xx, instead of acking them.
    pub fn dead_letter_4xx(mut self, on: bool) -> Self {
        self.dead_letter_4xx = on;
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
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.target.uri.clone());
        if let Some(headers) = req.headers_mut() {
            headers.clone_from(&self.target.headers);
            // Without its key the target could not tell a resend from a new request: a
            // message that has none (or one that is not a header value) is refused, not sent.
            let key = message
                .key
                .as_ref()
                .and_then(|k| HeaderValue::from_str(k.client_key().as_str()).ok())
                .ok_or_else(|| {
                    Failure::Permanent(RelayError(
                        "the message has no key that can be sent as Idempotency-Key".into(),
                    ))
                })?;
            headers.insert("idempotency-key", key);
        }
        let req = req.body(Body::from(message.payload)).map_err(|e| {
            Failure::Permanent(RelayError(format!("cannot build the request: {e}")))
        })?;
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
        if retryable(status, &head.headers, body.as_deref()) {
            let why = RelayError(format!("the target answered {status}"));
            // A delay the target asks for (in seconds; an HTTP date is not followed).
            let after = head
                .headers
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            return Err(match after {
                Some(after) => Failure::RetryAfter(why, after),
                None => Failure::Retry(why),
            });
        }
        if status.is_client_error() && self.target.dead_letter_4xx {
            return Err(Failure::Permanent(RelayError(format!(
                "the target answered {status}"
            ))));
        }
        if status.is_client_error() {
            tracing::warn!(%status, "the target refused a message; its answer is recorded and the message acked");
        }
        Ok(Answer {
            status: status.as_u16(),
        })
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

/// Whether an answer says the request was not processed and may be sent again: the statuses
/// the gateway never stores (5xx, 408, 425, 429), and a 409 whose problem `code` says another
/// attempt with this key is in progress (`idem gateway`'s `request_in_progress`).
fn retryable(status: StatusCode, headers: &HeaderMap, body: Option<&[u8]>) -> bool {
    match status.as_u16() {
        408 | 425 | 429 | 500..=599 => true,
        409 => {
            headers.contains_key(RETRY_AFTER)
                || body
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
                    .and_then(|v| v.get("code")?.as_str().map(str::to_owned))
                    .is_some_and(|code| code == ProblemCode::RequestInProgress.as_str())
        }
        _ => false,
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
}

impl Broker {
    /// Reads `--from` with `--queue`, or with `--stream` and `--consumer`.
    pub fn parse(
        url: &str,
        queue: Option<&str>,
        stream: Option<&str>,
        consumer: Option<&str>,
        subject: Option<&str>,
    ) -> Result<Self, String> {
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        match scheme {
            "amqp" | "amqps" => {
                let queue = queue.ok_or("--from amqp://… needs --queue NAME")?;
                if stream.is_some() || consumer.is_some() || subject.is_some() {
                    return Err(
                        "--stream, --consumer and --subject are for nats://; use --queue".into(),
                    );
                }
                Ok(Broker::Amqp {
                    url: url.to_owned(),
                    queue: queue.to_owned(),
                })
            }
            "nats" => {
                let stream = stream.ok_or("--from nats://… needs --stream NAME")?;
                if queue.is_some() {
                    return Err("--queue is for amqp://; use --stream and --consumer".into());
                }
                Ok(Broker::Nats {
                    url: url.to_owned(),
                    stream: stream.to_owned(),
                    consumer: consumer.unwrap_or("idem-relay").to_owned(),
                    subject: subject.map(str::to_owned),
                })
            }
            _ => Err(format!(
                "--from must be an amqp://, amqps:// or nats:// URL, not {:?}",
                idem_store::redact(url)
            )),
        }
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
            Some("orders"),
            None,
            None,
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(!amqp.display().contains("secret"), "{}", amqp.display());
        assert!(Broker::parse("amqp://h/", None, None, None, None).is_err());
        assert!(Broker::parse("amqp://h/", Some("q"), Some("s"), None, None).is_err());
        assert!(Broker::parse("amqp://h/", Some("q"), None, None, Some("a.>")).is_err());
        let nats = Broker::parse("nats://127.0.0.1:4222", None, Some("ORDERS"), None, None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(nats, Broker::Nats { ref consumer, .. } if consumer == "idem-relay"));
        assert!(Broker::parse("nats://h", Some("q"), Some("S"), None, None).is_err());
        let err = Broker::parse("kafka://u:pw@h", Some("q"), None, None, None).unwrap_err();
        assert!(!err.contains("pw"), "{err}");
    }
}
