//! Scenario 7: an order's status under an optimistic lock: a change names the version it was
//! read at, and applies only if the order is still there; the change recorded right after that
//! version is the answer to a retry.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_guard::{Cas, Scalar};
use idem_http::Problem;
use serde::Deserialize;

use crate::db::{DbError, Tx};
use crate::schema::{Guard, Tables, order};
use crate::shop::Shop;
use crate::shop::support::{
    Reply, UNGUARDED_WINDOW, committed, db_problem, internal, order_json, parse, path_id, problem,
    record_version, retrying, unknown_order,
};

/// `GET /orders/{order}`: the order's status, version and amount.
pub(crate) async fn read_order(State(shop): State<Arc<Shop>>, Path(id): Path<String>) -> Reply {
    let id = path_id(&id, "order")?;
    let sql = format!(
        "SELECT status, version, amount FROM {} WHERE id = ?",
        shop.t.orders
    );
    // In a task of its own, like every database call here: a client that hangs up must not
    // drop a connection in the middle of a statement.
    let db = shop.db.clone();
    let read = tokio::spawn(async move { db.rows(&sql, &[id.into()]).await });
    let Ok(read) = read.await else {
        return Err(internal("the read failed"));
    };
    Ok(match read {
        Ok(rows) => match rows.first().map(|r| r.as_slice()) {
            Some([Scalar::Int(s), Scalar::Int(v), Scalar::Int(a)]) => {
                Json(order_json(id, *s, *v, *a)).into_response()
            }
            _ => unknown_order(id),
        },
        Err(e) => db_problem(&e),
    })
}

#[derive(Deserialize)]
struct UpdateRequest {
    expected_version: i64,
    status: String,
}

/// `PATCH /orders/{order}`: ships or cancels the order, if it is still at `expected_version`.
pub(crate) async fn update_order(
    State(shop): State<Arc<Shop>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Reply {
    let id = path_id(&id, "order")?;
    let req: UpdateRequest = parse(&body)?;
    let to = match req.status.as_str() {
        "shipped" => order::SHIPPED,
        "cancelled" => order::CANCELLED,
        _ => {
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "invalid_status",
                "Invalid status",
                "An order can be set to \"shipped\" or \"cancelled\".".into(),
            ));
        }
    };
    Ok(retrying(&shop, || {
        update_order_tx(&shop, id, req.expected_version, to)
    })
    .await)
}

fn version_conflict(current: i64) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        "version_conflict",
        "Version conflict",
        "The order changed since it was read; read it again.",
    )
    .with("current_version", current)
    .into_response()
}

fn not_allowed(from: i64, to: i64) -> Response {
    problem(
        StatusCode::CONFLICT,
        "invalid_transition",
        "Invalid transition",
        format!(
            "A {} order cannot become {}.",
            order::name(from),
            order::name(to)
        ),
    )
}

async fn order_row(tx: &mut Tx, t: &Tables, id: i64) -> Result<Option<(i64, i64)>, DbError> {
    let sql = format!("SELECT status, version FROM {} WHERE id = ?", t.orders);
    Ok(
        match tx
            .rows(&sql, &[id.into()])
            .await?
            .first()
            .map(|r| r.as_slice())
        {
            Some([Scalar::Int(s), Scalar::Int(v)]) => Some((*s, *v)),
            _ => None,
        },
    )
}

async fn update_order_tx(shop: &Shop, id: i64, expected: i64, to: i64) -> Result<Reply, DbError> {
    if !shop.guards.on(Guard::Version) {
        return update_order_unguarded(shop, id, expected, to).await;
    }
    let mut tx = shop.db.begin().await?;
    // The row lock first, as in `pay_tx` (in the payment scenario).
    tx.lock(&shop.order_row, id.into()).await?;
    let Some((status, version)) = order_row(&mut tx, &shop.t, id).await? else {
        return Ok(Err(unknown_order(id)));
    };
    if version != expected {
        return Ok(Err(already_changed(
            &mut tx, &shop.t, id, expected, to, version,
        )
        .await?));
    }
    // The status read above is the one `expected` names: the CAS below applies only if the
    // version (bumped by every change, payments included) is still `expected`.
    if !shop.order_state.allows(&status.into(), &to.into()) {
        return Ok(Err(not_allowed(status, to)));
    }
    match tx
        .cas(
            &shop.order_version,
            id.into(),
            expected,
            &[("status", to.into())],
        )
        .await?
    {
        Cas::Applied(new) => {
            record_version(&mut tx, &shop.t, id, new, to).await?;
            let amount = amount_of(&mut tx, &shop.t, id).await?;
            tx.commit().await?;
            let body = order_json(id, to, new, amount);
            Ok(Ok(committed(shop, Json(body).into_response())))
        }
        Cas::Conflict(current) => Ok(Err(already_changed(
            &mut tx, &shop.t, id, expected, to, current,
        )
        .await?)),
        Cas::NotFound => Ok(Err(unknown_order(id))),
    }
}

/// The answer to a change from version `expected` to `to` when the order is at `current`:
/// if the change that followed `expected` was this very one (the first attempt committed and
/// its answer was lost), the same answer again; otherwise a version conflict.
async fn already_changed(
    tx: &mut Tx,
    t: &Tables,
    id: i64,
    expected: i64,
    to: i64,
    current: i64,
) -> Result<Response, DbError> {
    let sql = format!(
        "SELECT status FROM {} WHERE order_id = ? AND version = ?",
        t.order_events
    );
    let next = expected.saturating_add(1);
    if tx.int(&sql, &[id.into(), next.into()]).await? == Some(to) {
        let amount = amount_of(tx, t, id).await?;
        return Ok(Json(order_json(id, to, next, amount)).into_response());
    }
    Ok(version_conflict(current))
}

async fn amount_of(tx: &mut Tx, t: &Tables, id: i64) -> Result<i64, DbError> {
    let sql = format!("SELECT amount FROM {} WHERE id = ?", t.orders);
    Ok(tx.int(&sql, &[id.into()]).await?.unwrap_or_default())
}

/// By hand: load the order, check, save without a version condition (the read happens
/// before the transaction, as an ORM's load-then-save does).
async fn update_order_unguarded(
    shop: &Shop,
    id: i64,
    expected: i64,
    to: i64,
) -> Result<Reply, DbError> {
    let mut read = shop.db.begin().await?;
    let Some((status, version)) = order_row(&mut read, &shop.t, id).await? else {
        return Ok(Err(unknown_order(id)));
    };
    read.commit().await?;
    tokio::time::sleep(UNGUARDED_WINDOW).await;
    if version != expected {
        return Ok(Err(version_conflict(version)));
    }
    if !shop.order_state.allows(&status.into(), &to.into()) {
        return Ok(Err(not_allowed(status, to)));
    }
    let mut tx = shop.db.begin().await?;
    let sql = format!(
        "UPDATE {} SET status = ?, version = version + 1 WHERE id = ?",
        shop.t.orders
    );
    tx.exec(&sql, &[to.into(), id.into()]).await?;
    let new = expected + 1;
    record_version(&mut tx, &shop.t, id, new, to).await?;
    let amount = amount_of(&mut tx, &shop.t, id).await?;
    tx.commit().await?;
    Ok(Ok(committed(
        shop,
        Json(order_json(id, to, new, amount)).into_response(),
    )))
}
