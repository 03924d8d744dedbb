//! The source: its builder, its consumer group, reading and claiming.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::delivery::{RedisStreamDelivery, Scripts, Shared};
use super::entry::{self, Entry, Pending};
use super::{Conn, DeadLetterTarget, MESSAGE_ID_FIELD, MessageIdFrom, PAYLOAD_FIELD, StartAt};
use crate::{DeadLetter, Delivery, Disposition, Horizon, Identity, MqError, Reason, Source};

/// Deletes a consumer of the group only if it has nothing pending, in one step: a consumer's
/// pending entries are lost with it (nothing would ever claim them again).
const FORGET_CONSUMER: &str = r"
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) + 1
";

/// Builds a [`RedisStreamSource`]: the stream, the consumer group, and how to claim and settle.
#[derive(Debug, Clone)]
pub struct RedisStreamSourceBuilder {
    stream: String,
    group: String,
    consumer: Option<String>,
    start: StartAt,
    payload_field: String,
    message_id: MessageIdFrom,
    dead_letter: Option<DeadLetterTarget>,
    batch: usize,
    claim_idle: Duration,
    claim_every: Duration,
    max_deliveries: Option<u32>,
    forget_consumers_after: Option<Duration>,
    response_timeout: Duration,
    retry_first: Duration,
    retry_max: Duration,
}

impl RedisStreamSourceBuilder {
    /// This source's consumer name in the group (default `idem-<pid>-<random>`, new for each
    /// process). A stable name (a pod's) lets a restarted process's pending entries be found
    /// under it; they come back through the claim either way.
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.consumer = Some(name.into());
        self
    }

    /// Where a group this source creates starts reading (default: the beginning).
    pub fn start_at(mut self, start: StartAt) -> Self {
        self.start = start;
        self
    }

    /// The field that holds the body (default [`PAYLOAD_FIELD`]); an entry without it has an
    /// empty body. Every other field is a header.
    pub fn payload_field(mut self, name: impl Into<String>) -> Self {
        self.payload_field = name.into();
        self
    }

    /// Where the message id comes from (default the field [`MESSAGE_ID_FIELD`]).
    pub fn message_id(mut self, from: MessageIdFrom) -> Self {
        self.message_id = from;
        self
    }

    /// Where dead-lettered entries go (default: [`DeadLetterTarget::Stream`] on
    /// `<stream>:dead`).
    pub fn dead_letter(mut self, target: DeadLetterTarget) -> Self {
        self.dead_letter = Some(target);
        self
    }

    /// How many entries one read asks for (default 64, at least 1). A read entry's idle time
    /// runs while it waits in the buffer for a free handler: keep the batch near the
    /// consumer's concurrency, or a buffered entry may be claimed by another source (harmless
    /// with the records, but wasted).
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long an entry stays pending, not acked and without progress, before a source claims
    /// it (default 60 s): the time before the entries of a consumer that died come back. Make
    /// it about twice the record lease, so that a claimed entry finds its key free. Requeue
    /// delays are shortened to it.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle.max(Duration::from_millis(10));
        self
    }

    /// How often the source looks for entries to claim (default 1 s, at least 1 ms); also the
    /// longest a read blocks.
    pub fn claim_every(mut self, every: Duration) -> Self {
        self.claim_every = every.max(Duration::from_millis(1));
        self
    }

    /// Dead-letter an entry (reason `attempts_exhausted`) rather than hand it out once it has
    /// been delivered more than `n` times (default: no limit). Set it well above the
    /// consumer's `max_attempts`: deliveries that only waited for a running attempt count here.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = Some(n.max(1));
        self
    }

    /// At start, delete the group's consumers that have been idle this long with nothing
    /// pending (default 24 h; `None` keeps them): each process that used a new name leaves
    /// one behind. A consumer with pending entries is never deleted.
    pub fn forget_consumers_after(mut self, idle: Option<Duration>) -> Self {
        self.forget_consumers_after = idle;
        self
    }

    /// How long the server may take to answer (default 5 s), on top of a read's block.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Backoff between attempts to read after a failure (the server restarted, the stream or
    /// group was deleted): `first`, doubling up to `max` (defaults 100 ms and 5 s).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.retry_first = first;
        self.retry_max = max.max(first);
        self
    }

    /// Connects to `url` and builds the source: `redis://[:password@]host:port/db` for one
    /// server, `redis+cluster://[:password@]host:port,host:port` for a Cluster. Creates the
    /// group if missing (and the stream with it).
    pub async fn connect(self, url: &str) -> Result<RedisStreamSource, MqError> {
        let conn = super::connect(url, self.response_timeout).await?;
        let read_timeout = self.response_timeout.saturating_add(self.claim_every);
        let reads = super::connect(url, read_timeout).await?;
        let consumer = self.consumer.clone().unwrap_or_else(|| {
            format!("idem-{}-{:08x}", std::process::id(), rand::random::<u32>())
        });
        let dead_letter = self
            .dead_letter
            .clone()
            .unwrap_or_else(|| DeadLetterTarget::Stream(format!("{}:dead", self.stream)));
        if dead_letter == DeadLetterTarget::Stream(self.stream.clone()) {
            return Err(MqError::Config(format!(
                "the dead-letter stream is the stream {} itself",
                self.stream
            )));
        }
        let shared = Arc::new(Shared {
            stream: self.stream.clone(),
            group: self.group.clone(),
            consumer,
            payload_field: Bytes::from(self.payload_field.clone().into_bytes()),
            message_id: self.message_id.clone(),
            dead_letter,
            claim_idle: self.claim_idle,
            conn,
            scripts: Scripts::new(),
            vanished: AtomicU64::new(0),
        });
        let mut source = RedisStreamSource {
            name: format!("{}.{}", self.stream, self.group),
            settings: self,
            shared,
            reads,
            buffer: VecDeque::new(),
            fetching: None,
            next_sweep: Instant::now(),
            cursor: "-".to_owned(),
            group_ready: false,
            retry_wait: None,
            closed: false,
        };
        source.create_group().await.map_err(|e| match e {
            MqError::Broker { message, source } if is_code(source.as_deref(), "WRONGTYPE") => {
                MqError::Config(format!("{message}: the key is not a stream"))
            }
            e => e,
        })?;
        source.check_dead_letter().await?;
        if let Some(after) = source.settings.forget_consumers_after
            && let Err(e) = source.forget_consumers(after).await
        {
            tracing::debug!(error = %e, "cannot look for the group's idle consumers");
        }
        Ok(source)
    }
}

/// Whether `error` is a Redis error with this code (`NOGROUP`, `WRONGTYPE`).
fn is_code(error: Option<&(dyn std::error::Error + Send + Sync + 'static)>, code: &str) -> bool {
    error
        .and_then(|e| e.downcast_ref::<redis::RedisError>())
        .is_some_and(|e| e.code() == Some(code))
}

/// A Redis stream read through a consumer group, as a [`Source`].
///
/// Reads go on a connection of their own (a blocking `XREADGROUP` would hold up other
/// commands); acks, claims and dead letters on another. Both reconnect by themselves; a group
/// that disappears (the server restarted without persistence, the stream was deleted) is
/// created again.
///
/// # Example
///
/// ```no_run
/// # async fn example() -> Result<(), idem_mq::MqError> {
/// use std::time::Duration;
/// use idem_mq::redis_streams::RedisStreamSource;
/// use idem_mq::{Consumer, Failure, Message};
///
/// let source = RedisStreamSource::builder("orders", "inventory")
///     // Twice the consumer's lease below.
///     .claim_idle(Duration::from_secs(60))
///     .connect("redis://127.0.0.1:6379")
///     .await?;
/// let consumer = Consumer::new(idem::MemoryStore::new()).lease(Duration::from_secs(30));
/// let handler = |msg: Message| async move {
///     // Deduct stock for msg.payload; msg.fence() can guard writes elsewhere.
///     Ok::<_, Failure<String>>(())
/// };
/// consumer.run(source, handler, std::future::pending()).await?;
/// # Ok(())
/// # }
/// ```
pub struct RedisStreamSource {
    /// `<stream>.<group>`, for logs.
    name: String,
    settings: RedisStreamSourceBuilder,
    shared: Arc<Shared>,
    /// The blocking reads.
    reads: Conn,
    buffer: VecDeque<RedisStreamDelivery>,
    /// The read or claim under way. It runs in a task of its own, so that a `next` dropped
    /// while it waits (at shutdown) loses nothing: what it brings is buffered by the next call,
    /// or handed back by `close`.
    fetching: Option<JoinHandle<Result<Fetched, Failed>>>,
    next_sweep: Instant,
    /// Where the next look at the pending list starts (`-`, or `(<id>` after the last seen).
    cursor: String,
    group_ready: bool,
    retry_wait: Option<Duration>,
    closed: bool,
}

impl std::fmt::Debug for RedisStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamSource")
            .field("stream", &self.shared.stream)
            .field("group", &self.shared.group)
            .field("consumer", &self.shared.consumer)
            .field("buffered", &self.buffer.len())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl RedisStreamSource {
    /// A builder for a source on `stream`, reading through the consumer group `group`.
    pub fn builder(
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> RedisStreamSourceBuilder {
        RedisStreamSourceBuilder {
            stream: stream.into(),
            group: group.into(),
            consumer: None,
            start: StartAt::Beginning,
            payload_field: PAYLOAD_FIELD.to_owned(),
            message_id: MessageIdFrom::Field(MESSAGE_ID_FIELD.to_owned()),
            dead_letter: None,
            batch: 64,
            claim_idle: Duration::from_secs(60),
            claim_every: Duration::from_secs(1),
            max_deliveries: None,
            forget_consumers_after: Some(Duration::from_secs(24 * 3600)),
            response_timeout: Duration::from_secs(5),
            retry_first: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
        }
    }

    /// This source's consumer name in the group.
    pub fn consumer_name(&self) -> &str {
        &self.shared.consumer
    }

    /// Where dead-lettered entries go.
    pub fn dead_letter_target(&self) -> &DeadLetterTarget {
        &self.shared.dead_letter
    }

    /// How many entries this source found deleted or trimmed from the stream while pending
    /// in the group (never to be delivered again); each is also logged and counted in
    /// `idem_mq_entries_vanished_total`.
    pub fn vanished(&self) -> u64 {
        self.shared.vanished.load(Ordering::Relaxed)
    }

    fn conn(&self) -> Conn {
        self.shared.conn.clone()
    }

    /// `XGROUP CREATE … MKSTREAM`; a group that exists already is used as it is.
    async fn create_group(&mut self) -> Result<(), MqError> {
        let start = match self.settings.start {
            StartAt::Beginning => "0",
            StartAt::End => "$",
        };
        let created = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.shared.stream)
            .arg(&self.shared.group)
            .arg(start)
            .arg("MKSTREAM")
            .exec_async(&mut self.conn())
            .await;
        match created {
            Ok(()) => {}
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => {
                return Err(MqError::broker(
                    format!(
                        "cannot create the group {} of stream {}",
                        self.shared.group, self.shared.stream
                    ),
                    e,
                ));
            }
        }
        self.group_ready = true;
        Ok(())
    }

    /// Deletes the consumers idle longer than `after` with nothing pending.
    async fn forget_consumers(&self, after: Duration) -> Result<(), MqError> {
        let s = &self.shared;
        let listed: Value = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&s.stream)
            .arg(&s.group)
            .query_async(&mut self.conn())
            .await
            .map_err(|e| MqError::broker("cannot list the group's consumers", e))?;
        let after = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        let script = redis::Script::new(FORGET_CONSUMER);
        let mut forgotten = 0;
        for (name, pending, idle) in consumers(listed) {
            if pending > 0 || idle < after || name == s.consumer {
                continue;
            }
            let gone: i64 = script
                .key(&s.stream)
                .arg(&s.group)
                .arg(&name)
                .invoke_async(&mut self.conn())
                .await
                .map_err(|e| MqError::broker("cannot delete an idle consumer", e))?;
            forgotten += i64::from(gone > 0);
        }
        if forgotten > 0 {
            tracing::info!(
                stream = %s.stream,
                group = %s.group,
                forgotten,
                "deleted the group's long-idle consumers that had nothing pending"
            );
        }
        Ok(())
    }

    /// Refuses a dead-letter key that holds something else than a stream: every dead letter
    /// would fail, and the entries stay pending for ever.
    async fn check_dead_letter(&self) -> Result<(), MqError> {
        let DeadLetterTarget::Stream(to) = &self.shared.dead_letter else {
            return Ok(());
        };
        let kind: String = redis::cmd("TYPE")
            .arg(to)
            .query_async(&mut self.conn())
            .await
            .map_err(|e| MqError::broker("cannot check the dead-letter stream", e))?;
        match kind.as_str() {
            "none" | "stream" => Ok(()),
            other => Err(MqError::Config(format!(
                "the dead-letter key {to} holds a {other}, not a stream; delete it or choose \
                 another dead-letter stream"
            ))),
        }
    }

    /// Reads or claims more entries into the buffer (possibly none: a read timed out).
    async fn fill(&mut self) -> Result<(), MqError> {
        if !self.group_ready {
            self.create_group().await?;
        }
        if self.fetching.is_none() {
            self.fetching = Some(tokio::spawn(self.fetch()));
        }
        let Some(task) = self.fetching.as_mut() else {
            return Ok(());
        };
        let done = task.await;
        self.fetching = None;
        let fetched = match done {
            Ok(Ok(fetched)) => fetched,
            Ok(Err(Failed { error, no_group })) => {
                if no_group {
                    self.group_ready = false;
                }
                return Err(error);
            }
            Err(e) => return Err(MqError::broker("reading from the stream failed", e)),
        };
        if let Some(next) = fetched.cursor {
            match next {
                // There may be more: look again at once, from after the last one.
                Some(cursor) => self.cursor = cursor,
                None => {
                    self.cursor = "-".to_owned();
                    self.next_sweep = Instant::now() + self.settings.claim_every;
                }
            }
        }
        for (entry, deliveries) in fetched.entries {
            let delivery = RedisStreamDelivery::new(entry, deliveries, Arc::clone(&self.shared));
            self.buffer.push_back(delivery);
        }
        Ok(())
    }

    /// The next read or claim, to run in a task of its own: a claim when one is due, else a
    /// read that blocks until the next one is.
    fn fetch(&self) -> impl Future<Output = Result<Fetched, Failed>> + Send + 'static {
        let claim = Instant::now() >= self.next_sweep;
        let block = self
            .next_sweep
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), self.settings.claim_every);
        let shared = Arc::clone(&self.shared);
        let reads = self.reads.clone();
        let cursor = self.cursor.clone();
        let batch = self.settings.batch;
        async move {
            if claim {
                claim_idle(&shared, &cursor, batch).await
            } else {
                read(&shared, reads, batch, block).await
            }
        }
    }

    /// Dead-letters a delivery past `max_deliveries`; a failure leaves it pending, to be
    /// claimed and dead-lettered again.
    async fn dead_letter_poison(&self, delivery: RedisStreamDelivery, max: u32) {
        let deliveries = delivery.deliveries();
        tracing::warn!(
            stream = %self.shared.stream,
            entry = delivery.entry_id(),
            deliveries,
            "an entry was delivered more times than allowed; dead-lettered"
        );
        let dead = DeadLetter {
            reason: Reason::AttemptsExhausted,
            detail: format!(
                "delivered {deliveries} times without being settled; at most {max} deliveries \
                 are allowed"
            ),
        };
        if let Err(e) = delivery.settle(Disposition::DeadLetter(dead)).await {
            tracing::warn!(error = %e, "cannot dead-letter an entry delivered too often");
        }
    }

    /// Remembers a failure: the next read waits, doubling up to the cap.
    fn failed(&mut self) {
        let next = match self.retry_wait {
            None => self.settings.retry_first,
            Some(wait) => wait.saturating_mul(2).min(self.settings.retry_max),
        };
        self.retry_wait = Some(next);
    }
}

/// What a read or a claim brought.
struct Fetched {
    /// The entries, each with how many times it has been delivered, this time included.
    entries: Vec<(Entry, u32)>,
    /// After a claim, where the next starts: `Some(Some(c))` to look again at once from `c`,
    /// `Some(None)` when the pending list was read to its end.
    cursor: Option<Option<String>>,
}

/// Why a read or a claim failed, and whether the group is gone (`NOGROUP`).
struct Failed {
    error: MqError,
    no_group: bool,
}

fn failed(e: redis::RedisError, what: &str) -> Failed {
    Failed {
        no_group: e.code() == Some("NOGROUP"),
        error: MqError::broker(what.to_owned(), e),
    }
}

fn malformed(error: MqError) -> Failed {
    Failed {
        error,
        no_group: false,
    }
}

/// `XREADGROUP … COUNT <batch> BLOCK <block> STREAMS <stream> >` on the reads' connection.
async fn read(
    shared: &Shared,
    mut reads: Conn,
    batch: usize,
    block: Duration,
) -> Result<Fetched, Failed> {
    let answer: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&shared.group)
        .arg(&shared.consumer)
        .arg("COUNT")
        .arg(batch)
        .arg("BLOCK")
        .arg(millis(block).max(1))
        .arg("STREAMS")
        .arg(&shared.stream)
        .arg(">")
        .query_async(&mut reads)
        .await
        .map_err(|e| failed(e, "cannot read from the stream"))?;
    let entries = entry::read_reply(answer).map_err(malformed)?;
    Ok(Fetched {
        entries: entries.into_iter().map(|e| (e, 1)).collect(),
        cursor: None,
    })
}

/// Claims the entries pending longer than the claim idle time, from `cursor` on: `XPENDING …
/// IDLE` for their delivery counts, then `XCLAIM`, which claims only those still idle that long
/// (not one another source claimed in between).
async fn claim_idle(shared: &Shared, cursor: &str, batch: usize) -> Result<Fetched, Failed> {
    let idle = millis(shared.claim_idle);
    let mut conn = shared.conn.clone();
    let listed: Value = redis::cmd("XPENDING")
        .arg(&shared.stream)
        .arg(&shared.group)
        .arg("IDLE")
        .arg(idle)
        .arg(cursor)
        .arg("+")
        .arg(batch)
        .query_async(&mut conn)
        .await
        .map_err(|e| failed(e, "cannot read the pending entries"))?;
    let pending = entry::pending_reply(listed).map_err(malformed)?;
    let next = match pending.last() {
        Some(last) if pending.len() >= batch => Some(format!("({}", last.id)),
        _ => None,
    };
    if pending.is_empty() {
        return Ok(Fetched {
            entries: Vec::new(),
            cursor: Some(next),
        });
    }
    let mut cmd = redis::cmd("XCLAIM");
    cmd.arg(&shared.stream)
        .arg(&shared.group)
        .arg(&shared.consumer)
        .arg(idle);
    for p in &pending {
        cmd.arg(&p.id);
    }
    let claimed: Value = cmd
        .query_async(&mut conn)
        .await
        .map_err(|e| failed(e, "cannot claim the pending entries"))?;
    let claimed = entry::entries_of(claimed, "XCLAIM").map_err(malformed)?;
    let unclaimed: Vec<&str> = pending
        .iter()
        .filter(|p| !claimed.iter().any(|e| e.id == p.id))
        .map(|p| p.id.as_str())
        .collect();
    if !unclaimed.is_empty() {
        report_vanished(shared, &mut conn, &unclaimed).await;
    }
    let entries = claimed
        .into_iter()
        .map(|entry| {
            let deliveries = delivered_before(&pending, &entry).saturating_add(1);
            (entry, u32::try_from(deliveries).unwrap_or(u32::MAX))
        })
        .collect();
    Ok(Fetched {
        entries,
        cursor: Some(next),
    })
}

/// Reports those of `ids`, listed idle but not claimed, that are gone from the stream: deleted
/// (`XDEL`) or trimmed (`XTRIM`, `MAXLEN`) while pending, they can never be delivered again,
/// and `XCLAIM` drops them from the pending list without a word (before Redis 7 it answers
/// `nil`). The rest were claimed by another source in between. Each is logged by its entry id
/// and counted (`idem_mq_entries_vanished_total`); a failure to look is only logged, since
/// nothing can be done for such an entry either way.
async fn report_vanished(shared: &Shared, conn: &mut Conn, ids: &[&str]) {
    for id in ids {
        let found: Result<Value, _> = redis::cmd("XRANGE")
            .arg(&shared.stream)
            .arg(*id)
            .arg(*id)
            .query_async(conn)
            .await;
        match found {
            Ok(Value::Array(items)) if items.is_empty() => {
                shared.vanished.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("idem_mq_entries_vanished_total", "source" => format!("{}.{}", shared.stream, shared.group))
                    .increment(1);
                tracing::warn!(
                    stream = %shared.stream,
                    group = %shared.group,
                    entry = id,
                    "an entry was deleted or trimmed from the stream while pending, before it \
                     was acked: it will not be delivered again"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(
                stream = %shared.stream,
                entry = id,
                error = %e,
                "cannot tell whether an unclaimed entry is still in the stream"
            ),
        }
    }
}

/// How many times the pending list said `entry` was delivered (0 if it was not listed).
fn delivered_before(pending: &[Pending], entry: &Entry) -> u64 {
    pending
        .iter()
        .find(|p| p.id == entry.id)
        .map_or(0, |p| p.deliveries)
}

/// `(name, pending, idle ms)` of each consumer in an `XINFO CONSUMERS` answer (RESP2: a flat
/// list of names and values per consumer; RESP3: a map).
fn consumers(listed: Value) -> Vec<(String, u64, u64)> {
    let Value::Array(items) = listed else {
        return Vec::new();
    };
    items
        .into_iter()
        .filter_map(|item| {
            let pairs: Vec<(Value, Value)> = match item {
                Value::Map(pairs) => pairs,
                Value::Array(flat) => {
                    let mut flat = flat.into_iter();
                    std::iter::from_fn(|| Some((flat.next()?, flat.next()?))).collect()
                }
                _ => return None,
            };
            let (mut name, mut pending, mut idle) = (None, None, None);
            for (k, v) in pairs {
                let key = match k {
                    Value::BulkString(b) => b,
                    Value::SimpleString(s) => s.into_bytes(),
                    _ => continue,
                };
                match (key.as_slice(), v) {
                    (b"name", Value::BulkString(b)) => name = String::from_utf8(b).ok(),
                    (b"name", Value::SimpleString(s)) => name = Some(s),
                    (b"pending", Value::Int(n)) => pending = u64::try_from(n).ok(),
                    (b"idle", Value::Int(n)) => idle = u64::try_from(n).ok(),
                    _ => {}
                }
            }
            Some((name?, pending?, idle?))
        })
        .collect()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Source for RedisStreamSource {
    type Delivery = RedisStreamDelivery;

    fn name(&self) -> &str {
        &self.name
    }

    fn identity(&self) -> Identity<'_> {
        Identity::new("redis", [&*self.settings.stream, &self.settings.group])
    }

    async fn next(&mut self) -> Option<Result<RedisStreamDelivery, MqError>> {
        loop {
            if self.closed {
                return None;
            }
            if let Some(delivery) = self.buffer.pop_front() {
                match self.settings.max_deliveries {
                    Some(max) if delivery.deliveries() > max => {
                        self.dead_letter_poison(delivery, max).await;
                        continue;
                    }
                    _ => return Some(Ok(delivery)),
                }
            }
            if let Some(wait) = self.retry_wait {
                tokio::time::sleep(wait).await;
            }
            match self.fill().await {
                Ok(()) => self.retry_wait = None,
                Err(e) => {
                    self.failed();
                    return Some(Err(e));
                }
            }
        }
    }

    fn ack_wait(&self) -> Option<Duration> {
        Some(self.settings.claim_idle)
    }

    fn redelivery_horizon(&self) -> Horizon {
        Horizon::Unbounded
    }

    async fn close(&mut self) {
        self.closed = true;
        let mut ids: Vec<String> = self
            .buffer
            .drain(..)
            .map(|d| d.entry_id().to_owned())
            .collect();
        // A read or claim a dropped `next` left running: its entries are this consumer's.
        if let Some(task) = self.fetching.take() {
            let wait = self
                .settings
                .response_timeout
                .saturating_add(self.settings.claim_every);
            match tokio::time::timeout(wait, task).await {
                Ok(Ok(Ok(fetched))) => ids.extend(fetched.entries.into_iter().map(|(e, _)| e.id)),
                _ => tracing::debug!("a read under way at close did not finish"),
            }
        }
        if ids.is_empty() {
            return;
        }
        // Read but not handed out: made claimable at once by any source of the group, whatever
        // its claim idle time (as if delivered at the epoch), rather than after it. If this
        // fails they come back after it.
        let handed_back = tokio::time::timeout(
            self.settings.response_timeout,
            self.shared
                .set_idle(ids.iter().map(String::as_str), "TIME", 1),
        )
        .await;
        if !matches!(handed_back, Ok(Ok(()))) {
            tracing::debug!("cannot hand back the entries read but not handed out");
        }
    }
}
