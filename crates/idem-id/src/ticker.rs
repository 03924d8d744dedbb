//! A millisecond clock that costs one atomic load to read.
//!
//! Reading the monotonic clock costs 20 to 40 ns on common virtual machines, more than the
//! rest of an id. While ids are being made, a background thread stores the elapsed
//! milliseconds in an atomic every millisecond, and readers load it. After a second without
//! readers the thread parks; the next reader reads the clock itself and wakes it. Values never
//! go backward, and lag the clock by at most about a millisecond.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Milliseconds since the ticker was made, cheaply.
pub(crate) struct Ticker {
    anchor: Instant,
    ms: AtomicU64,
    /// Whether the thread is ticking (readers may trust `ms`).
    awake: AtomicBool,
    /// Whether anyone read since the last tick.
    read: AtomicBool,
    thread: OnceLock<Thread>,
}

/// How many ticks without a reader before the thread parks.
const IDLE_TICKS: u32 = 1000;

impl Ticker {
    /// The process's ticker (started on first use).
    pub(crate) fn global() -> &'static Arc<Ticker> {
        static TICKER: OnceLock<Arc<Ticker>> = OnceLock::new();
        TICKER.get_or_init(|| {
            let ticker = Arc::new(Ticker {
                anchor: Instant::now(),
                ms: AtomicU64::new(0),
                awake: AtomicBool::new(false),
                read: AtomicBool::new(false),
                thread: OnceLock::new(),
            });
            let t = ticker.clone();
            let spawned = std::thread::Builder::new()
                .name("idem-id-ticker".into())
                .spawn(move || t.run());
            if let Ok(handle) = spawned {
                let _ = ticker.thread.set(handle.thread().clone());
            }
            ticker
        })
    }

    /// Milliseconds since the ticker's anchor.
    pub(crate) fn now_ms(&self) -> u64 {
        if self.awake.load(Ordering::Acquire) {
            // A load, and a store only the first time since the last tick.
            if !self.read.load(Ordering::Relaxed) {
                self.read.store(true, Ordering::Relaxed);
            }
            return self.ms.load(Ordering::Acquire);
        }
        // Parked (or not started): read the clock, and wake the thread for the next reader.
        let now = self.elapsed_ms();
        let ms = self.ms.fetch_max(now, Ordering::AcqRel).max(now);
        self.read.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
        ms
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.anchor.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn run(&self) {
        let mut idle = 0;
        loop {
            self.ms.fetch_max(self.elapsed_ms(), Ordering::AcqRel);
            self.awake.store(true, Ordering::Release);
            std::thread::sleep(Duration::from_millis(1));
            if self.read.swap(false, Ordering::Relaxed) {
                idle = 0;
            } else {
                idle += 1;
            }
            if idle >= IDLE_TICKS {
                self.awake.store(false, Ordering::Release);
                // A reader that saw `awake` just before it was cleared read a value at most a
                // tick old; the next ones read the clock and unpark.
                std::thread::park();
                idle = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_follows_the_clock_and_never_goes_back() {
        let t = Ticker::global();
        let start = Instant::now();
        let first = t.now_ms();
        let mut last = first;
        // Until it has moved 10 ms on (the bound only keeps a broken ticker from hanging).
        while last - first < 10 && start.elapsed() < Duration::from_secs(10) {
            let now = t.now_ms();
            assert!(now >= last);
            last = now;
        }
        assert!(last - first >= 10, "the ticker did not advance");
    }
}
