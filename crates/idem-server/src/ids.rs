//! Id endpoints, for services in other languages (as Leaf is used):
//!
//! | method and path | what it answers |
//! | --- | --- |
//! | `GET /v1/ids/uuid7?count=N` | `{"ids":["0193…",…]}`: UUIDv7, strictly increasing |
//! | `GET /v1/ids/snowflake?count=N` | `{"ids":[…],"id_strings":["…"],"worker":W}`: 64-bit ids as JSON numbers and, since JavaScript loses precision above 2^53, as strings |
//! | `GET /v1/ids/segment/{tag}?count=N` | `{"ids":[…],"id_strings":["…"]}`: the caller's own sequence `tag` (Leaf-segment), increasing per server |
//!
//! A caller holds at most [`TAGS_PER_SCOPE`] segment tags at a time (its scope's quota), and
//! the server [`MAX_TAGS`] of all callers (see [`SegmentLimits`]). A tag unused for
//! [`TAG_IDLE_AFTER`] is idle, and its slot may be given to a new tag: it loses the rest of its
//! ranges (its ids skip a gap, never repeat). A new tag of a caller at its quota with no idle
//! tag is 429 `tag_quota_exceeded`; other callers are not affected.
//!
//! `count` is 1 (the default) to [`MAX_COUNT`]; anything else is 400 `invalid_count`. The
//! server leases its Snowflake worker id from its store and keeps it (see
//! `idem_id::ManagedSnowflake`); while it holds none, and while an earlier holder of the one
//! it claimed may still stamp (at most `idem_id::ISSUE_WINDOW`, 3 s; none for a worker id
//! never held, released cleanly, or whose holder's lease ran out), the Snowflake endpoint
//! answers 503 `no_worker_id` with a `Retry-After`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{RawQuery, State};
use idem_http::{Problem, ProblemCode, ToProblem};
use idem_id::{Batch, IdError, ManagedSnowflake};

use crate::AppState;
use crate::answers::{SegmentIds, SnowflakeIds, Uuid7Ids};
use crate::auth::Caller;
use idem_ops::json::PathParams;

/// The most ids one request may ask for.
pub const MAX_COUNT: u32 = 1000;

/// The most segment tags one server serves, of all callers together (each holds two ranges
/// in memory); see [`SegmentLimits::total`].
pub const MAX_TAGS: usize = 1024;

/// The most segment tags one caller (one scope) may hold at a time; see
/// [`SegmentLimits::per_scope`].
pub const TAGS_PER_SCOPE: usize = 64;

/// How long a tag may go unused before its slot may be given to a new one; see
/// [`SegmentLimits::idle_after`].
pub const TAG_IDLE_AFTER: Duration = Duration::from_secs(10 * 60);

/// Bounds on the segment tags a server keeps in memory.
///
/// A tag's allocator holds the rest of its ranges. Dropping it (evicting the tag) loses them:
/// the next request for the tag fetches a new range above every id issued, so ids skip a gap
/// but never repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLimits {
    /// The most tags one caller may hold. A caller at its quota that asks for a new tag has
    /// its own tags idle longer than [`idle_after`](Self::idle_after) evicted; if none is,
    /// it is refused with 429 `tag_quota_exceeded`, and nobody else is.
    pub per_scope: usize,
    /// The most tags of all callers together, a last resort for memory. When full, the least
    /// recently used tag no request is using, whoever it belongs to, makes room; only a table
    /// whose every tag is in use refuses, with 503 `too_many_tags`.
    pub total: usize,
    /// How long a tag goes unused before it counts as idle.
    pub idle_after: Duration,
}

impl Default for SegmentLimits {
    fn default() -> Self {
        Self {
            per_scope: TAGS_PER_SCOPE,
            total: MAX_TAGS,
            idle_after: TAG_IDLE_AFTER,
        }
    }
}

/// A caller's scope and a tag.
type ScopedTag = (String, String);

/// A tag's allocator and when it was last asked for.
struct Slot {
    segments: Arc<idem_id::Segments>,
    used: Instant,
}

impl Slot {
    /// Whether a request (or a range fetch it started) is using the allocator right now: the
    /// table's is then not its only handle.
    fn busy(&self) -> bool {
        Arc::strong_count(&self.segments) > 1
    }

    fn idle(&self, now: Instant, after: Duration) -> bool {
        !self.busy() && now.saturating_duration_since(self.used) >= after
    }
}

#[derive(Default)]
struct Table {
    limits: SegmentLimits,
    slots: HashMap<ScopedTag, Slot>,
    /// How many tags each scope holds.
    held: HashMap<String, usize>,
}

impl Table {
    fn evict(&mut self, key: &ScopedTag) {
        if self.slots.remove(key).is_some()
            && let Some(n) = self.held.get_mut(&key.0)
        {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&key.0);
            }
        }
    }

    /// Evicts the idle tags of `scope` (of every scope with `None`).
    fn evict_idle(&mut self, scope: Option<&str>, now: Instant) {
        let after = self.limits.idle_after;
        let idle: Vec<ScopedTag> = self
            .slots
            .iter()
            .filter(|(k, slot)| scope.is_none_or(|s| k.0 == s) && slot.idle(now, after))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &idle {
            self.evict(key);
        }
    }

    /// Evicts the least recently used tag that no request is using; false if every tag is
    /// in use.
    fn evict_least_recent(&mut self) -> bool {
        let Some(key) = self
            .slots
            .iter()
            .filter(|(_, slot)| !slot.busy())
            .min_by_key(|(_, slot)| slot.used)
            .map(|(k, _)| k.clone())
        else {
            return false;
        };
        self.evict(&key);
        true
    }
}

/// Segment allocators by caller scope and tag, made on first use, within [`SegmentLimits`].
#[derive(Clone, Default)]
pub struct SegmentTable(Arc<Mutex<Table>>);

/// One caller's segment tag as operators see it: how many ids it holds in memory and how long
/// they would last without the store.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentView {
    /// The caller's scope.
    pub scope: String,
    /// The tag.
    pub tag: String,
    /// Ids in memory (the current range and the one ahead).
    pub remaining: u64,
    /// The size of the next range fetched.
    pub step: u64,
    /// How long the ids in memory last at the rate served so far.
    pub runway: Option<Duration>,
    /// Why the last fetch failed, while fetches fail.
    pub failing: Option<String>,
}

impl idem_ops::health::FailingTags for SegmentTable {
    fn failing(&self) -> (usize, Option<(std::time::SystemTime, String)>) {
        SegmentTable::failing(self)
    }
}

impl SegmentTable {
    /// Every tag the table holds, by scope and tag. The allocators are read after the table's
    /// lock is let go.
    pub fn views(&self) -> Vec<SegmentView> {
        let held: Vec<(ScopedTag, Arc<idem_id::Segments>)> = self
            .lock()
            .slots
            .iter()
            .map(|(k, slot)| (k.clone(), slot.segments.clone()))
            .collect();
        let mut views: Vec<SegmentView> = held
            .into_iter()
            .map(|((scope, tag), s)| SegmentView {
                scope,
                tag,
                remaining: s.remaining(),
                step: s.step(),
                runway: s.runway(),
                failing: s.last_error(),
            })
            .collect();
        views.sort_by(|a, b| (&a.scope, &a.tag).cmp(&(&b.scope, &b.tag)));
        views
    }

    /// An empty table within `limits`.
    pub fn new(limits: SegmentLimits) -> Self {
        Self(Arc::new(Mutex::new(Table {
            limits,
            ..Table::default()
        })))
    }

    /// How many tags the table holds, of all callers.
    pub fn len(&self) -> usize {
        self.lock().slots.len()
    }

    /// Whether the table holds no tag.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The allocator of `scope`'s `tag`, made if it is new, as asked for at `now` (which
    /// marks it used). The caller keeps the answer while it takes ids from it: a tag with a
    /// holder is busy and never evicted.
    ///
    /// # Errors
    ///
    /// 400 `invalid_tag` for a tag that is not a valid key, 429 `tag_quota_exceeded` for a
    /// new tag of a scope at its quota, 503 `too_many_tags` when every tag of the table is in
    /// use.
    pub fn segments(
        &self,
        store: &idem_core::SharedStore,
        scope: &str,
        tag: &str,
        now: Instant,
    ) -> Result<Arc<idem_id::Segments>, Problem> {
        let mut table = self.lock();
        let key = (scope.to_owned(), tag.to_owned());
        if let Some(slot) = table.slots.get_mut(&key) {
            slot.used = slot.used.max(now);
            return Ok(slot.segments.clone());
        }
        let segments = idem_id::Segments::scoped(
            store.clone(),
            scope,
            tag,
            idem_id::SegmentOptions::default(),
        )
        .map_err(|e| ProblemCode::InvalidTag.problem(format!("{e}.")))?;
        let limits = table.limits;
        let held = |t: &Table| t.held.get(scope).copied().unwrap_or(0);
        if held(&table) >= limits.per_scope {
            table.evict_idle(Some(scope), now);
        }
        if held(&table) >= limits.per_scope {
            return Err(ProblemCode::TagQuotaExceeded
                .problem(format!(
                    "A caller may hold {} segment tags at a time; this caller holds that many, \
                     each used within the last {} seconds. Reuse a tag, or ask again once one \
                     has been idle that long.",
                    limits.per_scope,
                    limits.idle_after.as_secs()
                ))
                .with("quota", limits.per_scope)
                .retry_after(limits.idle_after));
        }
        if table.slots.len() >= limits.total {
            // Idle tags first (anyone's), then the least recently used of the rest.
            table.evict_idle(None, now);
            while table.slots.len() >= limits.total {
                if !table.evict_least_recent() {
                    return Err(unavailable(
                        ProblemCode::TooManyTags,
                        format!(
                            "This server serves at most {} segment tags, and all are in use.",
                            limits.total
                        ),
                    )
                    .retry_after(Duration::from_secs(1)));
                }
            }
        }
        *table.held.entry(scope.to_owned()).or_default() += 1;
        table.slots.insert(
            key,
            Slot {
                segments: segments.clone(),
                used: now,
            },
        );
        Ok(segments)
    }

    /// How many tags fail to fetch from the store, with the reason and start of the longest
    /// failing one (for health reports; no store call).
    pub fn failing(&self) -> (usize, Option<(std::time::SystemTime, String)>) {
        let table = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut count = 0;
        let mut oldest: Option<(std::time::SystemTime, String)> = None;
        for slot in table.slots.values() {
            if let idem_id::SegmentStatus::Failing { since, reason, .. } = slot.segments.status() {
                count += 1;
                if oldest.as_ref().is_none_or(|(s, _)| since < *s) {
                    oldest = Some((since, reason));
                }
            }
        }
        (count, oldest)
    }
}

/// `count` from the query (`count=N`, nothing else); 1 without one.
fn count(query: Option<&str>) -> Result<u32, Problem> {
    let mut count = None;
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("count", value)) if count.is_none() => count = Some(value),
            _ => return Err(bad_query()),
        }
    }
    let Some(text) = count else {
        return Ok(1);
    };
    text.parse::<u32>()
        .ok()
        .filter(|n| (1..=MAX_COUNT).contains(n))
        .ok_or_else(|| {
            ProblemCode::InvalidCount.problem(format!(
                "`count` must be a whole number from 1 to {MAX_COUNT}."
            ))
        })
}

/// `GET /v1/ids/uuid7`.
pub async fn uuid7(_: Caller, RawQuery(q): RawQuery) -> Result<Json<Uuid7Ids>, Problem> {
    let n = count(q.as_deref())?;
    let ids: Vec<String> = (0..n).map(|_| idem_id::uuid7().to_string()).collect();
    issued("uuid7", ids.len());
    Ok(Json(Uuid7Ids { ids }))
}

/// `GET /v1/ids/snowflake`.
pub async fn snowflake(
    State(state): State<AppState>,
    _: Caller,
    RawQuery(q): RawQuery,
) -> Result<Json<SnowflakeIds>, Problem> {
    let n = count(q.as_deref())?;
    let Some(generator) = &state.snowflake else {
        return Err(unavailable(
            ProblemCode::NoWorkerId,
            "This server issues no Snowflake ids (it was started without a worker id pool).",
        ));
    };
    let batch = take(generator, n).await?;
    let worker = batch.worker();
    let ids: Vec<u64> = batch.collect();
    issued("snowflake", ids.len());
    Ok(Json(SnowflakeIds::new(ids, worker)))
}

/// `GET /v1/ids/segment/{tag}`.
pub async fn segment(
    State(state): State<AppState>,
    caller: Caller,
    PathParams(tag): PathParams<String>,
    RawQuery(q): RawQuery,
) -> Result<Json<SegmentIds>, Problem> {
    let n = count(q.as_deref())?;
    let segments =
        state
            .segments
            .segments(&state.store, caller.scope.as_str(), &tag, Instant::now())?;
    let mut ids = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for _ in 0..n {
        let id = match segments.try_next() {
            Some(id) => id,
            None => segments.next().await.map_err(|e| {
                tracing::warn!(error = %e, "segment ids unavailable");
                unavailable(
                    ProblemCode::StoreUnavailable,
                    "No segment ids are left in memory and the store gives no more now (the \
                     server's log says why).",
                )
                .retry_after(std::time::Duration::from_secs(1))
            })?,
        };
        ids.push(id);
    }
    issued("segment", ids.len());
    Ok(Json(SegmentIds::from(ids)))
}

/// Describes the id endpoints' metrics.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "idem_ids_issued_total",
        "Ids handed out over HTTP, by kind (uuid7, snowflake, segment)."
    );
}

fn issued(kind: &'static str, n: usize) {
    metrics::counter!("idem_ids_issued_total", "kind" => kind).increment(n as u64);
}

/// `n` ids, waiting (briefly, without blocking a thread) while the layout's rate is exceeded.
async fn take(generator: &ManagedSnowflake, n: u32) -> Result<Batch, Problem> {
    for _ in 0..50 {
        match generator.try_next_batch(n) {
            Ok(batch) => return Ok(batch),
            Err(IdError::Exhausted { retry_after }) => tokio::time::sleep(retry_after).await,
            Err(IdError::NoWorker {
                reason,
                retry_after,
            }) => {
                return Err(unavailable(
                    ProblemCode::NoWorkerId,
                    format!("This server holds no Snowflake worker id now ({reason}); it claims one by itself."),
                )
                .retry_after(retry_after));
            }
            Err(IdError::Starting { retry_after }) => {
                return Err(unavailable(
                    ProblemCode::NoWorkerId,
                    "This server's Snowflake worker id was just claimed; its ids begin once any \
                     earlier holder of it has stopped.",
                )
                .retry_after(retry_after));
            }
            Err(IdError::LeaseExpired) => {
                return Err(unavailable(
                    ProblemCode::WorkerLeaseExpired,
                    "The worker id's lease could not be renewed in time; try again shortly.",
                )
                .retry_after(std::time::Duration::from_secs(1)));
            }
            Err(IdError::WorkerLost) => {
                return Err(unavailable(
                    ProblemCode::WorkerLost,
                    "This server's worker id was lost; it issues no more Snowflake ids.",
                ));
            }
            Err(e) => {
                return Err(unavailable(
                    ProblemCode::IdsUnavailable,
                    format!("No ids: {e}."),
                ));
            }
        }
    }
    Err(unavailable(
        ProblemCode::IdsBusy,
        "Ids are asked for faster than this server can issue them.",
    )
    .retry_after(std::time::Duration::from_secs(1)))
}

/// A 503: `code` says why no id could be issued.
fn unavailable(code: ProblemCode, detail: impl Into<String>) -> Problem {
    code.problem(detail)
}

fn bad_query() -> Problem {
    Problem::invalid_request("The query takes only `count`, once: `?count=N`.")
}

#[cfg(test)]
mod tests {
    use idem_core::SharedStore;
    use idem_store::MemoryStore;

    use super::*;

    fn table(per_scope: usize, total: usize) -> (SegmentTable, SharedStore) {
        let limits = SegmentLimits {
            per_scope,
            total,
            idle_after: Duration::from_secs(600),
        };
        (SegmentTable::new(limits), Arc::new(MemoryStore::new()))
    }

    #[test]
    fn an_idle_tag_is_evicted_and_its_slot_reused() {
        let (table, store) = table(2, 8);
        let t0 = Instant::now();
        drop(table.segments(&store, "shop", "a", t0).unwrap());
        drop(table.segments(&store, "shop", "b", t0).unwrap());
        // `a` is used again later; `b` is not.
        let later = t0 + Duration::from_secs(500);
        drop(table.segments(&store, "shop", "a", later).unwrap());
        let err = table
            .segments(&store, "shop", "c", later)
            .map(drop)
            .unwrap_err();
        assert_eq!(err.code(), "tag_quota_exceeded");
        // Ten minutes after its last use `b` is idle, and `c` takes its slot.
        let idle = t0 + Duration::from_secs(600);
        drop(table.segments(&store, "shop", "c", idle).unwrap());
        assert_eq!(table.len(), 2);
        let slots = table.lock();
        assert!(slots.slots.contains_key(&("shop".into(), "a".into())));
        assert!(!slots.slots.contains_key(&("shop".into(), "b".into())));
        assert_eq!(slots.held["shop"], 2);
    }

    #[test]
    fn a_busy_tag_is_never_evicted() {
        let (table, store) = table(1, 2);
        let t0 = Instant::now();
        // A request is taking ids from `a` (it holds the allocator), for a long time.
        let in_use = table.segments(&store, "shop", "a", t0).unwrap();
        let much_later = t0 + Duration::from_secs(86_400);
        let err = table
            .segments(&store, "shop", "b", much_later)
            .map(drop)
            .unwrap_err();
        assert_eq!(err.code(), "tag_quota_exceeded");
        // Nor by the global bound: the table is full of tags in use.
        let also_in_use = table.segments(&store, "bank", "x", much_later).unwrap();
        let err = table
            .segments(&store, "mint", "y", much_later)
            .map(drop)
            .unwrap_err();
        assert_eq!(err.code(), "too_many_tags");
        assert!(Arc::ptr_eq(
            &in_use,
            &table.segments(&store, "shop", "a", much_later).unwrap()
        ));
        drop(also_in_use);
        // Once unused, the least recently used tag of anyone makes room, idle or not.
        drop(table.segments(&store, "mint", "y", much_later).unwrap());
        let slots = table.lock();
        assert!(!slots.slots.contains_key(&("bank".into(), "x".into())));
        assert!(!slots.held.contains_key("bank"));
    }

    #[test]
    fn a_full_table_evicts_the_least_recently_used_tag_of_anyone() {
        let (table, store) = table(4, 3);
        let t0 = Instant::now();
        for (n, (scope, tag)) in [("shop", "a"), ("bank", "b"), ("shop", "c")]
            .into_iter()
            .enumerate()
        {
            let at = t0 + Duration::from_secs(n as u64);
            drop(table.segments(&store, scope, tag, at).unwrap());
        }
        let at = t0 + Duration::from_secs(10);
        drop(table.segments(&store, "mint", "d", at).unwrap());
        assert_eq!(table.len(), 3);
        assert!(
            !table
                .lock()
                .slots
                .contains_key(&("shop".into(), "a".into()))
        );
    }
}
