//! What the service itself does wrong on purpose: it stops (as a crashed process would) after
//! committing, before answering, and it takes its time.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// What the service itself does wrong on purpose: it stops (as a crashed process would) after
/// committing, before answering, and it takes its time.
#[derive(Debug)]
pub struct ServerChaos {
    crash: f64,
    pause_ms: u64,
    rng: Mutex<StdRng>,
}

impl ServerChaos {
    /// No failures, no pauses.
    pub fn off() -> Self {
        Self::new(0.0, 0, 0)
    }

    /// Fails after committing with probability `crash`; pauses up to `pause_ms` inside each
    /// operation.
    pub fn new(crash: f64, pause_ms: u64, seed: u64) -> Self {
        Self {
            crash: crash.clamp(0.0, 1.0),
            pause_ms,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
        }
    }

    fn roll(&self) -> (bool, u64) {
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        let crash = rng.random_bool(self.crash);
        let pause = if self.pause_ms == 0 {
            0
        } else {
            rng.random_range(0..=self.pause_ms)
        };
        (crash, pause)
    }

    /// Takes its time.
    pub(crate) async fn pause(&self) {
        let (_, ms) = self.roll();
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// Whether to fail now, after the work committed.
    pub(crate) fn crashes(&self) -> bool {
        self.roll().0
    }

    /// Whether the other bank's answer to a call is lost, and when: three times as often as
    /// the service stops, half of them before the bank took the wire, half after.
    pub(crate) fn bank_timeout(&self) -> Option<BankTimeout> {
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        if !rng.random_bool((self.crash * 3.0).min(1.0)) {
            return None;
        }
        Some(if rng.random_bool(0.5) {
            BankTimeout::Before
        } else {
            BankTimeout::After
        })
    }
}

/// When a call to the other bank times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BankTimeout {
    /// Before the bank took the wire: nothing happened there.
    Before,
    /// After the bank took the wire: it happened, and the caller does not know.
    After,
}
