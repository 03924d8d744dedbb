//! What a connection is doing (a request head on its way, requests in flight, idle), shared by
//! the connection's timers and the requests it carries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Bite, Limits};

/// What a connection is doing, for the header and idle timeouts.
pub(super) struct Activity {
    pub(super) state: Mutex<Phase>,
    pub(super) changed: Notify,
    /// Set to close the connection to make room for a newer one.
    pub(super) evicted: AtomicBool,
}

pub(super) struct Phase {
    pub(super) in_flight: usize,
    /// Whether a request head is on its way (bytes arrived, or the connection is new).
    pub(super) head: bool,
    pub(super) since: Instant,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self {
            // A new connection owes its first request head.
            state: Mutex::new(Phase {
                in_flight: 0,
                head: true,
                since: Instant::now(),
            }),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
        }
    }

    /// Whether closing the connection drops no request.
    pub(super) fn evictable(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_flight
            == 0
    }

    pub(super) fn evict(&self) {
        self.evicted.store(true, Ordering::Relaxed);
        self.changed.notify_one();
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut Phase) -> bool) {
        let changed = f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
        if changed {
            self.changed.notify_one();
        }
    }

    pub(super) fn received(&self) {
        self.update(|p| {
            let starts = p.in_flight == 0 && !p.head;
            if starts {
                p.head = true;
                p.since = Instant::now();
            }
            starts
        });
    }

    pub(super) fn request_started(&self) {
        self.update(|p| {
            p.in_flight += 1;
            p.head = false;
            true
        });
    }

    pub(super) fn request_finished(&self) {
        self.update(|p| {
            p.in_flight = p.in_flight.saturating_sub(1);
            if p.in_flight == 0 {
                p.since = Instant::now();
            }
            true
        });
    }

    /// When the connection is to be closed if nothing changes, and why.
    pub(super) fn deadline(&self, limits: &Limits) -> (Option<Instant>, Bite) {
        let p = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if p.in_flight > 0 {
            (None, Bite::Idle)
        } else if p.head {
            (Some(p.since + limits.header_timeout), Bite::Header)
        } else {
            (Some(p.since + limits.idle_timeout), Bite::Idle)
        }
    }
}
