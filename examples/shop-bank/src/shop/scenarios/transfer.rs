//! Scenario 1: a transfer by a server-issued ticket (seed 001): the client asks for a ticket
//! first, and the ticket's row in the transfers table is the transfer's idempotency record;
//! both accounts are locked `FOR UPDATE` in id order and the debit is conditional.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_guard::{Bounded, Inserted, Locked, Scalar};
use idem_http::Problem;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::db::{DbError, int, text};
use crate::schema::{Guard, MERCHANT};
use crate::shop::Shop;
use crate::shop::support::{Reply, amount, committed, parse, path_id, problem, retrying};

#[derive(Deserialize)]
struct TicketRequest {
    account: i64,
}

/// `POST /tickets`: a ticket for one transfer from `account`.
pub(crate) async fn create_ticket(State(shop): State<Arc<Shop>>, body: Bytes) -> Reply {
    let req: TicketRequest = parse(&body)?;
    let ticket = shop.next_id()?;
    Ok(retrying(&shop, || create_ticket_tx(&shop, req.account, ticket)).await)
}

async fn create_ticket_tx(shop: &Shop, account: i64, ticket: i64) -> Result<Reply, DbError> {
    let mut tx = shop.db.begin().await?;
    let sql = format!("SELECT id FROM {} WHERE id = ?", shop.t.accounts);
    if account == MERCHANT || tx.int(&sql, &[account.into()]).await?.is_none() {
        return Ok(Err(unknown_account(account)));
    }
    let sql = format!(
        "INSERT INTO {} (ticket, account) VALUES (?, ?)",
        shop.t.tickets
    );
    tx.exec(&sql, &[ticket.into(), account.into()]).await?;
    tx.commit().await?;
    let body = json!({ "ticket": ticket.to_string(), "account": account });
    Ok(Ok((StatusCode::CREATED, Json(body)).into_response()))
}

fn unknown_account(account: i64) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "unknown_account",
        "Unknown account",
        format!("There is no customer account {account}."),
    )
}

#[derive(Deserialize, Serialize)]
struct TransferRequest {
    to: i64,
    amount: i64,
}

/// `PUT /accounts/{from}/transfers/{ticket}`: the transfer the ticket stands for.
pub(crate) async fn transfer(
    State(shop): State<Arc<Shop>>,
    Path((from, ticket)): Path<(String, String)>,
    body: Bytes,
) -> Reply {
    let from = path_id(&from, "account")?;
    let ticket = path_id(&ticket, "ticket")?;
    let req: TransferRequest = parse(&body)?;
    amount(req.amount, "amount")?;
    if req.to == from || req.to == MERCHANT {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_transfer",
            "Invalid transfer",
            "A transfer goes to another customer account.".into(),
        ));
    }
    Ok(retrying(&shop, || transfer_tx(&shop, from, ticket, &req)).await)
}

fn transfer_answer(ticket: i64, from: i64, to: i64, amount: i64, outcome: &str) -> Response {
    if outcome == "insufficient_funds" {
        return Problem::new(
            StatusCode::CONFLICT,
            "insufficient_funds",
            "Insufficient funds",
            "The account cannot pay this amount; the ticket is spent on this answer.",
        )
        .with("ticket", ticket.to_string())
        .into_response();
    }
    let body = json!({
        "ticket": ticket.to_string(), "from": from, "to": to, "amount": amount, "outcome": outcome,
    });
    (StatusCode::OK, Json(body)).into_response()
}

async fn transfer_tx(
    shop: &Shop,
    from: i64,
    ticket: i64,
    req: &TransferRequest,
) -> Result<Reply, DbError> {
    let t = &shop.t;
    let mut tx = shop.db.begin().await?;
    let sql = format!("SELECT account FROM {} WHERE ticket = ?", t.tickets);
    if tx.int(&sql, &[ticket.into()]).await? != Some(from) {
        return Ok(Err(problem(
            StatusCode::NOT_FOUND,
            "unknown_ticket",
            "Unknown ticket",
            format!("Account {from} was issued no such ticket; ask POST /tickets for one."),
        )));
    }
    let row: [Scalar; 5] = [
        ticket.into(),
        from.into(),
        req.to.into(),
        req.amount.into(),
        "pending".into(),
    ];
    if shop.guards.on(Guard::Ticket) {
        // The ticket's row is the transfer's idempotency record: a second attempt finds it
        // and answers as the first did.
        if let Inserted::Existing(v) = tx.insert(&shop.transfer, &row).await? {
            if (int(&v.0, 1), int(&v.0, 2), int(&v.0, 3)) != (from, req.to, req.amount) {
                return Ok(Err(problem(
                    StatusCode::CONFLICT,
                    "ticket_reused",
                    "Ticket reused",
                    "This ticket was spent on another transfer.".into(),
                )));
            }
            return Ok(Ok(transfer_answer(
                ticket,
                from,
                req.to,
                req.amount,
                &text(&v.0, 4),
            )));
        }
    } else {
        let sql = format!(
            "INSERT INTO {} (ticket, from_account, to_account, amount, outcome) VALUES (?, ?, ?, ?, ?)",
            t.transfers
        );
        tx.exec(&sql, &row).await?;
    }
    // Both rows locked in id order, so two opposite transfers cannot deadlock.
    let (a, b) = (from.min(req.to), from.max(req.to));
    for id in [a, b] {
        if tx.lock(&shop.account_row, id.into()).await? == Locked::NotFound {
            return Ok(Err(unknown_account(id)));
        }
    }
    let outcome = match tx.add(&shop.debit, from.into(), -req.amount).await? {
        Bounded::Applied(_) => {
            if !matches!(
                tx.add(&shop.credit, req.to.into(), req.amount).await?,
                Bounded::Applied(_)
            ) {
                return Ok(Err(unknown_account(req.to)));
            }
            "done"
        }
        Bounded::Insufficient(_) => "insufficient_funds",
        Bounded::Exceeded(_) | Bounded::NotFound => return Ok(Err(unknown_account(from))),
    };
    let sql = format!("UPDATE {} SET outcome = ? WHERE ticket = ?", t.transfers);
    tx.exec(&sql, &[outcome.into(), ticket.into()]).await?;
    tx.commit().await?;
    Ok(Ok(committed(
        shop,
        transfer_answer(ticket, from, req.to, req.amount, outcome),
    )))
}
