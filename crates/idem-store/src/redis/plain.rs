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
//! (it sets nothing), or on a Cluster by asking every primary (the path is on only when all of
//! them take the option); a server that refuses the option later (a failover to an older
//! replica, a node replaced) turns the plain path off for good, and every call goes by the
//! script again. The record's layout is the same either way, so instances of both kinds share
//! a server.
//!
//! The locks this instance holds are kept here too (their owner and lease end, by lock key and
//! fence), for releases as plain commands (see `super::locks`), so that a refusal forgets both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use idem_core::{Bytes, Key, Lease, LeaseId, Record, Timestamp};

/// The most claims (and, apart, lock holdings) kept at once; past it, a claim is settled (a
/// lock released) by the script.
const MAX_CLAIMS: usize = 16_384;

/// A record this instance claimed: the record, its Redis key, and the exact value written
/// there (kept, so that a settle neither names the key nor packs the value again).
#[derive(Debug, Clone)]
pub(super) struct Claim {
    pub(super) record: Record,
    pub(super) key: String,
    pub(super) value: Bytes,
}

/// The records this instance claimed and has not settled, the locks it holds, and whether
/// the server takes `SET … IFEQ`.
#[derive(Debug)]
pub(crate) struct Plain {
    enabled: AtomicBool,
    claims: Mutex<HashMap<LeaseId, Claim>>,
    /// By lock key and fence: the holder (its digest in hex) and the lease end its acquire
    /// or renewal wrote (for a plain release; see `super::locks`).
    holdings: Mutex<HashMap<(String, u64), (String, u64)>>,
}

impl Plain {
    /// Plain settles on (`true`: the server takes `SET … IFEQ`) or off.
    pub(super) fn new(enabled: bool) -> Self {
        Self {
            enabled: AtomicBool::new(enabled),
            claims: Mutex::default(),
            holdings: Mutex::default(),
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
        self.holdings().clear();
    }

    /// Notes `claim`, whose record this instance has just written with a plain `SET … NX`
    /// (or `SET … IFEQ`): Redis holds exactly its value until something else writes it.
    pub(super) fn claimed(&self, claim: Claim) {
        if !self.enabled() {
            return;
        }
        let mut claims = self.lock();
        if claims.len() >= MAX_CLAIMS {
            // Claims whose lease has ended were most likely given up on (their caller went
            // away): drop them first. One settled late goes by the script, which decides it
            // the same.
            let now = claim.record.updated_at;
            claims.retain(|_, c| c.record.lease_expires_at > now);
            if claims.len() >= MAX_CLAIMS {
                return;
            }
        }
        claims.insert(claim.record.lease_id, claim);
    }

    /// The record claimed under `lease` at `key`, taken out, if the plain path may settle it
    /// at `now`: the lease and key are the claim's, and the record is still live by `now` (a
    /// record past its retention is the script's to refuse).
    pub(super) fn take(&self, key: &Key, lease: &Lease, now: Timestamp) -> Option<Claim> {
        if !self.enabled() {
            return None;
        }
        let claim = self.lock().remove(&lease.id)?;
        let r = &claim.record;
        (r.fence == lease.fence && r.key == *key && r.is_live(now)).then_some(claim)
    }

    /// Forgets the claim under `lease` (its record is about to change).
    pub(super) fn forget(&self, lease: &Lease) {
        if self.enabled() {
            self.lock().remove(&lease.id);
        }
    }

    /// Notes that the holding of lock `key` under `fence` by `owner` wrote a state whose
    /// lease ends at `expires`. Full, the map drops holdings whose lease has ended by this
    /// process's clock (a hint only: a holding dropped is released by the script).
    pub(super) fn note_holding(&self, key: &str, fence: u64, owner: &str, expires: Timestamp) {
        if !self.enabled() {
            return;
        }
        let mut holdings = self.holdings();
        if holdings.len() >= MAX_CLAIMS {
            let now = Timestamp::now().as_millis();
            holdings.retain(|_, (_, ends)| *ends > now);
            if holdings.len() >= MAX_CLAIMS {
                return;
            }
        }
        let noted = (owner.to_owned(), expires.as_millis());
        holdings.insert((key.to_owned(), fence), noted);
    }

    /// The lease end the holding of lock `key` under `fence` by `owner` wrote, taken out;
    /// `None` (and the note kept) if another owner asks.
    pub(super) fn take_holding(&self, key: &str, fence: u64, owner: &str) -> Option<u64> {
        if !self.enabled() {
            return None;
        }
        let mut holdings = self.holdings();
        let at = (key.to_owned(), fence);
        if holdings.get(&at)?.0 != owner {
            return None;
        }
        holdings.remove(&at).map(|(_, expires)| expires)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseId, Claim>> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn holdings(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u64), (String, u64)>> {
        self.holdings.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether `e` is the server refusing the `IFEQ` option (a server that does not know it
/// answers a syntax error).
pub(super) fn refused_ifeq(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR") && e.to_string().to_ascii_lowercase().contains("syntax")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_core::{BeginRequest, Fingerprint, Key, Lease, LeaseId, Record, Timestamp};

    use super::{Claim, MAX_CLAIMS, Plain};

    /// A record claimed at `now` for `lease`, and its lease.
    fn claim(n: usize, now: Timestamp, lease: Duration) -> (Record, Lease) {
        let key = Key::parse("plain", "claims", &format!("k{n}")).unwrap();
        let req = BeginRequest::new(key, Fingerprint::of_bytes(b"r")).with_lease(lease);
        let (lease, record) =
            Record::acquired(&req, now, Lease::first_fence(now), LeaseId::generate());
        (record, lease)
    }

    impl Plain {
        /// Notes `record` as claimed (its key and value are not needed here).
        fn note(&self, record: &Record) {
            self.claimed(Claim {
                record: record.clone(),
                key: String::new(),
                value: idem_core::Bytes::new(),
            });
        }
    }

    /// Full, the map drops the claims whose lease has ended (and only those) for a new claim;
    /// full of live ones, it keeps them and the new claim is left to the script.
    #[test]
    fn a_full_map_drops_dead_leases_first_and_otherwise_keeps_what_it_has() {
        let plain = Plain::new(true);
        let t0 = Timestamp::from_millis(1_000_000);
        // Every other claim's lease ends within 10 ms, the others' in an hour.
        let mixed: Vec<_> = (0..MAX_CLAIMS)
            .map(|n| {
                let lease = if n % 2 == 0 { 10 } else { 3_600_000 };
                claim(n, t0, Duration::from_millis(lease))
            })
            .collect();
        for (record, _) in &mixed {
            plain.note(record);
        }
        // A claim a minute later: half the leases before it have ended.
        let later = t0.saturating_add(Duration::from_secs(60));
        let (record, lease) = claim(MAX_CLAIMS, later, Duration::from_secs(30));
        plain.note(&record);
        assert_eq!(
            plain.lock().len(),
            MAX_CLAIMS / 2 + 1,
            "the ended claims, and only those, were dropped"
        );
        assert!(plain.take(&record.key, &lease, later).is_some());
        let (live, live_lease) = &mixed[1];
        assert!(plain.take(&live.key, live_lease, later).is_some());

        let plain = Plain::new(true);
        let live: Vec<_> = (0..MAX_CLAIMS)
            .map(|n| claim(n, t0, Duration::from_secs(30)))
            .collect();
        for (record, _) in &live {
            plain.note(record);
        }
        let (extra, extra_lease) = claim(MAX_CLAIMS, t0, Duration::from_secs(30));
        plain.note(&extra);
        assert_eq!(plain.lock().len(), MAX_CLAIMS, "the map holds no more");
        assert!(plain.take(&extra.key, &extra_lease, t0).is_none());
        let (first, first_lease) = &live[0];
        assert!(plain.take(&first.key, first_lease, t0).is_some());
    }

    /// A claim is settled plainly only under its own lease, at its own key, while it lives;
    /// once taken it is gone, and a refusal by the server turns the path off for good.
    #[test]
    fn a_claim_is_taken_once_by_its_own_lease_and_never_after_a_refusal() {
        let plain = Plain::new(true);
        let now = Timestamp::from_millis(1_000_000);
        let (record, lease) = claim(1, now, Duration::from_secs(30));
        let (other, other_lease) = claim(2, now, Duration::from_secs(30));
        plain.note(&record);
        plain.note(&other);
        // Another key under this lease: not this claim (and the claim is dropped).
        assert!(plain.take(&other.key, &lease, now).is_none());
        plain.note(&record);
        let stale = Lease {
            fence: lease.fence + 1,
            ..lease
        };
        assert!(plain.take(&record.key, &stale, now).is_none());
        plain.note(&record);
        // Past its lease but not taken over, the record is still the claim's to settle;
        // past its retention, it is the script's to refuse.
        let ended = lease.expires_at.saturating_add(Duration::from_secs(1));
        assert!(plain.take(&record.key, &lease, ended).is_some());
        plain.note(&record);
        let gone = record.expires_at.saturating_add(Duration::from_secs(1));
        assert!(plain.take(&record.key, &lease, gone).is_none());
        plain.note(&record);
        assert!(plain.take(&record.key, &lease, now).is_some());
        assert!(plain.take(&record.key, &lease, now).is_none(), "taken once");

        plain.disable();
        assert!(!plain.enabled());
        assert!(plain.take(&other.key, &other_lease, now).is_none());
        plain.note(&record);
        assert!(plain.lock().is_empty(), "nothing is kept once off");
    }

    /// A lock holding is taken only by its owner under its fence, once; a refusal by the
    /// server forgets every holding.
    #[test]
    fn a_holding_is_taken_by_its_owner_only_and_forgotten_after_a_refusal() {
        let plain = Plain::new(true);
        let ends = Timestamp::from_millis(2_000_000);
        plain.note_holding("lock:{a}", 7, "aa", ends);
        plain.note_holding("lock:{b}", 8, "aa", ends);
        assert_eq!(
            plain.take_holding("lock:{a}", 7, "bb"),
            None,
            "another owner"
        );
        assert_eq!(
            plain.take_holding("lock:{a}", 6, "aa"),
            None,
            "another fence"
        );
        assert_eq!(
            plain.take_holding("lock:{a}", 7, "aa"),
            Some(ends.as_millis())
        );
        assert_eq!(plain.take_holding("lock:{a}", 7, "aa"), None, "taken once");
        plain.disable();
        assert!(plain.holdings().is_empty());
        plain.note_holding("lock:{c}", 9, "aa", ends);
        assert_eq!(plain.take_holding("lock:{c}", 9, "aa"), None);
    }
}
