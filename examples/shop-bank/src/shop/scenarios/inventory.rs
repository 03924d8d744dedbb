//! Scenario 2: an inventory deduction keyed by order number (seed 004): the order number's row
//! in the deductions table is the deduction's record, the stock is taken by a conditional
//! decrement, and "insufficient stock" is stored and replayed as the order's answer.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_guard::{Bounded, Inserted, Scalar};
use idem_http::Problem;
use serde::Deserialize;
use serde_json::json;

use crate::db::{DbError, int, text};
use crate::schema::Guard;
use crate::shop::Shop;
use crate::shop::support::{
    Reply, UNGUARDED_WINDOW, amount, committed, name_like, parse, problem, retrying,
};

#[derive(Deserialize)]
struct DeductRequest {
    order_no: String,
    sku: String,
    qty: i64,
}

/// `POST /inventory/deductions`: takes `qty` items of `sku` for order `order_no`, once.
pub(crate) async fn deduct(State(shop): State<Arc<Shop>>, body: Bytes) -> Reply {
    let req: DeductRequest = parse(&body)?;
    name_like(&req.order_no, "order number")?;
    name_like(&req.sku, "SKU")?;
    amount(req.qty, "quantity")?;
    Ok(retrying(&shop, || deduct_tx(&shop, &req)).await)
}

fn deduct_answer(req: &DeductRequest, outcome: &str) -> Response {
    if outcome == "insufficient_stock" {
        return Problem::new(
            StatusCode::CONFLICT,
            "insufficient_stock",
            "Insufficient stock",
            "Not enough items are left; this order's deduction failed for good.",
        )
        .with("order_no", req.order_no.clone())
        .into_response();
    }
    let body =
        json!({ "order_no": req.order_no, "sku": req.sku, "qty": req.qty, "outcome": outcome });
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn deduct_tx(shop: &Shop, req: &DeductRequest) -> Result<Reply, DbError> {
    let t = &shop.t;
    if !shop.guards.on(Guard::Stock) {
        return deduct_unguarded(shop, req).await;
    }
    let mut tx = shop.db.begin().await?;
    let row: [Scalar; 4] = [
        req.order_no.as_str().into(),
        req.sku.as_str().into(),
        req.qty.into(),
        "pending".into(),
    ];
    if let Inserted::Existing(v) = tx.insert(&shop.deduction, &row).await? {
        if text(&v.0, 1) != req.sku || int(&v.0, 2) != req.qty {
            return Ok(Err(problem(
                StatusCode::CONFLICT,
                "order_reused",
                "Order number reused",
                "This order number was deducted for other items.".into(),
            )));
        }
        return Ok(Ok(deduct_answer(req, &text(&v.0, 3))));
    }
    let outcome = match tx
        .add(&shop.stock, req.sku.as_str().into(), -req.qty)
        .await?
    {
        Bounded::Applied(_) => "deducted",
        Bounded::Insufficient(_) => "insufficient_stock",
        Bounded::Exceeded(_) | Bounded::NotFound => return Ok(Err(unknown_sku(&req.sku))),
    };
    let sql = format!("UPDATE {} SET outcome = ? WHERE order_no = ?", t.deductions);
    tx.exec(&sql, &[outcome.into(), req.order_no.as_str().into()])
        .await?;
    tx.commit().await?;
    Ok(Ok(committed(shop, deduct_answer(req, outcome))))
}

/// By hand: read the stock, check it, then take the items; every request deducts, and two
/// that read at once can take the last items twice.
async fn deduct_unguarded(shop: &Shop, req: &DeductRequest) -> Result<Reply, DbError> {
    let t = &shop.t;
    let sql = format!("SELECT avail FROM {} WHERE sku = ?", t.stock);
    let rows = shop.db.rows(&sql, &[req.sku.as_str().into()]).await?;
    let Some(Some(Scalar::Int(avail))) = rows.first().map(|r| r.first()) else {
        return Ok(Err(unknown_sku(&req.sku)));
    };
    tokio::time::sleep(UNGUARDED_WINDOW).await;
    let outcome = if *avail >= req.qty {
        "deducted"
    } else {
        "insufficient_stock"
    };
    let mut tx = shop.db.begin().await?;
    let sql = format!(
        "INSERT INTO {} (order_no, sku, qty, outcome) VALUES (?, ?, ?, ?)",
        t.deductions
    );
    tx.exec(
        &sql,
        &[
            req.order_no.as_str().into(),
            req.sku.as_str().into(),
            req.qty.into(),
            outcome.into(),
        ],
    )
    .await?;
    if outcome == "deducted" {
        let sql = format!("UPDATE {} SET avail = avail - ? WHERE sku = ?", t.stock);
        tx.exec(&sql, &[req.qty.into(), req.sku.as_str().into()])
            .await?;
    }
    tx.commit().await?;
    Ok(Ok(committed(shop, deduct_answer(req, outcome))))
}

fn unknown_sku(sku: &str) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "unknown_sku",
        "Unknown SKU",
        format!("The shop does not stock {sku}."),
    )
}
