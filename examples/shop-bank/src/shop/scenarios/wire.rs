//! Scenario 8: a wire to another bank in three steps (seed 001's transfer through a bank:
//! debit here, call the bank, record its answer), with recovery points.
//!
//! Each step's output is recorded on the wire's idem record before the next starts
//! (`Once::steps`). An attempt that stops half way (it dies between steps and its lease runs
//! out, or the bank's answer times out) leaves its finished steps behind; the retry resumes
//! after them instead of debiting or calling the bank again. The bank is called with the
//! step's own key, the same on every attempt, so a call repeated after a crash or a timeout
//! (a step's work runs at least once) is one wire at the bank.
//!
//! The debit is also safe to repeat by itself: it inserts the wire's row, unique by the
//! request's key, in the debit's transaction, so a debit whose recording was lost is found,
//! not made again.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem::{Done, Key, RunError, StepFailure, Steps};
use idem_core::{ClientKey, Namespace, Scope, SharedStore, SystemClock};
use idem_guard::{Bounded, Inserted};
use idem_http::Problem;
use rand::RngExt;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::bank::BankError;
use crate::db::{DbError, text};
use crate::schema::{Guard, MERCHANT};
use crate::shop::Shop;
use crate::shop::support::{
    Reply, amount, committed, crashed, db_problem, internal, name_like, parse, problem,
    retry_transient,
};

/// How long one attempt holds a wire's key: an attempt that dies holding it is taken over by
/// the next this long after.
const WIRE_LEASE: Duration = Duration::from_millis(300);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct WireRequest {
    from: i64,
    /// The account at the other bank.
    to: String,
    amount: i64,
}

/// A wire's answer: `sent` with the bank's receipt, or `insufficient_funds`.
#[derive(Debug, Serialize, Deserialize)]
struct Wired {
    wire: String,
    outcome: String,
    amount: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    receipt: Option<String>,
}

/// Why an attempt at a wire stopped; all are retryable, and a retry resumes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum WireError {
    /// The bank did not answer.
    Bank(BankError),
    /// The shop's database failed.
    Db(String),
}

/// `POST /wires`: wires `amount` from account `from` to account `to` at the other bank, once
/// per `Idempotency-Key`.
pub(crate) async fn wire(State(shop): State<Arc<Shop>>, headers: HeaderMap, body: Bytes) -> Reply {
    let req: WireRequest = parse(&body)?;
    amount(req.amount, "amount")?;
    name_like(&req.to, "account at the other bank")?;
    let key = wire_key(&headers)?;
    let sql = format!("SELECT id FROM {} WHERE id = ?", shop.t.accounts);
    let known = match shop.db.rows(&sql, &[req.from.into()]).await {
        Ok(rows) => !rows.is_empty(),
        Err(e) => return Err(db_problem(&e)),
    };
    if req.from == MERCHANT || !known {
        return Err(problem(
            StatusCode::NOT_FOUND,
            "unknown_account",
            "Unknown account",
            format!("There is no customer account {}.", req.from),
        ));
    }
    // In a task of its own, as the payment callbacks are: a client that hangs up does not
    // stop the wire half way, so a retry finds it finished (or running) rather than resumes it.
    let work = {
        let shop = shop.clone();
        async move { wire_once(&shop, &key, &req).await }
    };
    match tokio::spawn(work).await {
        Ok(Some(run)) => Ok(answer(&shop, run)),
        // The attempt died between two steps: what a dead service would have answered.
        Ok(None) => Ok(crashed()),
        Err(_) => Err(internal("the wire's work failed")),
    }
}

/// The wire's record: the request's `Idempotency-Key` (which the layer in front has checked)
/// in a namespace of its own.
fn wire_key(headers: &HeaderMap) -> Result<Key, Response> {
    let missing = || {
        problem(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            "Idempotency-Key required",
            "A wire needs an Idempotency-Key.".into(),
        )
    };
    let raw = idem_http::key_from_headers(headers)
        .ok()
        .flatten()
        .ok_or_else(missing)?;
    name_like(&raw, "Idempotency-Key of a wire")?;
    let scope = Scope::new("shop").map_err(|_| internal("scope"))?;
    let namespace = Namespace::new("wire").map_err(|_| internal("namespace"))?;
    let client = ClientKey::new(raw).map_err(|_| missing())?;
    Ok(Key::new(scope, namespace, client))
}

/// The wire under its record: in steps, or, with the guard off, all again on every attempt.
/// `None` if the attempt died between two steps (chaos).
async fn wire_once(
    shop: &Shop,
    key: &Key,
    req: &WireRequest,
) -> Option<Result<Done<Wired>, RunError<WireError>>> {
    let wire = key.client_key().as_str();
    let once = match shop.once.once(key).lease(WIRE_LEASE).input(req) {
        Ok(once) => once,
        Err(e) => return Some(Err(RunError::Codec(e))),
    };
    let died = Notify::new();
    let mut run = Box::pin(async {
        if shop.guards.on(Guard::Wire) {
            once.steps(|s| in_steps(s, shop, wire, req, &died)).await
        } else {
            once.run(|_| all_again(shop, wire, req, &died)).await
        }
    });
    tokio::select! {
        done = &mut run => Some(done),
        () = died.notified() => {
            // A process that dies runs no destructors: the attempt is never dropped, so
            // nothing gives its key back. The key stays held until its lease runs out and the
            // next attempt takes it over. (The demo leaks the attempt's memory; a dead process
            // would lose all of it.)
            std::mem::forget(run);
            None
        }
    }
}

/// The wire in three steps, resumed after the last one an earlier attempt recorded.
async fn in_steps(
    s: Steps<SharedStore, SystemClock>,
    shop: &Shop,
    wire: &str,
    req: &WireRequest,
    died: &Notify,
) -> Result<Wired, StepFailure<WireError>> {
    let status: String = s.step("debit", |_| debit(shop, wire, req)).await?;
    if status == "insufficient_funds" {
        return Ok(refused(wire, req));
    }
    die_here_now_and_then(shop, died).await;
    let is_timeout = |e: &WireError| *e == WireError::Bank(BankError::Timeout);
    let receipt: String = s
        .call("bank", is_timeout, |cx| async move {
            at_bank(shop, cx.key(), wire, req).await
        })
        .await?;
    die_here_now_and_then(shop, died).await;
    s.step("settle", |_| settle(shop, wire, req, receipt)).await
}

/// The switched-off guard: the wire as one piece of work that each attempt runs from the
/// start, calling the bank with a key of its own. The debit is found again (its row is
/// unique), but a bank call whose answer was lost is made again, and the bank takes the wire
/// twice.
async fn all_again(
    shop: &Shop,
    wire: &str,
    req: &WireRequest,
    died: &Notify,
) -> Result<Wired, WireError> {
    if debit(shop, wire, req).await? == "insufficient_funds" {
        return Ok(refused(wire, req));
    }
    die_here_now_and_then(shop, died).await;
    let call_key = format!("{:032x}", rand::rng().random::<u128>());
    let receipt = at_bank(shop, &call_key, wire, req).await?;
    die_here_now_and_then(shop, died).await;
    settle(shop, wire, req, receipt).await
}

/// Step 2: the call to the other bank under `call_key`.
async fn at_bank(
    shop: &Shop,
    call_key: &str,
    wire: &str,
    req: &WireRequest,
) -> Result<String, WireError> {
    let taken = shop
        .bank
        .take(&shop.db, &shop.chaos, call_key, wire, &req.to, req.amount);
    taken.await.map_err(WireError::Bank)
}

/// The attempt dies here now and then (chaos): it tells `died` and goes no further.
async fn die_here_now_and_then(shop: &Shop, died: &Notify) {
    if shop.chaos.crashes() {
        died.notify_one();
        std::future::pending::<()>().await;
    }
}

fn refused(wire: &str, req: &WireRequest) -> Wired {
    Wired {
        wire: wire.to_owned(),
        outcome: "insufficient_funds".into(),
        amount: req.amount,
        receipt: None,
    }
}

/// Step 1: the wire's row and the debit, in one transaction: `debited` or
/// `insufficient_funds`, the same for a repeat (the row is found, not made again).
async fn debit(shop: &Shop, wire: &str, req: &WireRequest) -> Result<String, WireError> {
    retry_transient(shop, || debit_tx(shop, wire, req))
        .await
        .map_err(|e| WireError::Db(e.to_string()))
}

async fn debit_tx(shop: &Shop, wire: &str, req: &WireRequest) -> Result<String, DbError> {
    let mut tx = shop.db.begin().await?;
    let row = [
        wire.into(),
        req.from.into(),
        req.to.as_str().into(),
        req.amount.into(),
        "debited".into(),
        "".into(),
    ];
    if let Inserted::Existing(v) = tx.insert(&shop.wire_row, &row).await? {
        let status = text(&v.0, 4);
        return Ok(if status == "insufficient_funds" {
            status
        } else {
            "debited".into()
        });
    }
    let status = match tx.add(&shop.debit, req.from.into(), -req.amount).await? {
        Bounded::Applied(_) => "debited",
        _ => "insufficient_funds",
    };
    let sql = format!("UPDATE {} SET status = ? WHERE wire = ?", shop.t.wires);
    tx.exec(&sql, &[status.into(), wire.into()]).await?;
    tx.commit().await?;
    Ok(status.into())
}

/// Step 3: the bank's receipt on the wire's row; the wire's answer.
async fn settle(
    shop: &Shop,
    wire: &str,
    req: &WireRequest,
    receipt: String,
) -> Result<Wired, WireError> {
    let sql = format!(
        "UPDATE {} SET status = 'sent', receipt = ? WHERE wire = ? AND status = 'debited'",
        shop.t.wires
    );
    let args = [receipt.as_str().into(), wire.into()];
    retry_transient(shop, || async {
        let mut tx = shop.db.begin().await?;
        tx.exec(&sql, &args).await?;
        tx.commit().await
    })
    .await
    .map_err(|e| WireError::Db(e.to_string()))?;
    Ok(Wired {
        wire: wire.to_owned(),
        outcome: "sent".into(),
        amount: req.amount,
        receipt: Some(receipt),
    })
}

/// The answer to a wire: its result, the same for every retry; a retryable stop is a 5xx, so
/// that the layer in front gives the key back and the retry resumes.
fn answer(shop: &Shop, run: Result<Done<Wired>, RunError<WireError>>) -> Response {
    let unavailable = |code: &'static str, title: &'static str, detail: String| {
        problem(StatusCode::SERVICE_UNAVAILABLE, code, title, detail)
    };
    match run {
        Ok(done) if done.value.outcome == "insufficient_funds" => Problem::new(
            StatusCode::CONFLICT,
            "insufficient_funds",
            "Insufficient funds",
            "The account cannot pay this wire; the key is spent on this answer.",
        )
        .with("wire", done.value.wire)
        .into_response(),
        Ok(done) => committed(shop, Json(done.value).into_response()),
        Err(RunError::Failed {
            error: WireError::Bank(BankError::Timeout),
            ..
        }) => problem(
            StatusCode::GATEWAY_TIMEOUT,
            "bank_timeout",
            "Bank timed out",
            "The other bank did not answer; a retry with the same key resumes the wire and asks \
             the bank again under the same key."
                .into(),
        ),
        Err(RunError::Failed { error, .. }) => {
            unavailable("wire_interrupted", "Wire interrupted", format!("{error:?}"))
        }
        // Not a 409: the layer in front would store it as the answer.
        Err(RunError::InProgress { retry_after }) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "wire_in_progress",
            "Wire in progress",
            "An earlier attempt at this wire still holds it; retry after it.",
        )
        .retry_after(retry_after)
        .into_response(),
        Err(RunError::Mismatch) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "wire_mismatch",
            "Wire mismatch",
            "This key was used for another wire.".into(),
        ),
        Err(e) => unavailable("wire_interrupted", "Wire interrupted", e.to_string()),
    }
}
