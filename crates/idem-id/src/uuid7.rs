//! UUIDv7 (RFC 9562), monotonic within the process, and random tokens.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use uuid::Uuid;

use crate::ticker::Ticker;

/// Bits of the per-millisecond counter: the 12 bits of `rand_a` and the top 10 of `rand_b`
/// (RFC 9562 §6.2, method 1: a fixed-length counter, seeded at random each millisecond).
const COUNTER_BITS: u32 = 22;
const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// A UUIDv7 generator: each UUID carries the Unix time in milliseconds, then a counter, then
/// 52 random bits, so UUIDs sort by creation time and strictly increase within the process,
/// across threads. Lock-free; the clock is read through the crate's ticker.
///
/// Use [`uuid7`] for the process's generator.
pub struct Uuid7 {
    ticker: &'static Arc<Ticker>,
    /// Unix milliseconds at `base_ms` on the ticker.
    wall_ms: u64,
    base_ms: u64,
    /// `((milliseconds since base + 1) << COUNTER_BITS) | counter` of the last UUID; 0 before
    /// the first, so that the first one starts a fresh millisecond and seeds its counter.
    last: AtomicU64,
}

impl std::fmt::Debug for Uuid7 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uuid7").finish_non_exhaustive()
    }
}

impl Default for Uuid7 {
    fn default() -> Self {
        Self::new()
    }
}

impl Uuid7 {
    /// A generator anchored at the wall clock now; from then on time comes from the monotonic
    /// clock, so a wall clock stepped back does not break the order.
    pub fn new() -> Self {
        let ticker = Ticker::global();
        let wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|d| u64::try_from(d.as_millis()).ok())
            .unwrap_or(0);
        Self {
            ticker,
            wall_ms,
            base_ms: ticker.now_ms(),
            last: AtomicU64::new(0),
        }
    }

    /// The next UUID.
    pub fn next(&self) -> Uuid {
        let offset = self.ticker.now_ms().saturating_sub(self.base_ms) + 1;
        let fresh = offset << COUNTER_BITS;
        let mut last = self.last.load(Ordering::Acquire);
        let stamp = loop {
            let next = if fresh > last {
                // A new millisecond: the counter starts at a random point of its lower half,
                // so a UUID does not tell how many came before it, and there is room to count.
                fresh | (rand::random::<u64>() & (COUNTER_MASK >> 1))
            } else {
                // The same millisecond (or one already borrowed): count on; a full counter
                // carries into the next millisecond.
                last + 1
            };
            match self
                .last
                .compare_exchange_weak(last, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break next,
                Err(actual) => last = actual,
            }
        };
        let ms = u128::from(self.wall_ms + (stamp >> COUNTER_BITS) - 1) & ((1 << 48) - 1);
        let counter = u128::from(stamp & COUNTER_MASK);
        let random = u128::from(rand::random::<u64>() >> 12); // 52 bits
        let bits = (ms << 80)
            | (0x7 << 76)
            | ((counter >> 10) << 64)
            | (0b10 << 62)
            | ((counter & 0x3ff) << 52)
            | random;
        Uuid::from_u128(bits)
    }
}

/// The process's UUIDv7 generator: UUIDs from it strictly increase, across threads.
///
/// ```
/// let a = idem_id::uuid7();
/// let b = idem_id::uuid7();
/// assert!(a < b);
/// assert_eq!(a.get_version_num(), 7);
/// ```
pub fn uuid7() -> Uuid {
    static GENERATOR: OnceLock<Uuid7> = OnceLock::new();
    GENERATOR.get_or_init(Uuid7::new).next()
}

/// An unguessable token: 128 bits from a cryptographically secure generator, as 32 lowercase
/// hex digits (URL-safe). For ids that must not be enumerable.
pub fn token() -> String {
    idem_core::random_hex128()
}
