//! Health by component, for `GET /healthz` (serve) and `{prefix}/health` (gateway).
//!
//! ```json
//! {"status":"degraded","store":"redis","components":{
//!   "store":{"status":"ok"},
//!   "snowflake":{"status":"degraded","reason":"…","since":"2026-11-23T09:00:00.000Z"},
//!   "segments":{"status":"ok"},
//!   "locks":{"status":"ok"},
//!   "purge":{"status":"ok","last_run":"2026-11-23T09:00:00.000Z"}}}
//! ```
//!
//! Each component is `ok`, `degraded` (it works in part, or not now and recovers by itself:
//! `reason` says why, `since` since when) or `down`. The top level is `down` only when the
//! store is, and then the answer is 503: without its records an instance can do nothing safely,
//! so a load balancer should send its traffic elsewhere. Any other component that is not `ok`
//! makes the top level `degraded` with 200: its records still work, and every instance sharing
//! the store is likely in the same state, so taking it out of rotation would not help.
//!
//! Each component's state is logged once when it stops being `ok` (a warning with the reason)
//! and once when it is `ok` again (with how long it was not), by [`Monitor`], which evaluates
//! the components on every health request and, through [`Monitor::watch`], every few seconds,
//! so a degraded state is logged even when nobody asks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use axum::Json;
use axum::response::{IntoResponse, Response};
use idem::purge::PurgeStatus;
use idem_core::{Clock, Key, SharedStore, Timestamp};
use idem_http::ToProblem;
use idem_id::{ManagedSnowflake, WorkerStatus};
use serde::Serialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::json::rfc3339;

/// How often [`Monitor::watch`] evaluates the components.
pub const WATCH_EVERY: Duration = Duration::from_secs(5);

/// A component's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Working.
    Ok,
    /// Working in part, or not now and recovering by itself.
    Degraded,
    /// Not working.
    Down,
}

impl Level {
    /// The state's name in reports: `ok`, `degraded` or `down`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Degraded => "degraded",
            Level::Down => "down",
        }
    }
}

/// One component's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    /// Its state.
    pub level: Level,
    /// Why it is not `ok`.
    pub reason: Option<String>,
    /// Since when it has been in this state, where known.
    pub since: Option<Timestamp>,
    /// More facts, reported as they are (such as the purge loop's last run).
    pub extra: Map<String, Value>,
}

impl Component {
    fn ok() -> Self {
        Self {
            level: Level::Ok,
            reason: None,
            since: None,
            extra: Map::new(),
        }
    }

    fn not_ok(level: Level, reason: impl Into<String>, since: Option<Timestamp>) -> Self {
        Self {
            level,
            reason: Some(reason.into()),
            since,
            extra: Map::new(),
        }
    }
}

/// One component's health as a report shows it.
#[derive(Serialize, ToSchema)]
#[schema(description = "One component's health; components may add members of their own.")]
pub struct ComponentHealth {
    status: Level,
    /// Why it is not `ok`.
    #[schema(nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    /// Since when it is in this state.
    #[schema(format = DateTime, nullable = false)]
    #[serde(skip_serializing_if = "Option::is_none")]
    since: Option<String>,
    /// More facts, as the component reports them (such as the purge loop's last run).
    #[schema(ignore)]
    #[serde(flatten)]
    extra: Map<String, Value>,
}

impl From<&Component> for ComponentHealth {
    fn from(c: &Component) -> Self {
        Self {
            status: c.level,
            reason: c.reason.clone(),
            since: c.since.map(rfc3339),
            extra: c.extra.clone(),
        }
    }
}

/// The health report as `GET /healthz` and `{prefix}/health` answer it.
#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`, or `degraded` if a component other than the store is not `ok`.
    status: Level,
    /// The store's kind (`memory`, `sqlite`, …).
    store: String,
    /// Each component by name (`store` always).
    components: BTreeMap<String, ComponentHealth>,
}

/// Allocators by tag that may fail to fetch from the store (`idem serve`'s segment ids).
pub trait FailingTags: Send + Sync {
    /// How many tags fail to fetch from the store, with the reason and start of the longest
    /// failing one (no store call).
    fn failing(&self) -> (usize, Option<(std::time::SystemTime, String)>);
}

/// What a process reports on: the store always, the rest where it has them.
#[derive(Clone)]
pub struct Components {
    /// The record store, probed with a read.
    pub store: SharedStore,
    /// The clock the probe and the times use.
    pub clock: Arc<dyn Clock>,
    /// The Snowflake generator, if the process issues Snowflake ids.
    pub snowflake: Option<Arc<ManagedSnowflake>>,
    /// The segment allocators, if the process serves segment ids.
    pub segments: Option<Arc<dyn FailingTags>>,
    /// Whether the process serves locks (from the same store); `None` if it has no lock API.
    pub locks: Option<bool>,
}

impl Components {
    /// Only the store (and the purge loop, which the [`Monitor`] knows): the gateway.
    pub fn store_only(store: SharedStore, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            clock,
            snowflake: None,
            segments: None,
            locks: None,
        }
    }
}

/// A health report.
#[derive(Debug, Clone)]
pub struct Report {
    /// The store's kind (`sqlite`, `redis`, …).
    pub store: &'static str,
    /// Each component by name.
    pub components: BTreeMap<&'static str, Component>,
}

impl Report {
    /// The overall state: `down` if the store is, `degraded` if any other component is not
    /// `ok`, else `ok`.
    pub fn level(&self) -> Level {
        if self
            .components
            .get("store")
            .is_some_and(|c| c.level == Level::Down)
        {
            return Level::Down;
        }
        if self.components.values().any(|c| c.level != Level::Ok) {
            Level::Degraded
        } else {
            Level::Ok
        }
    }

    /// The report as it is answered.
    pub fn view(&self) -> Health {
        Health {
            status: self.level(),
            store: self.store.to_owned(),
            components: self
                .components
                .iter()
                .map(|(name, c)| ((*name).to_owned(), c.into()))
                .collect(),
        }
    }

    /// The report's JSON body.
    pub fn to_json(&self) -> Value {
        json!(self.view())
    }
}

impl IntoResponse for Report {
    /// 503 when the store is down (as problem+json, code `store_unavailable`, with the report's
    /// members), else 200 with the report.
    fn into_response(self) -> Response {
        let body = self.to_json();
        if self.level() != Level::Down {
            return Json(body).into_response();
        }
        let mut problem = idem_http::ProblemCode::StoreUnavailable
            .problem("The record store does not answer, so this instance can do nothing safely.");
        for (name, value) in ["store", "components"].map(|k| (k, body[k].clone())) {
            problem = problem.with(name, value);
        }
        problem.retry_after(Duration::from_secs(1)).into_response()
    }
}

/// Evaluates components and logs each one's changes of state once; cloning gives another
/// handle on the same memory. It also holds the purge loop's status, which the loop writes.
#[derive(Clone, Default)]
pub struct Monitor(Arc<Inner>);

#[derive(Default)]
struct Inner {
    purge: PurgeStatus,
    stopping: AtomicBool,
    /// Numbers evaluations in the order they start.
    started: AtomicU64,
    /// Each component's last state and when it began, as last logged, and the number of the
    /// evaluation that said so.
    shown: Mutex<(Shown, u64)>,
}

/// Each component's state as last logged, and when it began.
type Shown = BTreeMap<&'static str, (Level, Timestamp)>;

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").finish_non_exhaustive()
    }
}

impl Monitor {
    /// The handle the purge loop records its passes in (see
    /// [`idem::purge::purge_loop_reporting`]).
    pub fn purge_status(&self) -> PurgeStatus {
        self.0.purge.clone()
    }

    /// Says the process is shutting down: a Snowflake generator released for it is then `ok`.
    pub fn shutting_down(&self) {
        self.0.stopping.store(true, Ordering::Relaxed);
    }

    /// Evaluates every component (one read from the store) and logs what changed.
    pub async fn check(&self, c: &Components) -> Report {
        let number = self.0.started.fetch_add(1, Ordering::Relaxed) + 1;
        let mut components = BTreeMap::new();
        components.insert("store", probe_store(&c.store, &*c.clock).await);
        if let Some(snowflake) = &c.snowflake {
            components.insert(
                "snowflake",
                snowflake_health(&snowflake.status(), self.0.stopping.load(Ordering::Relaxed)),
            );
        }
        if let Some(segments) = &c.segments {
            components.insert("segments", segments_health(segments.as_ref()));
        }
        if c.locks == Some(true) {
            // Locks live in the record store: they answer when it does.
            components.insert("locks", Component::ok());
        }
        components.insert("purge", purge_health(&self.0.purge));
        let mut report = Report {
            store: c.store.kind(),
            components,
        };
        self.log_changes(&mut report, number, c.clock.now());
        report
    }

    /// Evaluates the components every [`WATCH_EVERY`] until the task is dropped, so changes
    /// are logged even when nobody asks for health.
    pub async fn watch(self, c: Components) {
        let mut tick = tokio::time::interval(WATCH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.check(&c).await;
        }
    }

    /// Logs each component whose state changed since last logged, and fills in `since` where
    /// the component did not say. An evaluation that started before the one last logged (they
    /// overlap: the background one and requests) is older news and changes nothing.
    fn log_changes(&self, report: &mut Report, number: u64, now: Timestamp) {
        let mut guard = self.0.shown.lock().unwrap_or_else(PoisonError::into_inner);
        let (shown, last) = &mut *guard;
        let stale = number < *last;
        if !stale {
            *last = number;
        }
        for (name, c) in &mut report.components {
            let before = shown.get(name).copied();
            let since = match before {
                Some((level, since)) if level == c.level => since,
                _ => c.since.unwrap_or(now),
            };
            if c.level != Level::Ok && c.since.is_none() {
                c.since = Some(since);
            }
            if stale || before.is_some_and(|(level, _)| level == c.level) {
                continue;
            }
            shown.insert(name, (c.level, since));
            let reason = c.reason.as_deref().unwrap_or("");
            match (before, c.level) {
                (None, Level::Ok) => {}
                (Some((_, began)), Level::Ok) => tracing::info!(
                    component = *name,
                    after = ?now.saturating_since(began),
                    "{name} is ok again"
                ),
                (_, level) => tracing::warn!(
                    component = *name,
                    status = level.as_str(),
                    reason,
                    "{name} is {}",
                    level.as_str()
                ),
            }
        }
    }
}

/// `ok` if the store answers a read of a key nobody uses, else `down`.
async fn probe_store(store: &SharedStore, clock: &dyn Clock) -> Component {
    static PROBE: LazyLock<Key> =
        LazyLock::new(|| Key::parse("idem.health", "health", "probe").expect("a valid key"));
    match store.get(&PROBE, clock.now()).await {
        Ok(_) => Component::ok(),
        // The error itself goes to the log (once, as the state begins), not to anonymous callers.
        Err(e) if e.is_transient() => Component::not_ok(
            Level::Down,
            format!("the store cannot be reached: {e}"),
            None,
        ),
        Err(e) => Component::not_ok(Level::Down, format!("the store fails: {e}"), None),
    }
}

fn snowflake_health(status: &WorkerStatus, stopping: bool) -> Component {
    match status {
        WorkerStatus::Holding { .. } => Component::ok(),
        WorkerStatus::Starting {
            worker,
            since,
            ready_at,
        } => Component::not_ok(
            Level::Degraded,
            format!(
                "worker id {worker} was just claimed; its ids begin at {}, once any earlier \
                 holder of it has stopped",
                rfc3339(*ready_at)
            ),
            Some(*since),
        ),
        WorkerStatus::Expired { since, reason, .. } => Component::not_ok(
            Level::Degraded,
            format!("the worker id's lease ran out before it could be renewed: {reason}"),
            Some(*since),
        ),
        WorkerStatus::Claiming {
            since,
            next_try,
            reason,
        } => {
            let mut c = Component::not_ok(
                Level::Degraded,
                format!("no worker id: {reason}"),
                Some(*since),
            );
            c.extra
                .insert("next_claim".into(), rfc3339(*next_try).into());
            c
        }
        WorkerStatus::Stopped { .. } if stopping => Component::ok(),
        WorkerStatus::Stopped { since, reason } => Component::not_ok(
            Level::Down,
            format!("no more Snowflake ids: {reason}"),
            Some(*since),
        ),
        _ => Component::not_ok(Level::Degraded, "in an unknown state", None),
    }
}

fn segments_health(segments: &dyn FailingTags) -> Component {
    match segments.failing() {
        (0, _) | (_, None) => Component::ok(),
        (n, Some((since, reason))) => Component::not_ok(
            Level::Degraded,
            format!("{n} tag(s) cannot fetch ids from the store: {reason}"),
            Some(Timestamp::from_system_time(since)),
        ),
    }
}

fn purge_health(purge: &PurgeStatus) -> Component {
    let state = purge.get();
    let mut c = match (&state.last_error, state.failing_since) {
        (Some(e), since) => Component::not_ok(
            Level::Degraded,
            format!("the last purge of expired records failed: {e}"),
            since,
        ),
        (None, _) => Component::ok(),
    };
    if let Some(at) = state.last_run {
        c.extra.insert("last_run".into(), rfc3339(at).into());
    }
    c
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use idem_core::SystemClock;
    use idem_store::MemoryStore;
    use idem_testkit::FaultyStore;

    /// With nobody asking for health, the background evaluation logs a store going down once,
    /// however many evaluations see it down, and once as it comes back.
    // One thread, and Tokio's timers paused (they run ahead whenever every task waits): each
    // evaluation happens while the test holds the store's state, and logs to its subscriber.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_background_evaluation_logs_each_change_once() {
        let log = tempfile::NamedTempFile::new().unwrap();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(Mutex::new(log.reopen().unwrap()))
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let faulty = FaultyStore::new(MemoryStore::new());
        faulty.set_down(true);
        let monitor = Monitor::default();
        let components = Components::store_only(Arc::new(faulty.clone()), Arc::new(SystemClock));
        let watch = tokio::spawn(monitor.watch(components));
        tokio::time::sleep(WATCH_EVERY * 3).await;
        faulty.set_down(false);
        tokio::time::sleep(WATCH_EVERY * 3).await;
        watch.abort();
        let text = std::fs::read_to_string(log.path()).unwrap();
        assert_eq!(text.matches("store is down").count(), 1, "{text}");
        assert_eq!(text.matches("store is ok again").count(), 1, "{text}");
    }
}
