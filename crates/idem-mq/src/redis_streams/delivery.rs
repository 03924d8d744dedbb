//! A delivery, and how it is settled.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::Conn;
use super::entry::Entry;
use super::{
    DELIVERIES_FIELD, DETAIL_FIELD, DeadLetterTarget, ENTRY_FIELD, GROUP_FIELD, MAX_DETAIL_LEN,
    MessageIdFrom, REASON_FIELD, STREAM_FIELD,
};
use crate::{DeadLetter, Delivery, Disposition, MqError};

/// What every delivery of one source shares.
pub(super) struct Shared {
    pub(super) stream: String,
    pub(super) group: String,
    pub(super) consumer: String,
    pub(super) payload_field: Bytes,
    pub(super) message_id: MessageIdFrom,
    pub(super) dead_letter: DeadLetterTarget,
    pub(super) claim_idle: Duration,
    /// Acks, claims and dead letters; never a blocking read.
    pub(super) conn: Conn,
}

/// One entry of the stream, held until it is settled.
pub struct RedisStreamDelivery {
    id: String,
    payload: Bytes,
    /// Every field but the body.
    fields: Vec<(Bytes, Bytes)>,
    deliveries: u32,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RedisStreamDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the fields or the body: they may hold keys and personal data.
        f.debug_struct("RedisStreamDelivery")
            .field("stream", &self.shared.stream)
            .field("id", &self.id)
            .field("deliveries", &self.deliveries)
            .finish_non_exhaustive()
    }
}

impl RedisStreamDelivery {
    /// An entry as delivered for the `deliveries`-th time.
    pub(super) fn new(entry: Entry, deliveries: u32, shared: Arc<Shared>) -> Self {
        let mut fields = entry.fields;
        let payload = fields
            .iter()
            .position(|(name, _)| *name == shared.payload_field)
            .map(|at| fields.remove(at).1)
            .unwrap_or_default();
        Self {
            id: entry.id,
            payload,
            fields,
            deliveries,
            shared,
        }
    }

    /// The entry's id in the stream.
    pub fn entry_id(&self) -> &str {
        &self.id
    }

    /// The stream the entry was read from.
    pub fn stream(&self) -> &str {
        &self.shared.stream
    }

    /// The entry's fields other than the body, in order, as the server holds them.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|(k, v)| (&k[..], &v[..]))
    }

    fn field(&self, name: &str) -> Option<&str> {
        let value = self
            .fields
            .iter()
            .find(|(k, _)| k.as_ref() == name.as_bytes())
            .map(|(_, v)| v)?;
        std::str::from_utf8(value).ok()
    }

    /// `XCLAIM <stream> <group> <consumer> 0 <id> IDLE <idle> JUSTID`: the entry stays this
    /// consumer's, its idle time set to `idle`, its delivery count untouched.
    async fn set_idle(&self, idle: Duration) -> Result<(), MqError> {
        let s = &self.shared;
        let idle = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        redis::cmd("XCLAIM")
            .arg(&s.stream)
            .arg(&s.group)
            .arg(&s.consumer)
            .arg(0)
            .arg(&self.id)
            .arg("IDLE")
            .arg(idle)
            .arg("JUSTID")
            .exec_async(&mut s.conn.clone())
            .await
            .map_err(|e| MqError::broker("cannot update the pending entry", e))
    }

    fn ack_cmd(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.shared.stream)
            .arg(&self.shared.group)
            .arg(&self.id);
        cmd
    }

    /// The copy's `XADD`: the fields (body included, under its own name) and why.
    fn dead_letter_cmd(&self, to: &str, dead: &DeadLetter) -> redis::Cmd {
        let s = &self.shared;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(to).arg("*");
        for (name, value) in &self.fields {
            // A copy of a copy: the newest reason only.
            if !name.starts_with(b"idem-") {
                cmd.arg(&name[..]).arg(&value[..]);
            }
        }
        cmd.arg(&s.payload_field[..])
            .arg(&self.payload[..])
            .arg(REASON_FIELD)
            .arg(dead.reason.code())
            .arg(DETAIL_FIELD)
            .arg(crate::text::one_line(&dead.detail, MAX_DETAIL_LEN))
            .arg(STREAM_FIELD)
            .arg(&s.stream)
            .arg(GROUP_FIELD)
            .arg(&s.group)
            .arg(ENTRY_FIELD)
            .arg(&self.id)
            .arg(DELIVERIES_FIELD)
            .arg(self.deliveries);
        cmd
    }

    async fn dead_letter(&self, dead: &DeadLetter) -> Result<(), MqError> {
        let mut conn = self.shared.conn.clone();
        let to = match &self.shared.dead_letter {
            DeadLetterTarget::Stream(to) => to,
            DeadLetterTarget::AckOnly => {
                tracing::warn!(
                    stream = %self.shared.stream,
                    entry = %self.id,
                    reason = dead.reason.code(),
                    "an entry is dead-lettered (acked without a copy)"
                );
                return self.ack_cmd().exec_async(&mut conn).await.map_err(acked);
            }
        };
        if conn.is_cluster() {
            // The two streams may be on two nodes: the copy first, so that a failure leaves
            // the entry pending, to be dead-lettered again.
            self.dead_letter_cmd(to, dead)
                .exec_async(&mut conn)
                .await
                .map_err(|e| MqError::broker("cannot add the copy to the dead-letter stream", e))?;
            return self.ack_cmd().exec_async(&mut conn).await.map_err(acked);
        }
        redis::pipe()
            .atomic()
            .add_command(self.dead_letter_cmd(to, dead))
            .add_command(self.ack_cmd())
            .exec_async(&mut conn)
            .await
            .map_err(|e| MqError::broker("cannot dead-letter the entry", e))
    }
}

fn acked(e: redis::RedisError) -> MqError {
    MqError::broker("cannot acknowledge the entry", e)
}

impl Delivery for RedisStreamDelivery {
    fn message_id(&self) -> Option<&str> {
        match &self.shared.message_id {
            MessageIdFrom::Field(name) => self.field(name),
            MessageIdFrom::EntryId => Some(&self.id),
        }
    }

    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.field(name).map(Cow::Borrowed)
    }

    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.deliveries)
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        self.set_idle(Duration::ZERO).await
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        match how {
            Disposition::Ack => self
                .ack_cmd()
                .exec_async(&mut self.shared.conn.clone())
                .await
                .map_err(acked),
            Disposition::Requeue { delay } => {
                let claim_idle = self.shared.claim_idle;
                self.set_idle(claim_idle.saturating_sub(delay)).await
            }
            Disposition::DeadLetter(dead) => self.dead_letter(&dead).await,
        }
    }
}
