//! One-time token endpoints (see `idem::tokens`), each caller's tokens its own:
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `POST /v1/tokens` `{"purpose","ttl_ms"?}` | 201 `{"token","expires_at"}` (default TTL 1 h, at most 365 d) |
//! | `POST /v1/tokens/consume` `{"token","purpose"}` | 200 `{"consumed":true}`, or 409 `already_used` / `expired` / `wrong_purpose` / `unknown` |
//!
//! A token another caller was issued is `unknown` here: it does not tell that the token exists.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem::Tokens;
use idem_http::{Problem, token_problem};
use serde::Deserialize;
use utoipa::ToSchema;

use crate::AppState;
use crate::answers::{Consumed, IssuedToken};
use crate::api::{MAX_TTL, duration_ms};
use crate::auth::Caller;
use idem_ops::json::JsonBody;

/// `POST /v1/tokens`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IssueBody {
    /// What the token is for (1 to 128 visible ASCII characters); consuming it needs the
    /// same purpose.
    #[schema(pattern = "^[!-~]{1,128}$")]
    purpose: String,
    /// How long the token lives, in milliseconds (1 to 31536000000; default 3600000).
    #[schema(minimum = 1, maximum = 31_536_000_000_u64)]
    ttl_ms: Option<u64>,
}

/// `POST /v1/tokens/consume`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumeBody {
    /// The token `POST /v1/tokens` returned.
    token: String,
    /// The purpose it was issued for.
    purpose: String,
}

fn tokens(state: &AppState) -> Tokens {
    Tokens::new(state.store.clone(), state.clock.clone())
}

/// Issues a token.
pub async fn issue(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<IssueBody>,
) -> Result<Response, Problem> {
    let ttl = duration_ms("ttl_ms", body.ttl_ms, Duration::from_secs(3600), MAX_TTL)?;
    let issued = tokens(&state)
        .issue(caller.scope.as_str(), &body.purpose, ttl)
        .await
        .map_err(|e| token_problem(&e))?;
    Ok((StatusCode::CREATED, Json(IssuedToken::from(issued))).into_response())
}

/// Consumes a token.
pub async fn consume(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<ConsumeBody>,
) -> Result<Json<Consumed>, Problem> {
    tokens(&state)
        .consume(caller.scope.as_str(), &body.token, &body.purpose)
        .await
        .map_err(|e| token_problem(&e))?;
    Ok(Json(Consumed::YES))
}
