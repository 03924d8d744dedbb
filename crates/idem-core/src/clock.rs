//! Time: millisecond timestamps and clocks, including a [`ManualClock`] so expiry can be
//! tested without sleeping.
//!
//! Stores never read a clock themselves: every operation takes `now` from its caller. That keeps
//! the stores deterministic and lets one clock (the engine's) decide what has expired.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (UTC).
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The epoch itself.
    pub const EPOCH: Self = Self(0);
    /// The latest representable instant.
    pub const MAX: Self = Self(u64::MAX);

    /// A timestamp of `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms)
    }

    /// Milliseconds after the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// The current wall-clock time (the epoch if the system clock is set before it).
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// Converts a [`SystemTime`], saturating at both ends.
    pub fn from_system_time(t: SystemTime) -> Self {
        let ms = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        Self(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// Converts to a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> Self {
        Self(self.0.saturating_add(duration_millis(d)))
    }

    /// `self - d`, saturating at the epoch.
    #[must_use]
    pub fn saturating_sub(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(duration_millis(d)))
    }

    /// How long from `earlier` to `self`; zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

/// Whole milliseconds in `d`, saturating at `u64::MAX`.
pub fn duration_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({}ms)", self.0)
    }
}

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that moves only when told to. Clones share one time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self(Arc::new(AtomicU64::new(start.0)))
    }

    /// A clock standing at the current wall-clock time.
    pub fn starting_now() -> Self {
        Self::new(Timestamp::now())
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(duration_millis(d), Ordering::SeqCst);
    }

    /// Sets the clock to `t` (which may be in the past: clocks do step back).
    pub fn set(&self, t: Timestamp) {
        self.0.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new(Timestamp::from_millis(1_000));
        let shared = c.clone();
        assert_eq!(c.now(), Timestamp::from_millis(1_000));
        shared.advance(Duration::from_secs(2));
        assert_eq!(c.now(), Timestamp::from_millis(3_000));
        c.set(Timestamp::from_millis(10));
        assert_eq!(shared.now(), Timestamp::from_millis(10));
    }

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Timestamp::MAX.saturating_add(Duration::MAX), Timestamp::MAX);
        assert_eq!(
            Timestamp::from_millis(5).saturating_since(Timestamp::from_millis(9)),
            Duration::ZERO
        );
        assert_eq!(duration_millis(Duration::MAX), u64::MAX);
    }
}
