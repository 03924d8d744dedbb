//! Answers the store has not taken yet: the memory they may hold, bounded in bytes, and what
//! goes on offering them to the store once the caller has been answered.
//!
//! A store that stalls (a paused server, a half-open connection) takes nothing and refuses
//! nothing. Every answer sent to it then sits in its connection's buffers, and every retry
//! of the send would put another copy beside it. So an answer is charged to a byte budget
//! before it is sent, until the store has answered for it (the copy in the connection, then
//! the one kept to offer again); a request waits for room, and for the store, at most the
//! store timeout each. A background retry asks the store a small question first (the
//! record's `get`) and sends the answer again only once that is answered, so a stuck
//! connection is fed a few bytes, not the answer again and again. The memory a stall costs
//! is then the budget (and the store client's own copy of what it holds), beside the answers
//! of requests in flight, which the same load holds anyway.
//!
//! An answer that could not be kept (no room, or still unstored when its lease and a grace
//! period have ended) is never given up for a rerun: its record is marked as an unknown
//! outcome instead, a few bytes offered until the store takes them or another attempt is
//! found holding the key. The handler ran; the record says its answer is lost.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{Key, Lease, LeaseError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Config;
use crate::metrics::count_settled;
use crate::policy::OnUnknown;
use crate::stored::Stored;

/// The default budget for answers the store has not taken yet: 64 MiB.
pub const DEFAULT_UNSTORED_BYTES: usize = 64 << 20;

/// The gauge of the bytes of answers kept to offer to the store again.
pub(crate) const KEPT_GAUGE: &str = "idem_http_unstored_kept_bytes";

/// How many records marked as unknown outcomes may wait for the store at once (each holds
/// its key and lease, a few hundred bytes); past it, a record left unmarked waits for its
/// lease to end, as after a crash.
const MARKS: usize = 16_384;

/// How long after its lease ends an answer is still offered to the store, whole, before only
/// the mark of an unknown outcome is.
const LATE_GRACE: Duration = Duration::from_secs(30);

/// The memory the answers a store has not taken yet may hold, shared by every route that is
/// given it (the gateway gives one to all its routes). Counted in KiB.
#[derive(Clone, Debug)]
pub struct UnstoredAnswers {
    kib: Arc<Semaphore>,
    marks: Arc<Semaphore>,
}

impl UnstoredAnswers {
    /// A budget of `bytes` (at least 1 MiB, at most 4 TiB) for answers waiting for the store.
    pub fn new(bytes: usize) -> Self {
        let limit = bytes.clamp(1 << 20, 1 << 42);
        Self {
            kib: Arc::new(Semaphore::new(limit >> 10)),
            marks: Arc::new(Semaphore::new(MARKS)),
        }
    }

    /// Room for `len` bytes, waited for at most `wait`; `None` when there is none by then.
    pub(crate) async fn room(&self, len: usize, wait: Duration) -> Option<OwnedSemaphorePermit> {
        let kib = u32::try_from(len.div_ceil(1024).max(1)).ok()?;
        // With room, as nearly always: no timer, no clock read.
        if let Ok(room) = self.kib.clone().try_acquire_many_owned(kib) {
            return Some(room);
        }
        tokio::time::timeout(wait, self.kib.clone().acquire_many_owned(kib))
            .await
            .ok()?
            .ok()
    }
}

impl Default for UnstoredAnswers {
    fn default() -> Self {
        Self::new(DEFAULT_UNSTORED_BYTES)
    }
}

/// What an unknown outcome's record keeps until: held for an operator, or released once the
/// lease ends, as the policy says.
pub(crate) fn unknown_until(cfg: &Config, lease: &Lease) -> Stored {
    Stored::Unknown {
        until: match cfg.policy.on_unknown {
            OnUnknown::Hold => None,
            OnUnknown::ReleaseAfterLease => Some(lease.expires_at),
        },
    }
}

/// Goes on offering `response` (charged to `room`) to the store, in a task of its own, so the
/// caller's answer does not wait: every 100 ms doubling to 2 s, a `get` of the record first
/// and the answer only once that is answered, until it is stored or another attempt holds the
/// key. Past [`LATE_GRACE`] after the lease, the answer is dropped and the record marked an
/// unknown outcome instead ([`mark_unknown`]).
pub(crate) fn complete_later(
    cfg: &Arc<Config>,
    key: &Key,
    lease: &Lease,
    response: Bytes,
    kind: &'static str,
    room: OwnedSemaphorePermit,
) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        count_settled("failed");
        return;
    };
    let (cfg, key, lease) = (cfg.clone(), key.clone(), *lease);
    let kept = Kept::new(response.len());
    rt.spawn(async move {
        let (_room, _kept) = (room, kept);
        let mut pause = Duration::from_millis(100);
        loop {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
            let now = cfg.clock.now();
            if now >= lease.expires_at.saturating_add(LATE_GRACE) {
                tracing::warn!(
                    key = %key.log_tag(),
                    fence = lease.fence,
                    "the store did not take an answer within its lease; marking the outcome unknown"
                );
                drop((_room, _kept));
                mark_unknown(&cfg, &key, &lease);
                return;
            }
            let asked = tokio::time::timeout(cfg.store_timeout, cfg.store.get(&key, now)).await;
            if !matches!(asked, Ok(Ok(_))) {
                continue;
            }
            if offer(&cfg, &key, &lease, &response, kind).await {
                return;
            }
        }
    });
}

/// An answer kept after its caller was answered, counted in the gauge
/// `idem_http_unstored_kept_bytes` (every budget of the process together) until dropped,
/// however its task ends.
struct Kept(f64);

impl Kept {
    fn new(len: usize) -> Self {
        // An answer's length is far below f64's exact integers (2^53).
        #[allow(clippy::cast_precision_loss)]
        let len = len as f64;
        metrics::gauge!(KEPT_GAUGE).increment(len);
        Self(len)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        metrics::gauge!(KEPT_GAUGE).decrement(self.0);
    }
}

/// Offers `stored` to the store once, within the store timeout; `true` once that settles it
/// (stored, another attempt holds the key, or a failure that will not pass), counted and
/// logged; `false` when it is worth offering again.
async fn offer(cfg: &Config, key: &Key, lease: &Lease, stored: &Bytes, kind: &'static str) -> bool {
    let now = cfg.clock.now();
    let sent = tokio::time::timeout(
        cfg.store_timeout,
        cfg.store.complete(key, lease, stored.clone(), now),
    )
    .await;
    match sent {
        Ok(Ok(())) => count_settled(kind),
        Ok(Err(LeaseError::Stale(_))) => count_settled("overtaken"),
        Ok(Err(LeaseError::Store(e))) if e.is_transient() => return false,
        Err(_) => return false,
        Ok(Err(e)) => {
            count_settled("failed");
            tracing::warn!(key = %key.log_tag(), error = %e, "could not settle the record");
        }
    }
    true
}

/// Marks the record an unknown outcome, in a task of its own: the mark is a few bytes, offered
/// every 100 ms doubling to 1 s, each within the store timeout, until the store takes it or
/// another attempt is found holding the key. At most [`MARKS`] at once.
pub(crate) fn mark_unknown(cfg: &Arc<Config>, key: &Key, lease: &Lease) {
    let (Ok(permit), Ok(rt)) = (
        cfg.unstored.marks.clone().try_acquire_owned(),
        tokio::runtime::Handle::try_current(),
    ) else {
        count_settled("failed");
        tracing::warn!(
            key = %key.log_tag(),
            "could not store the answer, nor mark it unknown; the key is held until its lease ends"
        );
        return;
    };
    let (cfg, key, lease) = (cfg.clone(), key.clone(), *lease);
    let mark = unknown_until(&cfg, &lease).encode();
    rt.spawn(async move {
        let _permit = permit;
        let mut pause = Duration::from_millis(100);
        while !offer(&cfg, &key, &lease, &mark, "unknown").await {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    });
}
