//! What a broker adapter provides: a [`Source`] of [`Delivery`]s, and for each delivery a way
//! to tell the broker what became of it ([`Disposition`]).
//!
//! The consumer ([`crate::Consumer`]) is written once against these traits; the AMQP and NATS
//! adapters, and the in-process [`crate::memory`] queue used in tests, implement them.

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::future::Future;
use std::time::Duration;

use idem_core::key::MAX_NAMESPACE_LEN;
use idem_core::{Fingerprint, Namespace};

use crate::MqError;

/// One delivery of a message, held until it is settled.
///
/// A delivery is settled exactly once, by [`Delivery::settle`]; an adapter whose delivery is
/// dropped unsettled (the consumer's task was cancelled) leaves it to the broker, which
/// redelivers it when the channel closes or its ack timer fires.
pub trait Delivery: Send + Sync + 'static {
    /// The message id the publisher set (AMQP `message_id`; the `Nats-Msg-Id` header).
    fn message_id(&self) -> Option<&str>;

    /// The value of header `name`, as text (`None` if absent or not representable as text).
    fn header(&self, name: &str) -> Option<Cow<'_, str>>;

    /// The message body.
    fn payload(&self) -> &[u8];

    /// How many times the broker has delivered this message, this delivery included (1 on the
    /// first), when the broker counts (JetStream's `num_delivered`; a quorum queue's
    /// `x-delivery-count` plus one; an adapter's own attempt header). `None` when it does not:
    /// then only the consumer's own requeues are counted.
    fn delivery_count(&self) -> Option<u32>;

    /// Tells the broker the message is still being worked on, so that its redelivery timer
    /// starts again (JetStream `+WPI`). A no-op where the broker has no such timer.
    fn in_progress(&self) -> impl Future<Output = Result<(), MqError>> + Send;

    /// Settles the delivery: ack it, requeue it after a delay, or dead-letter it.
    fn settle(self, how: Disposition) -> impl Future<Output = Result<(), MqError>> + Send;
}

/// Where deliveries come from: a queue, or a durable JetStream consumer.
pub trait Source: Send + 'static {
    /// The deliveries this source hands out.
    type Delivery: Delivery;

    /// The source's name, as logs and the status line show it (a queue's name;
    /// `<stream>.<consumer>` on JetStream; `<stream>.<group>` on Redis).
    fn name(&self) -> &str;

    /// What picks this source out among every source whose records may share a store: the
    /// broker's kind and the names that find it there (what competing consumers share and
    /// nobody else). The records' default namespace is made from it
    /// ([`Identity::namespace`]), so two sources never share records unless they are given
    /// one namespace. By default the kind `source` and [`Source::name`].
    fn identity(&self) -> Identity<'_> {
        Identity::new("source", [self.name()])
    }

    /// The next delivery; `None` once the source is closed for good. A source reconnects by
    /// itself after the broker restarts; an `Err` is reported (logged and counted) and the
    /// consumer asks again.
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Delivery, MqError>>> + Send;

    /// How long the broker waits for an ack before it redelivers, if it has such a timer
    /// (JetStream's `ack_wait`). The consumer reports progress at a third of it while a
    /// handler runs.
    fn ack_wait(&self) -> Option<Duration> {
        None
    }

    /// How long after its first delivery the broker may still deliver a message again. A
    /// record must be kept at least this long, or a late redelivery would run its work again;
    /// the consumer refuses to start with a shorter TTL.
    fn redelivery_horizon(&self) -> Horizon {
        Horizon::Unknown
    }

    /// Stops taking new messages (graceful shutdown). Deliveries already handed out can still
    /// be settled.
    fn close(&mut self) -> impl Future<Output = ()> + Send;
}

/// What picks a source out among all the sources that may share a store: the broker's kind
/// (`amqp`, `nats`, `redis`) and its names there (the queue; the stream and the durable
/// consumer; the stream and the group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity<'a> {
    kind: &'static str,
    parts: Vec<&'a str>,
}

impl<'a> Identity<'a> {
    /// The identity of a source of broker `kind` named by `parts`, in order.
    pub fn new(kind: &'static str, parts: impl IntoIterator<Item = &'a str>) -> Self {
        Self {
            kind,
            parts: parts.into_iter().collect(),
        }
    }

    /// The default namespace of the source's records: `kind:part:part`, the kind and each
    /// part with every byte outside `A-Z a-z 0-9 . -` written `_XX` (its hex), `_` included.
    /// No two identities give one namespace: an escaped part never holds a `:`, so the text is
    /// read back one way (`X.eu` with group `x` is `redis:X.eu:x`, `X` with group `eu.x` is
    /// `redis:X:eu.x`). One longer than a namespace may be (128 bytes) is `_sha256_` and the
    /// SHA-256 of that text in hex, a form no escaped kind begins with.
    pub fn namespace(&self) -> Namespace {
        let mut text = String::new();
        escape(self.kind, &mut text);
        for part in &self.parts {
            text.push(':');
            escape(part, &mut text);
        }
        if text.len() > MAX_NAMESPACE_LEN {
            text = format!(
                "_sha256_{}",
                Fingerprint::of_bytes(text.as_bytes()).to_hex()
            );
        }
        Namespace::new(text).expect("an escaped identity is a valid namespace")
    }
}

/// Appends `part` to `out`, every byte outside `A-Z a-z 0-9 . -` written `_XX`.
fn escape(part: &str, out: &mut String) {
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-') {
            out.push(char::from(b));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "_{b:02X}");
        }
    }
}

/// How long a broker may redeliver a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Horizon {
    /// At most this long after the first delivery.
    Bounded(Duration),
    /// Without a bound (unlimited redeliveries): records are then kept for their TTL, and a
    /// message redelivered after that runs again. Logged at start.
    Unbounded,
    /// The adapter cannot tell.
    Unknown,
}

/// What becomes of a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Done with: the broker forgets the message.
    Ack,
    /// Deliver it again, not before `delay` (AMQP: a delay queue or a timed requeue; NATS:
    /// `nak` with a delay).
    Requeue {
        /// How long to wait before the next delivery.
        delay: Duration,
    },
    /// Give up on it: to the dead letter (AMQP: the queue's dead-letter exchange; NATS:
    /// `term`), with the reason.
    DeadLetter(DeadLetter),
}

/// Why a message went to the dead letter, with a stable code for machines and a sentence for
/// people. Neither holds the key or the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Why.
    pub reason: Reason,
    /// The sentence: for [`Reason::Permanent`] and [`Reason::Refused`] the handler's error as
    /// text, else a description of the reason.
    pub detail: String,
}

/// The reasons a message is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// It carries no key where the consumer looks for one.
    NoKey,
    /// Its key is not a valid key (empty, too long, characters outside visible ASCII).
    InvalidKey,
    /// Its key was used before with another payload (payload fingerprints on).
    Mismatch,
    /// The handler failed permanently (now, or in an earlier delivery whose failure is stored).
    Permanent,
    /// The handler dead-lettered it without storing a failure ([`Failure::DeadLetter`]):
    /// moved back to the queue, it runs again.
    ///
    /// [`Failure::DeadLetter`]: crate::Failure::DeadLetter
    Refused,
    /// It failed in a retryable way as many times as allowed.
    AttemptsExhausted,
    /// Its stored result cannot be read back, or its result could not be stored.
    Undecodable,
}

impl Reason {
    /// The stable code (`no_key`, `invalid_key`, `mismatch`, `permanent`, `refused`,
    /// `attempts_exhausted`, `undecodable`): the AMQP header and the NATS term reason carry it.
    pub fn code(self) -> &'static str {
        match self {
            Reason::NoKey => "no_key",
            Reason::InvalidKey => "invalid_key",
            Reason::Mismatch => "mismatch",
            Reason::Permanent => "permanent",
            Reason::Refused => "refused",
            Reason::AttemptsExhausted => "attempts_exhausted",
            Reason::Undecodable => "undecodable",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

impl fmt::Display for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::Identity;

    fn ns(kind: &'static str, parts: &[&str]) -> String {
        Identity::new(kind, parts.iter().copied())
            .namespace()
            .as_str()
            .to_owned()
    }

    #[test]
    fn names_that_joined_alike_get_namespaces_of_their_own() {
        assert_eq!(ns("redis", &["X.eu", "x"]), "redis:X.eu:x");
        assert_eq!(ns("redis", &["X", "eu.x"]), "redis:X:eu.x");
        assert_eq!(ns("amqp", &["S.c"]), "amqp:S.c");
        assert_eq!(ns("nats", &["S", "c"]), "nats:S:c");
        // A separator or an escape written into a name is escaped in turn.
        assert_eq!(ns("redis", &["a:b", "c"]), "redis:a_3Ab:c");
        assert_eq!(ns("redis", &["a", "b:c"]), "redis:a:b_3Ac");
        assert_eq!(ns("amqp", &["a_3A"]), "amqp:a_5F3A");
        assert_eq!(ns("amqp", &["a:"]), "amqp:a_3A");
        assert_eq!(ns("amqp", &["q/é"]), "amqp:q_2F_C3_A9");
    }

    #[test]
    fn identities_never_share_a_namespace() {
        let names = ["", "a", "b", ".", "a.b", ":", "_", "_3A", "a:b", "a_b", "é"];
        let mut identities = Vec::new();
        for kind in ["amqp", "redis"] {
            for x in names {
                identities.push((kind, vec![x]));
                for y in names {
                    identities.push((kind, vec![x, y]));
                }
            }
        }
        let mut seen = std::collections::HashMap::new();
        for (kind, parts) in identities {
            if let Some(before) = seen.insert(ns(kind, &parts), (kind, parts.clone())) {
                panic!("{before:?} and {:?} share a namespace", (kind, parts));
            }
        }
    }

    #[test]
    fn a_long_identity_is_hashed_into_a_valid_namespace() {
        let long = "q".repeat(200);
        let a = ns("amqp", &[&long]);
        assert!(a.starts_with("_sha256_") && a.len() == 8 + 64, "{a}");
        assert_ne!(a, ns("redis", &[&long]));
        assert_ne!(a, ns("amqp", &[&long[1..]]));
        // Just within the limit, the name is kept as it is.
        let fits = "q".repeat(128 - "amqp:".len());
        assert_eq!(ns("amqp", &[&fits]), format!("amqp:{fits}"));
    }
}
