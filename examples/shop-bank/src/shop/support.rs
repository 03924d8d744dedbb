//! What every scenario's handlers share: the problem+json answers, the checks of what a
//! request carries, the transaction tried again after a deadlock, the answer the service's
//! chaos may lose after a commit, and the orders table as the order form, the payments and
//! the status changes all use it.

use std::future::Future;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_http::Problem;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::db::{DbError, Tx};
use crate::schema::{Tables, order};
use crate::shop::Shop;

// ---- answers ----

/// A handler's answer: `Ok` for what it did, `Err` for a refusal; both are HTTP responses.
pub(super) type Reply = Result<Response, Response>;

/// A problem+json answer.
pub(super) fn problem(
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
) -> Response {
    Problem::new(status, code, title, detail).into_response()
}

/// A 500: something the service did not expect.
pub(super) fn internal(detail: &str) -> Response {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "Internal error",
        detail.to_owned(),
    )
}

/// What a service that stopped after committing would have answered, had it answered.
pub(super) fn crashed() -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "simulated_crash",
        "The service stopped",
        "The work was committed and then the service stopped before answering (chaos).".into(),
    )
}

/// The answer for a database failure; all are 503s, not stored, so a retry runs again.
pub(super) fn db_problem(e: &DbError) -> Response {
    if e.is_transient() {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_busy",
            "Database busy",
            "The database could not finish the transaction now; nothing was changed.",
        )
        .retry_after(Duration::from_millis(50))
        .into_response()
    } else if matches!(e, DbError::CommitUnknown(_)) {
        problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "outcome_unknown",
            "Outcome unknown",
            "The database failed while committing; the change may have been made. Retry with \
             the same key: the operation's own record answers as the first attempt did."
                .into(),
        )
    } else {
        problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            "Database unavailable",
            "The database failed before committing; nothing was changed.".into(),
        )
    }
}

// ---- what a request carries ----

/// The request's JSON body.
pub(super) fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            "Invalid body",
            format!("The body is not the JSON this route takes: {e}"),
        )
    })
}

/// The largest amount, quantity or price taken: sums of many stay far from overflow.
pub const MAX_AMOUNT: i64 = 1_000_000_000;

/// An amount, quantity or price from 1 to [`MAX_AMOUNT`].
pub(super) fn amount(value: i64, what: &'static str) -> Result<(), Response> {
    if (1..=MAX_AMOUNT).contains(&value) {
        Ok(())
    } else {
        Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_amount",
            "Invalid amount",
            format!("The {what} must be from 1 to {MAX_AMOUNT}."),
        ))
    }
}

/// A user id, 1 or more.
pub(super) fn user_id(value: i64) -> Result<(), Response> {
    if value > 0 {
        Ok(())
    } else {
        Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_user",
            "Invalid user",
            "A user id is at least 1.".into(),
        ))
    }
}

/// A number in the path; axum's own refusal is plain text, and this API speaks problem+json.
pub(super) fn path_id(raw: &str, what: &'static str) -> Result<i64, Response> {
    raw.parse::<i64>().map_err(|_| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid_path",
            "Invalid path",
            format!("The {what} in the path must be a decimal number."),
        )
    })
}

/// An order number, SKU, form or payment id: 1 to 64 letters, digits, `-` or `_`.
pub(super) fn name_like(value: &str, what: &'static str) -> Result<(), Response> {
    if (1..=64).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        Ok(())
    } else {
        Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_name",
            "Invalid name",
            format!("The {what} must be 1 to 64 letters, digits, '-' or '_'."),
        ))
    }
}

// ---- transactions ----

/// Runs one transaction's worth of work, again after a deadlock or a busy database (the
/// transaction rolled back, so trying again is safe), a few times.
pub(super) async fn retry_transient<T, F, Fut>(shop: &Shop, mut work: F) -> Result<T, DbError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, DbError>>,
{
    // The service takes its time before the transaction, not inside it: on SQLite a
    // transaction holds the only write lock.
    shop.chaos.pause().await;
    let mut nap = Duration::from_millis(2);
    let mut attempt = 0;
    loop {
        match work().await {
            Err(e) if e.is_transient() && attempt < TRIES => {
                attempt += 1;
                tokio::time::sleep(nap).await;
                nap = (nap * 2).min(Duration::from_millis(100));
            }
            done => return done,
        }
    }
}

/// [`retry_transient`] for a handler: its answer, or the database's problem.
pub(super) async fn retrying<F, Fut>(shop: &Shop, work: F) -> Response
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Reply, DbError>>,
{
    match retry_transient(shop, work).await {
        Ok(Ok(r) | Err(r)) => r,
        Err(e) => db_problem(&e),
    }
}

/// How many times a transaction is tried again after a deadlock or a busy database.
const TRIES: u32 = 8;

/// How long a switched-off guard's hand-written code takes between reading and writing: long
/// enough that two requests sent at once both read before either writes, as they would on a
/// busy service.
pub(super) const UNGUARDED_WINDOW: Duration = Duration::from_millis(20);

/// Answers after a commit, unless the chaos stops the service first.
pub(super) fn committed(shop: &Shop, answer: Response) -> Response {
    if shop.chaos.crashes() {
        crashed()
    } else {
        answer
    }
}

// ---- the orders table ----

/// An order as the routes answer it.
pub(super) fn order_json(id: i64, status: i64, version: i64, amount: i64) -> Value {
    json!({ "order": id.to_string(), "status": order::name(status), "version": version, "amount": amount })
}

/// Records that order `order_id` became `status` at `version`: its history, which the audit
/// reads and a status change's retry is answered from.
pub(super) async fn record_version(
    tx: &mut Tx,
    t: &Tables,
    order_id: i64,
    version: i64,
    status: i64,
) -> Result<(), DbError> {
    let sql = format!(
        "INSERT INTO {} (order_id, version, status) VALUES (?, ?, ?)",
        t.order_events
    );
    tx.exec(&sql, &[order_id.into(), version.into(), status.into()])
        .await
        .map(drop)
}

/// The answer for an order that is not in the books.
pub(super) fn unknown_order(id: i64) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "unknown_order",
        "Unknown order",
        format!("There is no order {id}."),
    )
}
