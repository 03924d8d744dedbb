//! Segment ids (Leaf-segment): ranges of a per-tag counter taken from the store in one atomic
//! step, served from memory, with the next range fetched in the background before the current
//! one runs out.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use idem_core::{DynCounters, Key, SharedCounters};

use crate::IdError;

/// How a [`Segments`] allocator sizes its ranges.
#[derive(Debug, Clone, Copy)]
pub struct SegmentOptions {
    /// The first range's size. Default 1,000.
    pub initial_step: u64,
    /// The smallest and largest range. Default 100 to 1,000,000.
    pub min_step: u64,
    /// See `min_step`.
    pub max_step: u64,
    /// How long a range should last: one used up faster than half this doubles the next
    /// step, one lasting longer than twice this halves it. Default 60 s.
    pub target: Duration,
    /// The next range is fetched once this fraction of the current one is used. Default 0.1
    /// (as in Leaf): nine tenths of a range is the time the store has to answer. Above 1, no
    /// range is fetched ahead.
    pub prefetch_at: f64,
}

impl Default for SegmentOptions {
    fn default() -> Self {
        Self {
            initial_step: 1_000,
            min_step: 100,
            max_step: 1_000_000,
            target: Duration::from_secs(60),
            prefetch_at: 0.1,
        }
    }
}

/// A range of ids owned by this process: `next..=end`.
#[derive(Debug, Clone, Copy)]
struct Range {
    next: u64,
    end: u64,
    size: u64,
    taken_at: Instant,
}

impl Range {
    fn left(&self) -> u64 {
        (self.end + 1).saturating_sub(self.next)
    }
}

/// The segment buffer (Leaf's double buffer): the range ids are taken from, and the one
/// fetched ahead that replaces it when it is used up, so the store is asked before ids run out.
#[derive(Debug)]
struct Buffer {
    current: Option<Range>,
    ahead: Option<Range>,
    fetching: bool,
    /// After a failed fetch, background fetches wait until then.
    retry_at: Option<Instant>,
    step: u64,
    /// Ids served since the allocator began, and when it began: the rate behind `runway`.
    rate_ids: u64,
    rate_since: Instant,
    last_error: Option<String>,
    /// When fetches began to fail (cleared by the next success).
    failing_since: Option<SystemTime>,
}

/// Segment ids for one tag: unique across every process sharing the store, increasing within
/// a process (not across processes). A process that stops loses the rest of its ranges, so ids
/// have gaps, never repeats.
pub struct Segments {
    store: SharedCounters,
    key: Key,
    options: SegmentOptions,
    buffer: Mutex<Buffer>,
    /// Woken when a fetch ends.
    fetched: tokio::sync::Notify,
}

impl std::fmt::Debug for Segments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segments")
            .field("tag", &self.key.client_key())
            .finish_non_exhaustive()
    }
}

impl Segments {
    /// An allocator for `tag` (the counter `idem.ids` / `idem.segment` / `tag` in the store).
    /// The first range is fetched on first use. Only the store's [`Counters`] are used; a
    /// `SharedStore` passes as it is.
    ///
    /// [`Counters`]: idem_core::Counters
    pub fn new(
        store: SharedCounters,
        tag: &str,
        options: SegmentOptions,
    ) -> Result<Arc<Self>, IdError> {
        Self::scoped(store, "idem.ids", tag, options)
    }

    /// An allocator for `tag` within `scope` (a caller's own sequences, as in `idem serve`).
    pub fn scoped(
        store: SharedCounters,
        scope: &str,
        tag: &str,
        options: SegmentOptions,
    ) -> Result<Arc<Self>, IdError> {
        let key =
            Key::parse(scope, "idem.segment", tag).map_err(|e| IdError::Tag(e.to_string()))?;
        let step = options
            .initial_step
            .clamp(options.min_step.max(1), options.max_step.max(1));
        Ok(Arc::new(Self {
            store,
            key,
            options,
            buffer: Mutex::new(Buffer {
                current: None,
                ahead: None,
                fetching: false,
                retry_at: None,
                step,
                rate_ids: 0,
                rate_since: Instant::now(),
                last_error: None,
                failing_since: None,
            }),
            fetched: tokio::sync::Notify::new(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buffer> {
        self.buffer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next id from memory, or `None` when both ranges are used up (then
    /// [`Segments::next`] waits for the store). Starts a background fetch (on the current
    /// Tokio runtime) when the current range is used past `prefetch_at`.
    pub fn try_next(self: &Arc<Self>) -> Option<u64> {
        let mut s = self.lock();
        let id = loop {
            match &mut s.current {
                Some(r) if r.next <= r.end => {
                    let id = r.next;
                    r.next += 1;
                    break Some(id);
                }
                _ => match s.ahead.take() {
                    Some(ahead) => s.current = Some(ahead),
                    None => break None,
                },
            }
        };
        if id.is_some() {
            s.rate_ids += 1;
        }
        let want_ahead = s.ahead.is_none()
            && !s.fetching
            && s.retry_at.is_none_or(|at| Instant::now() >= at)
            && s.current.is_some_and(|r| {
                let used = r.size - r.left();
                used as f64 >= r.size as f64 * self.options.prefetch_at
            });
        if want_ahead
            && let Ok(rt) = tokio::runtime::Handle::try_current()
            && let Some(slot) = self.start_fetch(&mut s)
        {
            drop(s);
            rt.spawn(slot.run());
        }
        id
    }

    /// The next id, fetching a range from the store if memory has none.
    pub async fn next(self: &Arc<Self>) -> Result<u64, IdError> {
        loop {
            if let Some(id) = self.try_next() {
                return Ok(id);
            }
            self.fetch().await?;
        }
    }

    /// Makes sure a range is on its way and waits for it: takes one from the store, or waits
    /// for the fetch already running (only one runs at a time, so no range is taken and then
    /// dropped).
    ///
    /// The fetch runs in a task of its own, not in the caller's future: a caller that goes
    /// away (a client that hung up, a timeout) stops only its own waiting, while the fetch
    /// finishes and fills the slot for the next caller, so the range the store handed out is
    /// not thrown away. The slot is given back by a guard that runs however the fetch ends
    /// (answered, failed, panicked, or dropped with its runtime), so nobody waits for a fetch
    /// that will never end. Without a Tokio runtime the fetch runs in the caller's future,
    /// under the same guard.
    async fn fetch(self: &Arc<Self>) -> Result<(), IdError> {
        let (waiting, slot) = {
            let mut s = self.lock();
            if s.ahead.is_some() {
                return Ok(());
            }
            let slot = self.start_fetch(&mut s);
            // Registered under the lock, which the fetch's end also takes: the wake-up cannot
            // come between this check and the registration.
            let mut waiting = Box::pin(self.fetched.notified());
            waiting.as_mut().enable();
            (waiting, slot)
        };
        if let Some(slot) = slot {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn(slot.run())),
                Err(_) => slot.run().await,
            }
        }
        waiting.await;
        let s = self.lock();
        match &s.last_error {
            Some(e) if s.ahead.is_none() && s.current.is_none_or(|r| r.left() == 0) => {
                Err(IdError::Store(e.clone()))
            }
            _ => Ok(()),
        }
    }

    /// Claims the one fetch slot: the fetch to run, or `None` if one is already running.
    fn start_fetch(self: &Arc<Self>, s: &mut Buffer) -> Option<FetchSlot> {
        if s.fetching || s.ahead.is_some() {
            return None;
        }
        s.fetching = true;
        Some(FetchSlot {
            segments: Arc::clone(self),
            step: s.step,
            ended: false,
        })
    }

    /// Records a fetch's outcome: puts the range where it is needed (the current slot if that
    /// is used up, else the one ahead, which only this fetch fills) and adapts the step to how
    /// fast the last range went; or keeps the error for waiters and for health reports.
    fn end_fetch(&self, step: u64, result: Result<u64, String>) {
        let mut s = self.lock();
        // A counter below the step would make a range below 1: a broken store, not a range.
        let result = result.and_then(|end| {
            end.checked_sub(step)
                .map(|before| (before + 1, end))
                .ok_or_else(|| format!("the store's counter answered {end} for a step of {step}"))
        });
        match result {
            Ok((next, end)) => {
                let range = Range {
                    next,
                    end,
                    size: step,
                    taken_at: Instant::now(),
                };
                // Adapt: how long will the range now running last, at the pace so far?
                if let Some(current) = s.current {
                    let used = (current.size - current.left()).max(1);
                    let lasts = current.taken_at.elapsed().as_secs_f64() * current.size as f64
                        / used as f64;
                    let o = &self.options;
                    if lasts < o.target.as_secs_f64() / 2.0 {
                        s.step = (s.step * 2).min(o.max_step);
                    } else if lasts > o.target.as_secs_f64() * 2.0 {
                        s.step = (s.step / 2).max(o.min_step);
                    }
                }
                if s.current.is_none_or(|r| r.left() == 0) {
                    s.current = Some(range);
                } else {
                    s.ahead = Some(range);
                }
                s.last_error = None;
                s.failing_since = None;
                s.retry_at = None;
            }
            Err(e) => {
                s.last_error = Some(e);
                s.failing_since.get_or_insert_with(SystemTime::now);
                s.retry_at = Some(Instant::now() + Duration::from_millis(100));
            }
        }
        s.fetching = false;
        // Under the lock, as waiters register under it (see `fetch`).
        self.fetched.notify_waiters();
    }

    /// Ids left in memory (the current range and the one ahead).
    pub fn remaining(&self) -> u64 {
        let s = self.lock();
        s.current.map_or(0, |r| r.left()) + s.ahead.map_or(0, |r| r.left())
    }

    /// How long the ids in memory last at the average rate served so far, if the store went
    /// away now (`None` before any id was served).
    pub fn runway(&self) -> Option<Duration> {
        let s = self.lock();
        let left = s.current.map_or(0, |r| r.left()) + s.ahead.map_or(0, |r| r.left());
        let secs = s.rate_since.elapsed().as_secs_f64();
        if s.rate_ids == 0 || secs <= 0.0 {
            return None;
        }
        let rate = s.rate_ids as f64 / secs;
        Some(Duration::from_secs_f64(left as f64 / rate))
    }

    /// The step the next fetch takes.
    pub fn step(&self) -> u64 {
        self.lock().step
    }

    /// Why the last fetch failed, if it did (cleared by the next success).
    pub fn last_error(&self) -> Option<String> {
        self.lock().last_error.clone()
    }

    /// How the allocator stands, for health reports: cheap (no store call).
    pub fn status(&self) -> SegmentStatus {
        let s = self.lock();
        let remaining = s.current.map_or(0, |r| r.left()) + s.ahead.map_or(0, |r| r.left());
        match (&s.last_error, s.failing_since) {
            (Some(reason), Some(since)) => SegmentStatus::Failing {
                since,
                reason: reason.clone(),
                remaining,
            },
            _ => SegmentStatus::Ready { remaining },
        }
    }
}

/// How a [`Segments`] allocator stands ([`Segments::status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SegmentStatus {
    /// The last fetch from the store succeeded (or none was needed yet).
    Ready {
        /// Ids left in memory.
        remaining: u64,
    },
    /// Fetches have failed since `since` (by the wall clock), the last one with `reason`;
    /// ids are served from memory while `remaining` lasts, and the next fetch is tried when
    /// they are asked for.
    Failing {
        /// When the first of the failed fetches ended.
        since: SystemTime,
        /// Why the last one failed.
        reason: String,
        /// Ids left in memory.
        remaining: u64,
    },
}

/// The one fetch slot of a [`Segments`], held by the fetch that runs. However the fetch ends,
/// the slot is given back and waiters are woken: when it ends normally through [`FetchSlot::run`],
/// and otherwise (its task panicked, or was dropped unpolled by a runtime shutting down, or
/// its caller went away when no runtime could run it apart) by `Drop`, as a failure.
struct FetchSlot {
    segments: Arc<Segments>,
    step: u64,
    ended: bool,
}

impl FetchSlot {
    /// Takes a range of `step` from the store (one atomic `advance`) and records it.
    async fn run(mut self) {
        let result = DynCounters::advance(&*self.segments.store, &self.segments.key, self.step)
            .await
            .map_err(|e| e.to_string());
        self.segments.end_fetch(self.step, result);
        self.ended = true;
    }
}

impl Drop for FetchSlot {
    fn drop(&mut self) {
        if !self.ended {
            self.segments.end_fetch(
                self.step,
                Err("the fetch stopped before the store answered".to_owned()),
            );
        }
    }
}
