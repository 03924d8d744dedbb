//! Redis Streams: a consumer group as a [`Source`](crate::Source), and publishing an entry with
//! its message id.
//!
//! [`RedisStreamSource`] reads a stream through a consumer group (`XREADGROUP`), created if
//! missing. An entry is a map of fields: one of them is the message's body (the `payload`
//! field unless configured), the others are its headers, so a key can come from a field
//! through [`KeyFrom::Header`](crate::KeyFrom::Header). The message id (the consumer's default
//! key) is the `message_id` field that [`publish`] writes, or the entry's own id
//! ([`MessageIdFrom::EntryId`]).
//!
//! | disposition | what the server is told |
//! | --- | --- |
//! | [`Disposition::Ack`](crate::Disposition::Ack) | `XACK` |
//! | [`Disposition::Requeue`](crate::Disposition::Requeue) | `XCLAIM … IDLE (claim idle − delay) JUSTID`: the entry stays pending, and is claimed again once `delay` has passed |
//! | [`Disposition::DeadLetter`](crate::Disposition::DeadLetter) | `XADD` of a copy to the dead-letter stream with the reason, then `XACK` (in one script on a single server, so the ack never runs without the copy) |
//!
//! # Pending entries, takeover and keep-alive
//!
//! Redis keeps every entry read through the group in the group's pending list until it is
//! acked; nothing redelivers it by itself. Each source looks for entries that have been pending
//! longer than its *claim idle* time (default 60 s; twice the record lease is a good value) at
//! most every *claim interval* (default 1 s), whenever the consumer asks for more, and claims
//! them for itself (`XPENDING … IDLE`,
//! then `XCLAIM`, which checks the idle time again so two sources never claim one entry at
//! once). That is how the entries of a consumer that died, or that requeued them, come back.
//!
//! While a handler runs, the consumer reports progress at a third of the claim idle time
//! ([`Source::ack_wait`](crate::Source::ack_wait) reports it): `XCLAIM … IDLE 0 JUSTID` on the entry's own id, which resets
//! its idle time without counting a delivery, so a live handler's entry is not taken over.
//! Progress, requeues and the hand-back at close change an entry only while it is still this
//! consumer's (a short script checks the owner first): a plain `XCLAIM` would take back an
//! entry another source had claimed meanwhile.
//!
//! Redis has no delayed redelivery: a requeue sets the entry's idle time so that it becomes
//! claimable `delay` later. Delays longer than the claim idle time are shortened to it, and an
//! entry comes back up to one claim interval after it became claimable.
//!
//! # Delivery counts and poison entries
//!
//! An entry read for the first time has been delivered once; a claimed one counts what the
//! pending list says (`XPENDING`), plus this claim. The consumer counts runs by its record (see
//! [`Consumer::max_attempts`](crate::Consumer::max_attempts)); past
//! [`RedisStreamSourceBuilder::max_deliveries`] the source dead-letters an entry itself, with
//! the reason `attempts_exhausted`, without handing it out: an entry that its consumers
//! keep dying over while it only waits in their buffers.
//!
//! # Records' namespace
//!
//! The consumer's default namespace is `redis:<stream>:<group>`, each name escaped
//! ([`Identity::namespace`](crate::Identity::namespace)): each group sees every entry, so
//! each keeps records of its own, and no two pairs share one (`orders.eu` with group `x` is
//! `redis:orders.eu:x`; `orders` with group `eu.x` is `redis:orders:eu.x`).
//!
//! # Servers
//!
//! Redis 7 or later, or Valkey (`XPENDING … IDLE` and exclusive ranges need 6.2; before 7.0
//! an entry deleted while pending stays pending). No TLS (`rediss://`) in this build.
//!
//! # Redelivery horizon
//!
//! An entry stays pending until it is acked, however long that takes:
//! [`Horizon::Unbounded`](crate::Horizon::Unbounded).
//!
//! # Redis Cluster
//!
//! A stream lives on one slot, so a source works on a Cluster as on one server
//! (`redis+cluster://`). The dead-letter stream may hash to another slot, so its copy and the
//! `XACK` are two commands there: a crash between them dead-letters the entry again (at least
//! once into the dead letter; the copy carries the original entry id to tell). Give both
//! streams one hash tag (`{orders}` and `{orders}:dead`) to keep them on one node.

use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use redis::aio::{ConnectionLike, ConnectionManagerConfig};

use crate::MqError;

mod delivery;
mod entry;
mod source;

pub use delivery::RedisStreamDelivery;
pub use source::{RedisStreamSource, RedisStreamSourceBuilder};

/// The field [`publish`] writes the message id to, and where the source looks for it by
/// default.
pub const MESSAGE_ID_FIELD: &str = "message_id";
/// The field that holds the message's body, by default.
pub const PAYLOAD_FIELD: &str = "payload";
/// Field of a dead-lettered copy: [`crate::Reason::code`].
pub const REASON_FIELD: &str = "idem-reason";
/// Field of a dead-lettered copy: the sentence of its [`DeadLetter`](crate::DeadLetter).
pub const DETAIL_FIELD: &str = "idem-detail";
/// Field of a dead-lettered copy: the stream it came from.
pub const STREAM_FIELD: &str = "idem-stream";
/// Field of a dead-lettered copy: the consumer group that gave up on it.
pub const GROUP_FIELD: &str = "idem-group";
/// Field of a dead-lettered copy: its entry id in the stream it came from.
pub const ENTRY_FIELD: &str = "idem-entry";
/// Field of a dead-lettered copy: how many times it was delivered.
pub const DELIVERIES_FIELD: &str = "idem-deliveries";

/// Longest `idem-detail` value, in bytes; longer sentences are cut at a character boundary.
const MAX_DETAIL_LEN: usize = 1024;

/// Where the message id (the consumer's default key) of an entry comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageIdFrom {
    /// A field the publisher writes ([`MESSAGE_ID_FIELD`] by default): the same message
    /// published twice has one id.
    Field(String),
    /// The entry's id in the stream (`1700000000000-0`): every redelivery of one entry has it,
    /// but an entry published twice has two.
    EntryId,
}

/// Where the group reads from when the source creates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartAt {
    /// Every entry already in the stream (`0`): the default, so a backlog is not skipped.
    Beginning,
    /// Only entries added after the group is created (`$`). A group made again (the server
    /// lost it) skips the entries added while it was missing.
    End,
}

/// Where a dead-lettered entry goes before it is acked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterTarget {
    /// A copy is added (`XADD`) to this stream, with the reason; the entry is acked only once
    /// the copy is stored. The default, on `<stream>:dead`.
    Stream(String),
    /// Only `XACK`, with the reason logged.
    AckOnly,
}

/// The store's connection type: one server or a Cluster, each reconnecting by itself. A source
/// opens two (a blocking read would hold up a multiplexed connection's other commands), with
/// timeouts of their own.
pub(crate) use idem::idem_store::RedisConnection as Conn;

/// Connects to `url`: `redis://…` for one server, or `redis+cluster://host:port,host:port…`
/// for a Cluster reached through any of those nodes, read as the Redis store reads them
/// (credentials before the first host are every node's). `timeout` bounds each answer and
/// each connection attempt.
pub(crate) async fn connect(url: &str, timeout: Duration) -> Result<Conn, MqError> {
    let parsed: idem::StoreUrl = url
        .parse()
        .map_err(|e| MqError::Config(format!("the Redis URL: {e}")))?;
    let idem::StoreUrl::Redis { nodes, cluster, .. } = parsed else {
        return Err(MqError::Config(
            "a Redis stream is read from a redis:// or redis+cluster:// URL".to_owned(),
        ));
    };
    if cluster {
        let client = redis::cluster::ClusterClient::builder(nodes)
            .response_timeout(timeout)
            .connection_timeout(timeout)
            .build()
            .map_err(|e| MqError::broker("the Redis Cluster URL is not valid", e))?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| MqError::broker("cannot connect to the Redis Cluster", e))?;
        return Ok(Conn::Cluster(conn));
    }
    let node = nodes.into_iter().next().unwrap_or_default();
    let client =
        redis::Client::open(node).map_err(|e| MqError::broker("the Redis URL is not valid", e))?;
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(timeout))
        .set_connection_timeout(Some(timeout))
        .set_number_of_retries(2);
    let conn = client
        .get_connection_manager_with_config(config)
        .await
        .map_err(|e| MqError::broker("cannot connect to Redis", e))?;
    Ok(Conn::Single(conn))
}

/// Adds an entry to `stream` with its message id in [`MESSAGE_ID_FIELD`] and its body in
/// [`PAYLOAD_FIELD`]; returns the entry's id. A publisher that retries after an error may add
/// it twice; consumers keyed by the message id (the default) run it once.
pub async fn publish<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    message_id: &str,
    payload: &[u8],
) -> Result<String, MqError> {
    publish_with_fields(conn, stream, message_id, payload, &[]).await
}

/// [`publish`] with more fields (the consumer's headers: a key in a field of its own, a
/// trace id).
pub async fn publish_with_fields<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    message_id: &str,
    payload: &[u8],
    fields: &[(&str, &[u8])],
) -> Result<String, MqError> {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream)
        .arg("*")
        .arg(MESSAGE_ID_FIELD)
        .arg(message_id)
        .arg(PAYLOAD_FIELD)
        .arg(payload);
    for (name, value) in fields {
        cmd.arg(*name).arg(*value);
    }
    cmd.query_async(conn)
        .await
        .map_err(|e| MqError::broker("cannot add the entry to the stream", e))
}

/// An entry's body as [`Bytes`], without a copy.
fn bytes(value: Value) -> Option<Bytes> {
    match value {
        Value::BulkString(b) => Some(Bytes::from(b)),
        Value::SimpleString(s) => Some(Bytes::from(s)),
        _ => None,
    }
}
