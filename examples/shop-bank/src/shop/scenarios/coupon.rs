//! Scenario 3: a coupon hold through the state machine (seed 004): available → held, and an
//! expired coupon is answered `409 coupon_expired`, not taken for "already held"; the job that
//! expires coupons behind the holds' back.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_guard::{Scalar, Transition};
use serde::Deserialize;
use serde_json::json;

use crate::db::DbError;
use crate::schema::{Guard, coupon};
use crate::shop::Shop;
use crate::shop::support::{
    Reply, committed, internal, name_like, parse, path_id, problem, retrying,
};

impl Shop {
    /// Expires coupon `id` if no one holds it: the job that, in seed 004, moves a coupon on
    /// behind the hold's back.
    pub async fn expire_coupon(&self, id: i64) -> Result<Transition, DbError> {
        let mut tx = self.db.begin().await?;
        let t = tx
            .transition(
                &self.coupon_state,
                id.into(),
                coupon::AVAILABLE,
                coupon::EXPIRED,
            )
            .await?;
        tx.commit().await?;
        Ok(t)
    }
}

#[derive(Deserialize)]
struct HoldRequest {
    order_no: String,
}

/// `POST /coupons/{coupon}/hold`: holds the coupon for order `order_no`.
pub(crate) async fn hold_coupon(
    State(shop): State<Arc<Shop>>,
    Path(coupon_id): Path<String>,
    body: Bytes,
) -> Reply {
    let coupon_id = path_id(&coupon_id, "coupon")?;
    let req: HoldRequest = parse(&body)?;
    name_like(&req.order_no, "order number")?;
    Ok(retrying(&shop, || hold_tx(&shop, coupon_id, &req.order_no)).await)
}

fn held(coupon_id: i64, order_no: &str) -> Response {
    let body = json!({ "coupon": coupon_id, "order_no": order_no, "status": "held" });
    (StatusCode::OK, Json(body)).into_response()
}

async fn hold_tx(shop: &Shop, coupon_id: i64, order_no: &str) -> Result<Reply, DbError> {
    let t = &shop.t;
    let mut tx = shop.db.begin().await?;
    if !shop.guards.on(Guard::Coupon) {
        // Seed 004's hand-written hold: 0 rows changed is taken for "already held", which is
        // also what an expired coupon, or one another order holds, looks like.
        let sql = format!(
            "UPDATE {} SET status = ?, order_no = ? WHERE coupon = ? AND status = ?",
            t.coupons
        );
        tx.exec(
            &sql,
            &[
                coupon::HELD.into(),
                order_no.into(),
                coupon_id.into(),
                coupon::AVAILABLE.into(),
            ],
        )
        .await?;
        tx.commit().await?;
        return Ok(Ok(committed(shop, held(coupon_id, order_no))));
    }
    let outcome = tx
        .transition(
            &shop.coupon_state,
            coupon_id.into(),
            coupon::AVAILABLE,
            coupon::HELD,
        )
        .await?;
    let holder_sql = format!("SELECT order_no FROM {} WHERE coupon = ?", t.coupons);
    match outcome {
        Transition::Applied => {
            let sql = format!("UPDATE {} SET order_no = ? WHERE coupon = ?", t.coupons);
            tx.exec(&sql, &[order_no.into(), coupon_id.into()]).await?;
            tx.commit().await?;
            Ok(Ok(committed(shop, held(coupon_id, order_no))))
        }
        Transition::AlreadyThere => {
            let rows = tx.rows(&holder_sql, &[coupon_id.into()]).await?;
            let holder = match rows.first().and_then(|r| r.first()) {
                Some(Scalar::Text(s)) => s.clone(),
                _ => String::new(),
            };
            if holder == order_no {
                Ok(Ok(held(coupon_id, order_no)))
            } else {
                Ok(Err(problem(
                    StatusCode::CONFLICT,
                    "coupon_held",
                    "Coupon held",
                    format!("Coupon {coupon_id} is held by another order."),
                )))
            }
        }
        Transition::Conflict(Scalar::Int(coupon::EXPIRED)) => Ok(Err(problem(
            StatusCode::CONFLICT,
            "coupon_expired",
            "Coupon expired",
            format!("Coupon {coupon_id} expired before it was held."),
        ))),
        Transition::Conflict(_) => Ok(Err(internal("the coupon is in an unknown state"))),
        Transition::NotFound => Ok(Err(problem(
            StatusCode::NOT_FOUND,
            "unknown_coupon",
            "Unknown coupon",
            format!("There is no coupon {coupon_id}."),
        ))),
    }
}
