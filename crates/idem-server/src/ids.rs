//! Id endpoints, for services in other languages (as Leaf is used):
//!
//! | method and path | what it answers |
//! | --- | --- |
//! | `GET /v1/ids/uuid7?count=N` | `{"ids":["0193…",…]}`: UUIDv7, strictly increasing |
//! | `GET /v1/ids/snowflake?count=N` | `{"ids":[…],"id_strings":["…"],"worker":W}`: 64-bit ids as JSON numbers and, since JavaScript loses precision above 2^53, as strings |
//! | `GET /v1/ids/segment/{tag}?count=N` | `{"ids":[…],"id_strings":["…"]}`: the caller's own sequence `tag` (Leaf-segment), increasing per server |
//!
//! `count` is 1 (the default) to [`MAX_COUNT`]; anything else is 400 `invalid_count`. The
//! server claims its Snowflake worker id from its store when it starts (see
//! `idem_id::WorkerPool`); without one the Snowflake endpoint answers 503.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use idem_http::Problem;
use idem_id::{IdError, LeasedSnowflake};
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
            "This server holds no Snowflake worker id (none was free in its store when it started).",
        ));
    };
    let ids = take(generator, n).await?;
    let strings: Vec<String> = ids.iter().map(u64::to_string).collect();
    Ok(Json(json!({
        "ids": ids,
        "id_strings": strings,
        "worker": generator.worker(),
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
async fn take(generator: &Arc<LeasedSnowflake>, n: u32) -> Result<Vec<u64>, Problem> {
    for _ in 0..50 {
        match generator.try_next_batch(n) {
            Ok(batch) => return Ok(batch.collect()),
            Err(IdError::Exhausted { retry_after }) => tokio::time::sleep(retry_after).await,
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
                    "This server's worker id was taken over; it issues no more Snowflake ids.",
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
