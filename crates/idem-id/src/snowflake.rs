//! The Snowflake generator.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::IdError;
use crate::layout::Layout;
use crate::ticker::Ticker;

/// How a [`Snowflake`] behaves.
#[derive(Debug, Clone, Copy)]
pub struct SnowflakeOptions {
    /// How far ahead of the clock the generator may run when a millisecond's sequence is used
    /// up: ids of the next milliseconds are issued at once, up to this far ahead, instead of
    /// waiting. Default 1 s.
    pub max_borrow: Duration,
    /// The time floor: no id is issued with a timestamp below this (milliseconds since the
    /// layout's epoch). Set it above every id issued before (a [`crate::WorkerPool`] keeps it
    /// durably per id space) so a process restarted after the wall clock went back still
    /// issues larger ids. Default 0.
    pub floor_millis: u64,
}

impl Default for SnowflakeOptions {
    fn default() -> Self {
        Self {
            max_borrow: Duration::from_secs(1),
            floor_millis: 0,
        }
    }
}

/// Where the generator's time comes from: the wall clock is read once, when the generator is
/// made, and from then on time is that reading plus the monotonic clock's progress, so a wall
/// clock stepped back (NTP, a VM resumed, an operator) changes nothing.
pub trait TimeSource: Send + Sync {
    /// The wall clock, read once.
    fn wall(&self) -> SystemTime;
    /// Time elapsed since some fixed point (the source's making); never goes backward.
    fn elapsed(&self) -> Duration;
}

/// The system's clocks: the wall clock, and the monotonic clock read through a ticker that
/// makes a read one atomic load (see the crate's notes).
pub struct SystemTimeSource {
    ticker: &'static Arc<Ticker>,
    base_ms: u64,
}

impl std::fmt::Debug for SystemTimeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemTimeSource").finish_non_exhaustive()
    }
}

impl Default for SystemTimeSource {
    fn default() -> Self {
        let ticker = Ticker::global();
        Self {
            ticker,
            base_ms: ticker.now_ms(),
        }
    }
}

impl TimeSource for SystemTimeSource {
    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }
    fn elapsed(&self) -> Duration {
        Duration::from_millis(self.ticker.now_ms().saturating_sub(self.base_ms))
    }
}

/// A Snowflake id generator for one worker id. Cheap to share (`Arc`) between threads; the
/// hot path is one clock read and one compare-and-swap, with no lock.
///
/// Ids are unique and strictly increasing per generator: the last issued time and sequence
/// live in one atomic word, and each id takes the larger of "now, sequence 0" and "the last
/// one plus one". When a millisecond's sequence runs out, the next millisecond is borrowed
/// (up to [`SnowflakeOptions::max_borrow`] ahead of the clock) rather than wrapping or
/// sleeping under a lock.
pub struct Snowflake {
    layout: Layout,
    worker: u64,
    time: Arc<dyn TimeSource>,
    /// The layout's milliseconds when the generator was made.
    anchor_ms: u64,
    /// `time.elapsed()` when the generator was made (a source may be shared, and older).
    anchor_elapsed_ms: u64,
    max_borrow_ms: u64,
    /// `(millis << sequence_bits) | sequence` of the last id issued.
    last: AtomicU64,
    lost: AtomicBool,
    /// No id is issued with a timestamp above this (the worker id's lease end).
    valid_until: AtomicU64,
    /// No id is issued with a timestamp below this (a worker id's new holder waits until any
    /// earlier holder has stopped).
    not_before: AtomicU64,
}

impl std::fmt::Debug for Snowflake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snowflake")
            .field("layout", &self.layout)
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl Snowflake {
    /// A generator for `worker` on the system clocks.
    pub fn new(layout: Layout, worker: u64, options: SnowflakeOptions) -> Result<Self, IdError> {
        Self::with_time(
            layout,
            worker,
            options,
            Arc::new(SystemTimeSource::default()),
        )
    }

    /// A generator on a given time source (for tests, or another clock).
    pub fn with_time(
        layout: Layout,
        worker: u64,
        options: SnowflakeOptions,
        time: Arc<dyn TimeSource>,
    ) -> Result<Self, IdError> {
        layout.encode(0, worker, 0)?;
        let anchor_elapsed_ms = u64::try_from(time.elapsed().as_millis()).unwrap_or(u64::MAX);
        let wall_ms = layout.millis_at(time.wall())?;
        let anchor_ms = wall_ms.max(options.floor_millis);
        if anchor_ms > layout.max_millis() {
            return Err(IdError::LayoutExhausted);
        }
        let floor = options.floor_millis << layout.sequence_bits();
        Ok(Self {
            layout,
            worker,
            time,
            anchor_ms,
            anchor_elapsed_ms,
            max_borrow_ms: u64::try_from(options.max_borrow.as_millis()).unwrap_or(u64::MAX),
            // The first id is at least `floor`.
            last: AtomicU64::new(floor.saturating_sub(1)),
            lost: AtomicBool::new(false),
            valid_until: AtomicU64::new(u64::MAX),
            not_before: AtomicU64::new(0),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The worker id.
    pub fn worker(&self) -> u64 {
        self.worker
    }

    /// Milliseconds since the layout's epoch, by the generator's clock.
    pub fn now_millis(&self) -> u64 {
        let elapsed = u64::try_from(self.time.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.anchor_ms
            .saturating_add(elapsed.saturating_sub(self.anchor_elapsed_ms))
    }

    /// The timestamp of the last id issued (0 before the first): the id space's time floor
    /// must be raised to this for the next generator to start above it.
    pub fn last_millis(&self) -> u64 {
        self.last.load(Ordering::Acquire) >> self.layout.sequence_bits()
    }

    /// Issues no id with a timestamp above `millis` (since the layout's epoch) until told
    /// otherwise: the end of the worker id's lease, moved on at each renewal.
    pub fn set_valid_until(&self, millis: u64) {
        self.valid_until.store(millis, Ordering::Release);
    }

    /// The last millisecond ids may be stamped with (see [`Snowflake::set_valid_until`]).
    pub(crate) fn valid_until(&self) -> u64 {
        self.valid_until.load(Ordering::Acquire)
    }

    /// Moves the last millisecond ids may be stamped with up to `millis`, never down.
    pub(crate) fn extend_valid_until(&self, millis: u64) {
        self.valid_until.fetch_max(millis, Ordering::AcqRel);
    }

    /// Issues no id with a timestamp below `millis` (since the layout's epoch): the first
    /// millisecond a worker id's new holder may stamp.
    pub(crate) fn set_not_before(&self, millis: u64) {
        self.not_before.store(millis, Ordering::Release);
    }

    /// The first millisecond ids may be stamped with (see [`Snowflake::set_not_before`]).
    pub(crate) fn not_before(&self) -> u64 {
        self.not_before.load(Ordering::Acquire)
    }

    /// Whether the worker id was marked lost.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Marks the worker id as lost (its lease ran out or was taken): from now on every call
    /// fails with [`IdError::WorkerLost`].
    pub fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// The next id, or why there is none. Never blocks.
    pub fn try_next(&self) -> Result<u64, IdError> {
        let start = self.reserve(1)?;
        Ok(self.id_of(start))
    }

    /// The next id, waiting (without holding any lock) while ids are asked for faster than
    /// the layout allows for longer than the borrowing bound, and while a worker id's new
    /// holder waits for its first millisecond ([`IdError::Starting`]).
    pub fn next(&self) -> Result<u64, IdError> {
        loop {
            match self.try_next() {
                Err(IdError::Exhausted { retry_after } | IdError::Starting { retry_after }) => {
                    std::thread::sleep(retry_after);
                }
                other => return other,
            }
        }
    }

    /// Reserves `n` ids in one step (fewer than the layout issues within the borrowing bound),
    /// at the cost of one id.
    pub fn try_next_batch(&self, n: u32) -> Result<Batch, IdError> {
        if n == 0 {
            return Ok(Batch {
                generator_layout: self.layout,
                worker: self.worker,
                next: 0,
                remaining: 0,
            });
        }
        let start = self.reserve(u64::from(n))?;
        Ok(Batch {
            generator_layout: self.layout,
            worker: self.worker,
            next: start,
            remaining: n,
        })
    }

    fn id_of(&self, stamp: u64) -> u64 {
        let bits = self.layout.sequence_bits();
        self.layout.pack(
            stamp >> bits,
            self.worker,
            stamp & self.layout.max_sequence(),
        )
    }

    /// Takes `n` stamps `(millis << sequence_bits) | sequence` after the last one; returns the
    /// first.
    fn reserve(&self, n: u64) -> Result<u64, IdError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(IdError::WorkerLost);
        }
        let bits = self.layout.sequence_bits();
        let now = self.now_millis();
        if now > self.layout.max_millis() {
            return Err(IdError::LayoutExhausted);
        }
        let not_before = self.not_before.load(Ordering::Acquire);
        if now < not_before {
            return Err(IdError::Starting {
                retry_after: Duration::from_millis(not_before - now),
            });
        }
        let now_stamp = now << bits;
        let mut last = self.last.load(Ordering::Acquire);
        loop {
            let first = now_stamp.max(last.wrapping_add(1));
            let end = first + (n - 1);
            let end_ms = end >> bits;
            if end_ms > self.layout.max_millis() {
                return Err(IdError::LayoutExhausted);
            }
            if end_ms > self.valid_until.load(Ordering::Acquire) {
                return Err(IdError::LeaseExpired);
            }
            let limit = now.saturating_add(self.max_borrow_ms);
            if end_ms > limit {
                let ahead = end_ms - limit;
                return Err(IdError::Exhausted {
                    retry_after: Duration::from_millis(ahead),
                });
            }
            match self
                .last
                .compare_exchange_weak(last, end, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(first),
                Err(actual) => last = actual,
            }
        }
    }
}

/// Ids reserved together by [`Snowflake::try_next_batch`], in increasing order.
#[derive(Debug, Clone)]
pub struct Batch {
    generator_layout: Layout,
    worker: u64,
    next: u64,
    remaining: u32,
}

impl Batch {
    /// The worker id the batch's ids carry.
    pub fn worker(&self) -> u64 {
        self.worker
    }
}

impl Iterator for Batch {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.remaining == 0 {
            return None;
        }
        let stamp = self.next;
        self.next += 1;
        self.remaining -= 1;
        let l = &self.generator_layout;
        Some(l.pack(
            stamp >> l.sequence_bits(),
            self.worker,
            stamp & l.max_sequence(),
        ))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.remaining).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}
