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
use idem::{TokenError, Tokens};
use idem_http::Problem;
use serde::Deserialize;
use serde_json::json;

use crate::AppState;
use crate::api::{MAX_TTL, rfc3339};
use crate::auth::Caller;
use crate::json::JsonBody;

/// `POST /v1/tokens`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IssueBody {
    purpose: String,
    ttl_ms: Option<u64>,
}

/// `POST /v1/tokens/consume`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumeBody {
    token: String,
    purpose: String,
}

fn tokens(state: &AppState) -> Tokens {
    Tokens::new(state.store.clone(), state.clock.clone())
}

fn problem(e: &TokenError) -> Problem {
    let refused = |code, detail: &str| {
        Problem::new(
            StatusCode::CONFLICT,
            code,
            "Token refused",
            detail.to_owned(),
        )
    };
    match e {
        TokenError::AlreadyUsed => refused("already_used", "The token was already used."),
        TokenError::Expired => refused("expired", "The token expired."),
        TokenError::WrongPurpose => {
            refused("wrong_purpose", "The token was issued for another purpose.")
        }
        TokenError::WrongScope | TokenError::Unknown => {
            refused("unknown", "There is no such token.")
        }
        TokenError::Invalid(what) => Problem::invalid_request(format!(
            "`{what}` must be 1 to 128 visible ASCII characters."
        )),
        TokenError::Store(e) => Problem::store(e),
    }
}

/// Issues a token.
pub async fn issue(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<IssueBody>,
) -> Result<Response, Problem> {
    let ttl = Duration::from_millis(body.ttl_ms.unwrap_or(3_600_000));
    if ttl.is_zero() || ttl > MAX_TTL {
        return Err(Problem::invalid_request(
            "`ttl_ms` must be from 1 to 31536000000 (365 days).",
        ));
    }
    let issued = tokens(&state)
        .issue(caller.scope.as_str(), &body.purpose, ttl)
        .await
        .map_err(|e| problem(&e))?;
    let body = json!({"token": issued.token, "expires_at": rfc3339(issued.expires_at)});
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// Consumes a token.
pub async fn consume(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<ConsumeBody>,
) -> Result<Json<serde_json::Value>, Problem> {
    tokens(&state)
        .consume(caller.scope.as_str(), &body.token, &body.purpose)
        .await
        .map_err(|e| problem(&e))?;
    Ok(Json(json!({"consumed": true})))
}
