//! Segment ids (Leaf-segment): ranges of a per-tag counter taken from the store in one atomic
//! step, served from memory, with the next range fetched in the background before the current
//! one runs out.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{Key, SharedStore, Store};

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

#[derive(Debug)]
struct State {
    current: Option<Range>,
    spare: Option<Range>,
    fetching: bool,
    /// After a failed fetch, background fetches wait until then.
    retry_at: Option<Instant>,
    step: u64,
    /// Ids served since the allocator began, and when it began: the rate behind `runway`.
    rate_ids: u64,
    rate_since: Instant,
    last_error: Option<String>,
}

/// Segment ids for one tag: unique across every process sharing the store, increasing within
/// a process (not across processes). A process that stops loses the rest of its ranges, so ids
/// have gaps, never repeats.
pub struct Segments {
    store: SharedStore,
    key: Key,
    options: SegmentOptions,
    state: Mutex<State>,
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
    /// The first range is fetched on first use.
    pub fn new(
        store: SharedStore,
        tag: &str,
        options: SegmentOptions,
    ) -> Result<Arc<Self>, IdError> {
        Self::scoped(store, "idem.ids", tag, options)
    }

    /// An allocator for `tag` within `scope` (a caller's own sequences, as in `idem serve`).
    pub fn scoped(
        store: SharedStore,
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
            state: Mutex::new(State {
                current: None,
                spare: None,
                fetching: false,
                retry_at: None,
                step,
                rate_ids: 0,
                rate_since: Instant::now(),
                last_error: None,
            }),
            fetched: tokio::sync::Notify::new(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
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
                _ => match s.spare.take() {
                    Some(spare) => s.current = Some(spare),
                    None => break None,
                },
            }
        };
        if id.is_some() {
            s.rate_ids += 1;
        }
        let want_spare = s.spare.is_none()
            && !s.fetching
            && s.retry_at.is_none_or(|at| Instant::now() >= at)
            && s.current.is_some_and(|r| {
                let used = r.size - r.left();
                used as f64 >= r.size as f64 * self.options.prefetch_at
            });
        if want_spare && let Some(step) = Self::start_fetch(&mut s) {
            drop(s);
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let this = Arc::clone(self);
                    rt.spawn(async move {
                        let _ = this.run_fetch(step).await;
                    });
                }
                Err(_) => self.end_fetch(&mut self.lock()),
            }
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

    /// Makes sure a range is on its way: takes one from the store, or waits for the fetch
    /// already running (only one runs at a time, so no range is taken and then dropped).
    async fn fetch(self: &Arc<Self>) -> Result<(), IdError> {
        enum Then<'a> {
            Done,
            Fetch(u64),
            Wait(std::pin::Pin<Box<tokio::sync::futures::Notified<'a>>>),
        }
        let then = {
            let mut s = self.lock();
            if s.spare.is_some() {
                Then::Done
            } else if let Some(step) = Self::start_fetch(&mut s) {
                Then::Fetch(step)
            } else {
                // Registered before the lock is let go, so the fetch's end cannot be missed.
                let mut waiting = Box::pin(self.fetched.notified());
                waiting.as_mut().enable();
                Then::Wait(waiting)
            }
        };
        let waiting = match then {
            Then::Done => return Ok(()),
            Then::Fetch(step) => return self.run_fetch(step).await,
            Then::Wait(w) => w,
        };
        waiting.await;
        let s = self.lock();
        match &s.last_error {
            Some(e) if s.spare.is_none() && s.current.is_none_or(|r| r.left() == 0) => {
                Err(IdError::Store(e.clone()))
            }
            _ => Ok(()),
        }
    }

    /// Claims the one fetch slot; the step to take, or `None` if a fetch is already running.
    fn start_fetch(s: &mut State) -> Option<u64> {
        if s.fetching || s.spare.is_some() {
            return None;
        }
        s.fetching = true;
        Some(s.step)
    }

    /// Gives the fetch slot back and wakes whoever waits for it.
    fn end_fetch(&self, s: &mut State) {
        s.fetching = false;
        self.fetched.notify_waiters();
    }

    /// Takes a range of `step` from the store (one atomic `advance`), puts it where it is
    /// needed (the current slot if that is used up, else the spare one, which only this fetch
    /// fills), and adapts the step to how fast the last range went.
    async fn run_fetch(self: &Arc<Self>, step: u64) -> Result<(), IdError> {
        let result = self.store.advance(&self.key, step).await;
        let mut s = self.lock();
        let answer = match result {
            Ok(end) => {
                let range = Range {
                    next: end - step + 1,
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
                    s.spare = Some(range);
                }
                s.last_error = None;
                s.retry_at = None;
                Ok(())
            }
            Err(e) => {
                s.last_error = Some(e.to_string());
                s.retry_at = Some(Instant::now() + Duration::from_millis(100));
                Err(e.into())
            }
        };
        self.end_fetch(&mut s);
        answer
    }

    /// Ids left in memory (current and spare ranges).
    pub fn remaining(&self) -> u64 {
        let s = self.lock();
        s.current.map_or(0, |r| r.left()) + s.spare.map_or(0, |r| r.left())
    }

    /// How long the ids in memory last at the average rate served so far, if the store went
    /// away now (`None` before any id was served).
    pub fn runway(&self) -> Option<Duration> {
        let s = self.lock();
        let left = s.current.map_or(0, |r| r.left()) + s.spare.map_or(0, |r| r.left());
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
}
