//! What a consumer is set to, and what every delivery of one source shares once the
//! settings are checked against it.

use std::sync::Arc;
use std::time::Duration;

use idem::Idempotency;
use idem_core::{Clock, DEFAULT_LEASE, DEFAULT_TTL, Namespace, Scope, Store};

use super::{Consumer, MissingKey};
use crate::MqError;
use crate::key::KeyFrom;
use crate::source::{Horizon, Source};

/// The scope of a consumer's records when it is not given one.
pub const DEFAULT_SCOPE: &str = "mq";

/// The most runs [`Consumer::max_attempts`] allows: a record counts its acquisitions
/// exactly up to 1000 ([`Lease::acquisition`](idem::Lease::acquisition)).
const MAX_ATTEMPTS: u32 = 999;

#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) key: KeyFrom,
    pub(super) scope: String,
    pub(super) namespace: Option<String>,
    pub(super) fingerprint: bool,
    pub(super) missing_key: MissingKey,
    pub(super) max_attempts: u32,
    pub(super) backoff_first: Duration,
    pub(super) backoff_max: Duration,
    pub(super) lease: Duration,
    pub(super) ttl: Duration,
    pub(super) wait_in_flight: Duration,
    pub(super) concurrency: usize,
    pub(super) drain: Duration,
}

impl<S: Store + Clone> Consumer<S> {
    /// A consumer keeping its records in `store`, with the defaults: the key is the message
    /// id, the namespace made from the source's identity (`amqp:orders`,
    /// `nats:ORDERS:billing`), the scope `mq`; payloads fingerprinted (a key met again with
    /// another payload is dead-lettered `mismatch`); a message without a key is dead-lettered; five deliveries at most;
    /// backoff from 1 s doubling to 5 min; a 60 s lease, renewed while the handler runs; a
    /// 24 h TTL; a key held by another attempt waited for 5 s; 64 handlers at once; 30 s to
    /// finish running handlers at shutdown.
    pub fn new(store: S) -> Self {
        Self::with_engine(Idempotency::new(store))
    }
}

impl<S: Store + Clone, C: Clock + Clone> Consumer<S, C> {
    /// A consumer over an existing engine (and its clock).
    pub fn with_engine(idem: Idempotency<S, C>) -> Self {
        Self {
            idem,
            settings: Arc::new(Settings {
                key: KeyFrom::MessageId,
                scope: DEFAULT_SCOPE.into(),
                namespace: None,
                fingerprint: true,
                missing_key: MissingKey::DeadLetter,
                max_attempts: 5,
                backoff_first: Duration::from_secs(1),
                backoff_max: Duration::from_secs(300),
                lease: DEFAULT_LEASE,
                ttl: DEFAULT_TTL,
                wait_in_flight: Duration::from_secs(5),
                concurrency: 64,
                drain: Duration::from_secs(30),
            }),
            counters: Arc::default(),
        }
    }

    fn set(mut self, f: impl FnOnce(&mut Settings)) -> Self {
        f(Arc::make_mut(&mut self.settings));
        self
    }

    /// Where each message's key comes from (default: the message id).
    pub fn key(self, from: KeyFrom) -> Self {
        self.set(|s| s.key = from)
    }

    /// The records' scope (default [`DEFAULT_SCOPE`]): keys of one scope never meet another's.
    pub fn scope(self, scope: impl Into<String>) -> Self {
        self.set(|s| s.scope = scope.into())
    }

    /// The records' namespace (default: made from the source's identity, the broker's kind
    /// and its names there, as [`Identity::namespace`](crate::Identity::namespace) writes it:
    /// `amqp:orders`, `nats:ORDERS:billing`, `redis:orders:billing`). Sources given one
    /// namespace share records: a message of one whose key the other has settled is not run
    /// again (with payload fingerprints, the default, it is dead-lettered `mismatch` unless
    /// its payload is the same).
    pub fn namespace(self, namespace: impl Into<String>) -> Self {
        self.set(|s| s.namespace = Some(namespace.into()))
    }

    /// Fingerprint payloads (the default): a message whose key was used with another payload
    /// is reported and dead-lettered (`mismatch`), never given the other payload's result.
    /// Turn it off only where one key's messages may differ and are still one effect (a
    /// publisher that resends an event with a new timestamp): then the first payload's result
    /// answers every later one.
    pub fn fingerprint_payload(self, on: bool) -> Self {
        self.set(|s| s.fingerprint = on)
    }

    /// What to do with a message without a key.
    pub fn missing_key(self, what: MissingKey) -> Self {
        self.set(|s| s.missing_key = what)
    }

    /// How many times a message's handler may run before it is dead-lettered
    /// (`attempts_exhausted`); at least 1, at most 999. Runs are counted by the record
    /// ([`Lease::acquisition`](idem::Lease::acquisition)), so a run whose consumer died counts (a message that
    /// crashes its consumer every time ends in the dead letter too), while a redelivery that
    /// only waited for a running attempt, or sat unstarted in a dead consumer's prefetch
    /// buffer, does not. Messages without a key are counted by the broker's deliveries.
    pub fn max_attempts(self, n: u32) -> Self {
        self.set(|s| s.max_attempts = n.clamp(1, MAX_ATTEMPTS))
    }

    /// The requeue delay after the first retryable failure, doubling up to `max`, with
    /// jitter (each delay is drawn between half and all of it).
    pub fn backoff(self, first: Duration, max: Duration) -> Self {
        self.set(|s| {
            s.backoff_first = first;
            s.backoff_max = max.max(first);
        })
    }

    /// The record's lease (default 60 s), renewed at a third of its length while the handler
    /// runs: if the consumer dies, another may take the key over this long after.
    pub fn lease(self, lease: Duration) -> Self {
        self.set(|s| s.lease = lease.max(Duration::from_millis(30)))
    }

    /// How long a result is kept (default 24 h). It must outlive the broker's redelivery
    /// horizon ([`Source::redelivery_horizon`]), or the consumer refuses to start.
    pub fn ttl(self, ttl: Duration) -> Self {
        self.set(|s| s.ttl = ttl)
    }

    /// How long a delivery whose key another attempt holds waits for it (default 5 s) before
    /// it is requeued.
    pub fn wait_in_flight(self, wait: Duration) -> Self {
        self.set(|s| s.wait_in_flight = wait)
    }

    /// How many handlers run at once (default 64; match the source's prefetch).
    pub fn concurrency(self, n: usize) -> Self {
        self.set(|s| s.concurrency = n.max(1))
    }

    /// How long [`Consumer::run`] waits at shutdown for running handlers (default 30 s);
    /// a handler still running then is dropped, its key given back, its message left to the
    /// broker.
    pub fn drain(self, drain: Duration) -> Self {
        self.set(|s| s.drain = drain)
    }

    /// The namespace records of `source` go under: the one set, checked, or the one made from
    /// the source's identity (always valid, and never another source's).
    fn namespace_for<Src: Source>(&self, source: &Src) -> Result<Namespace, MqError> {
        match &self.settings.namespace {
            Some(name) => Namespace::new(name.as_str())
                .map_err(|e| MqError::Config(format!("the namespace {name:?} is not valid: {e}"))),
            None => Ok(source.identity().namespace()),
        }
    }

    /// Checks the settings against the source: a valid scope, namespace and key source
    /// ([`KeyFrom::check`](crate::KeyFrom::check)), and a record TTL
    /// that outlives the broker's redelivery horizon. [`Consumer::run`] checks this at start
    /// (and warns of a broker that may redeliver without a bound), [`Consumer::process`] on
    /// every call.
    pub fn check<Src: Source>(&self, source: &Src) -> Result<(), MqError> {
        self.context(source).map(|_| ())
    }

    /// What every delivery of `source` shares, once the settings are checked against it (see
    /// [`Consumer::check`]).
    pub(super) fn context<Src: Source>(&self, source: &Src) -> Result<Ctx, MqError> {
        let scope = Scope::new(self.settings.scope.clone())
            .map_err(|e| MqError::Config(format!("the scope is not valid: {e}")))?;
        let namespace = self.namespace_for(source)?;
        self.settings
            .key
            .check()
            .map_err(|e| MqError::Config(format!("the key source: {e}")))?;
        let ttl = self.settings.ttl;
        if let Horizon::Bounded(h) = source.redelivery_horizon()
            && h > ttl
        {
            return Err(MqError::Config(format!(
                "the record TTL ({ttl:?}) is shorter than the broker's redelivery horizon \
                 ({h:?}): a message redelivered after its record expired would run again; \
                 raise the TTL or lower the broker's redelivery limit"
            )));
        }
        Ok(Ctx {
            source: Arc::from(source.name()),
            scope,
            namespace,
            ack_wait: source.ack_wait(),
        })
    }
}

/// What every delivery of one source shares.
#[derive(Clone)]
pub(super) struct Ctx {
    pub(super) source: Arc<str>,
    pub(super) scope: Scope,
    pub(super) namespace: Namespace,
    pub(super) ack_wait: Option<Duration>,
}
