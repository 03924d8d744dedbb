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

/// Sets the idle time of entries (`ARGV[5..]`) that are still this consumer's (`ARGV[2]`) in
/// the group (`ARGV[1]`): `ARGV[3]` is `IDLE` or `TIME`, `ARGV[4]` its value. A plain `XCLAIM`
/// would take back an entry another source has claimed meanwhile. Answers how many it set.
const SET_IDLE: &str = r"
local n = 0
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], ARGV[3], ARGV[4], 'JUSTID')
    n = n + 1
  end
end
return n
";

/// Adds the copy (`ARGV[3..]`, its fields) to the dead-letter stream (`KEYS[2]`), then acks
/// the entry (`ARGV[2]`) in the group (`ARGV[1]`): a script rather than `MULTI`, which would
/// run the `XACK` even when the `XADD` fails (a dead-letter key that is not a stream), and lose
/// the entry.
const DEAD_LETTER: &str = r"
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
";

/// The scripts a source's deliveries call.
pub(super) struct Scripts {
    pub(super) set_idle: redis::Script,
    dead_letter: redis::Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            set_idle: redis::Script::new(SET_IDLE),
            dead_letter: redis::Script::new(DEAD_LETTER),
        }
    }
}

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
    pub(super) scripts: Scripts,
    /// Entries found gone from the stream while pending in the group.
    pub(super) vanished: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// Sets the idle time of those of `ids` that are still this consumer's (see
    /// [`SET_IDLE`]): `how` is `IDLE` (milliseconds) or `TIME` (a Unix time in milliseconds).
    pub(super) async fn set_idle<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a str>,
        how: &str,
        value: u64,
    ) -> Result<(), MqError> {
        let mut call = self.scripts.set_idle.key(&self.stream);
        call.arg(&self.group)
            .arg(&self.consumer)
            .arg(how)
            .arg(value);
        for id in ids {
            call.arg(id);
        }
        call.invoke_async::<i64>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| MqError::broker("cannot update the pending entry", e))
    }
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

    /// How many times the entry has been delivered, this delivery included.
    pub(super) fn deliveries(&self) -> u32 {
        self.deliveries
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

    /// Sets the entry's idle time to `idle`, if it is still this consumer's; its delivery
    /// count is untouched.
    async fn set_idle(&self, idle: Duration) -> Result<(), MqError> {
        let idle = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        self.shared.set_idle([self.id.as_str()], "IDLE", idle).await
    }

    fn ack_cmd(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.shared.stream)
            .arg(&self.shared.group)
            .arg(&self.id);
        cmd
    }

    /// The copy's fields: the entry's (body included, under its own name) and why.
    fn dead_letter_fields(&self, dead: &DeadLetter) -> Vec<Bytes> {
        let s = &self.shared;
        let mut out = Vec::with_capacity(2 * self.fields.len() + 14);
        for (name, value) in &self.fields {
            // A copy of a copy: the newest reason only.
            if !name.starts_with(b"idem-") {
                out.extend([name.clone(), value.clone()]);
            }
        }
        out.extend([s.payload_field.clone(), self.payload.clone()]);
        let why = [
            (REASON_FIELD, dead.reason.code().to_owned()),
            (
                DETAIL_FIELD,
                crate::text::one_line(&dead.detail, MAX_DETAIL_LEN),
            ),
            (STREAM_FIELD, s.stream.clone()),
            (GROUP_FIELD, s.group.clone()),
            (ENTRY_FIELD, self.id.clone()),
            (DELIVERIES_FIELD, self.deliveries.to_string()),
        ];
        for (name, value) in why {
            out.extend([Bytes::from_static(name.as_bytes()), Bytes::from(value)]);
        }
        out
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
        let fields = self.dead_letter_fields(dead);
        if conn.is_cluster() {
            // The two streams may be on two nodes: the copy first, so that a failure leaves
            // the entry pending, to be dead-lettered again.
            let mut add = redis::cmd("XADD");
            add.arg(to).arg("*");
            for field in &fields {
                add.arg(&field[..]);
            }
            add.exec_async(&mut conn)
                .await
                .map_err(|e| MqError::broker("cannot add the copy to the dead-letter stream", e))?;
            return self.ack_cmd().exec_async(&mut conn).await.map_err(acked);
        }
        let mut call = self.shared.scripts.dead_letter.key(&self.shared.stream);
        call.key(to).arg(&self.shared.group).arg(&self.id);
        for field in &fields {
            call.arg(&field[..]);
        }
        call.invoke_async::<i64>(&mut conn)
            .await
            .map(|_| ())
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
