//! Settles as plain commands, on servers that compare and set a value (`SET … IFEQ`: Valkey
//! 8.1 and later, Redis 8.4 and later).
//!
//! A record this instance claimed with the plain `SET … NX` holds exactly the value it wrote
//! until something else writes it: a step, a renewal, a settle, a takeover, an operator's
//! repair all change it (a step moves `updated_at` forward even within the claim's
//! millisecond, for this). So the claimer knows the value Redis holds, and can complete,
//! release or renew the record with one `SET key next IFEQ claimed PX ttl`: the server writes
//! `next` exactly when the record is still as claimed, which is when the settle script would
//! have written the same `next` (the record holds the lease, it is live, it has no steps).
//! Any other answer (`nil`: the record moved on) leaves the call to the script, which decides
//! it as always. A takeover's record is settled by the script: it may carry the steps of the
//! attempts before, whose key must follow the record's deadline.
//!
//! What the server can do is asked once at connect, by a `SET … IFEQ` on a key no record uses
//! (it sets nothing); a server that refuses the option later (a failover to an older replica)
//! turns the plain path off for good, and every call goes by the script again. The record's
//! layout is the same either way, so instances of both kinds share a server.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use idem_core::{Key, Lease, LeaseId, Record, Timestamp};

/// The most claims kept at once; past it, a claim is settled by the script.
const MAX_CLAIMS: usize = 16_384;

/// The records this instance claimed and has not settled, and whether the server takes
/// `SET … IFEQ`.
#[derive(Debug)]
pub(crate) struct Plain {
    enabled: AtomicBool,
    claims: Mutex<HashMap<LeaseId, Record>>,
}

impl Plain {
    /// Plain settles on (`true`: the server takes `SET … IFEQ`) or off.
    pub(super) fn new(enabled: bool) -> Self {
        Self {
            enabled: AtomicBool::new(enabled),
            claims: Mutex::default(),
        }
    }

    /// Whether settles go as plain commands.
    pub(super) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// The server refused `IFEQ`: every settle goes by the script from now on.
    pub(super) fn disable(&self) {
        if self.enabled.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "the Redis server refused SET … IFEQ; settling records with scripts from now on"
            );
        }
        self.lock().clear();
    }

    /// Notes `record`, which this instance has just written with a plain `SET … NX`: Redis
    /// holds exactly `pack(record)` under it until something else writes it.
    pub(super) fn claimed(&self, record: &Record) {
        if !self.enabled() {
            return;
        }
        let mut claims = self.lock();
        if claims.len() >= MAX_CLAIMS {
            // Leases given up on (their caller went away) are dead by now: drop them first.
            let now = record.updated_at;
            claims.retain(|_, r| r.is_live(now));
            if claims.len() >= MAX_CLAIMS {
                return;
            }
        }
        claims.insert(record.lease_id, record.clone());
    }

    /// The record claimed under `lease` at `key`, taken out, if the plain path may settle it
    /// at `now`: the lease and key are the claim's, and the record is still live by `now` (a
    /// record past its retention is the script's to refuse).
    pub(super) fn take(&self, key: &Key, lease: &Lease, now: Timestamp) -> Option<Record> {
        if !self.enabled() {
            return None;
        }
        let claimed = self.lock().remove(&lease.id)?;
        (claimed.fence == lease.fence && claimed.key == *key && claimed.is_live(now))
            .then_some(claimed)
    }

    /// Forgets the claim under `lease` (its record is about to change).
    pub(super) fn forget(&self, lease: &Lease) {
        if self.enabled() {
            self.lock().remove(&lease.id);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseId, Record>> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether `e` is the server refusing the `IFEQ` option (a server that does not know it
/// answers a syntax error).
pub(super) fn refused_ifeq(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR") && e.to_string().to_ascii_lowercase().contains("syntax")
}
