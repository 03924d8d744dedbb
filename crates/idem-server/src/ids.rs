//! Id endpoints, for services in other languages (as Leaf is used):
//!
//! | method and path | what it answers |
//! | --- | --- |
//! | `GET /v1/ids/uuid7?count=N` | `{"ids":["0193…",…]}`: UUIDv7, strictly increasing |
//! | `GET /v1/ids/snowflake?count=N` | `{"ids":[…],"id_strings":["…"],"worker":W}`: 64-bit ids as JSON numbers and, since JavaScript loses precision above 2^53, as strings |
//! | `GET /v1/ids/segment/{tag}?count=N` | `{"ids":[…],"id_strings":["…"]}`: the caller's own sequence `tag` (Leaf-segment), increasing per server |
//!
//! `count` is 1 (the default) to [`MAX_COUNT`]; anything else is 400 `invalid_count`. The
//! server leases its Snowflake worker id from its store and keeps it (see
//! `idem_id::ManagedSnowflake`); while it holds none (at start, or after the store lost it, until
//! a new one can safely be claimed) the Snowflake endpoint answers 503 `no_worker_id` with a
//! `Retry-After`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use idem_http::Problem;
use idem_id::{Batch, IdError, ManagedSnowflake};
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::Caller;

/// The most ids one request may ask for.
pub const MAX_COUNT: u32 = 1000;

/// The most segment tags one server serves (each holds two ranges in memory).
pub const MAX_TAGS: usize = 1024;

/// A caller's scope and a tag.
type ScopedTag = (String, String);

/// Segment allocators by caller scope and tag.
#[derive(Clone, Default)]
pub struct SegmentTable(Arc<Mutex<HashMap<ScopedTag, Arc<idem_id::Segments>>>>);

impl SegmentTable {
    fn get(
        &self,
        store: &idem_core::SharedStore,
        scope: &str,
        tag: &str,
    ) -> Result<Arc<idem_id::Segments>, Problem> {
        let mut table = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (scope.to_owned(), tag.to_owned());
        if let Some(s) = table.get(&key) {
            return Ok(s.clone());
        }
        if table.len() >= MAX_TAGS {
            return Err(unavailable(
                "too_many_tags",
                format!("This server already serves {MAX_TAGS} segment tags."),
            ));
        }
        let segments = idem_id::Segments::scoped(
            store.clone(),
            scope,
            tag,
            idem_id::SegmentOptions::default(),
        )
        .map_err(|e| {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid_tag",
                "Invalid tag",
                format!("{e}."),
            )
        })?;
        table.insert(key, segments.clone());
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
        for segments in table.values() {
            if let idem_id::SegmentStatus::Failing { since, reason, .. } = segments.status() {
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
            Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid_count",
                "Invalid count",
                format!("`count` must be a whole number from 1 to {MAX_COUNT}."),
            )
        })
}

/// `GET /v1/ids/uuid7`.
pub async fn uuid7(_: Caller, RawQuery(q): RawQuery) -> Result<Json<Value>, Problem> {
    let n = count(q.as_deref())?;
    let ids: Vec<String> = (0..n).map(|_| idem_id::uuid7().to_string()).collect();
    Ok(Json(json!({ "ids": ids })))
}

/// `GET /v1/ids/snowflake`.
pub async fn snowflake(
    State(state): State<AppState>,
    _: Caller,
    RawQuery(q): RawQuery,
) -> Result<Json<Value>, Problem> {
    let n = count(q.as_deref())?;
    let Some(generator) = &state.snowflake else {
        return Err(unavailable(
            "no_worker_id",
            "This server issues no Snowflake ids (it was started without a worker id pool).",
        ));
    };
    let batch = take(generator, n).await?;
    let worker = batch.worker();
    let ids: Vec<u64> = batch.collect();
    let strings: Vec<String> = ids.iter().map(u64::to_string).collect();
    Ok(Json(json!({
        "ids": ids,
        "id_strings": strings,
        "worker": worker,
    })))
}

/// `GET /v1/ids/segment/{tag}`.
pub async fn segment(
    State(state): State<AppState>,
    caller: Caller,
    Path(tag): Path<String>,
    RawQuery(q): RawQuery,
) -> Result<Json<Value>, Problem> {
    let n = count(q.as_deref())?;
    let segments = state
        .segments
        .get(&state.store, caller.scope.as_str(), &tag)?;
    let mut ids = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for _ in 0..n {
        let id = match segments.try_next() {
            Some(id) => id,
            None => segments.next().await.map_err(|e| {
                tracing::warn!(error = %e, "segment ids unavailable");
                unavailable(
                    "store_unavailable",
                    "No segment ids are left in memory and the store cannot be reached.",
                )
                .retry_after(std::time::Duration::from_secs(1))
            })?,
        };
        ids.push(id);
    }
    let strings: Vec<String> = ids.iter().map(u64::to_string).collect();
    Ok(Json(json!({ "ids": ids, "id_strings": strings })))
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
                    "no_worker_id",
                    format!("This server holds no Snowflake worker id now ({reason}); it claims one by itself."),
                )
                .retry_after(retry_after));
            }
            Err(IdError::LeaseExpired) => {
                return Err(unavailable(
                    "worker_lease_expired",
                    "The worker id's lease could not be renewed in time; try again shortly.",
                )
                .retry_after(std::time::Duration::from_secs(1)));
            }
            Err(IdError::WorkerLost) => {
                return Err(unavailable(
                    "worker_lost",
                    "This server's worker id was lost; it issues no more Snowflake ids.",
                ));
            }
            Err(e) => return Err(unavailable("ids_unavailable", format!("No ids: {e}."))),
        }
    }
    Err(unavailable(
        "ids_busy",
        "Ids are asked for faster than this server can issue them.",
    )
    .retry_after(std::time::Duration::from_secs(1)))
}

fn unavailable(code: &'static str, detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        code,
        "Ids unavailable",
        detail,
    )
}

fn bad_query() -> Problem {
    Problem::invalid_request("The query takes only `count`, once: `?count=N`.")
}
