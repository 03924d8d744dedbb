//! Scenario 4: the order form and its one-time token (seeds 002/003): the form carries a token
//! in `Form-Token`, spent by the first submission; an order already made from the form is the
//! answer to a retry or a late double click, before any token is asked for.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use idem_guard::Scalar;
use idem_http::{FORM_TOKEN, ScopeSource};
use serde::Deserialize;
use serde_json::json;

use crate::db::DbError;
use crate::schema::{Guard, order};
use crate::shop::Shop;
use crate::shop::support::{
    Reply, amount, committed, db_problem, internal, name_like, order_json, parse, problem,
    record_version, retrying, user_id,
};

/// What the form's tokens are issued for.
const FORM_PURPOSE: &str = "order-form";

/// How long a form token is good for.
const FORM_TTL: Duration = Duration::from_secs(600);

/// `POST /form-tokens`: a one-time token for one order form.
pub(crate) async fn form_token(State(shop): State<Arc<Shop>>, req: Request) -> Response {
    let (parts, _) = req.into_parts();
    let scope = ScopeSource::default().scope_of(&parts);
    match shop
        .tokens
        .issue(scope.as_str(), FORM_PURPOSE, FORM_TTL)
        .await
    {
        Ok(issued) => {
            let body =
                json!({ "token": issued.token, "expires_at": issued.expires_at.as_millis() });
            (StatusCode::CREATED, Json(body)).into_response()
        }
        Err(e) => idem_http::token_problem(&e).into_response(),
    }
}

#[derive(Deserialize)]
struct OrderRequest {
    user: i64,
    form: String,
    amount: i64,
}

/// `POST /orders`: the order made from form `form`, its token in the `Form-Token` header.
pub(crate) async fn create_order(State(shop): State<Arc<Shop>>, request: Request) -> Reply {
    let (parts, body) = request.into_parts();
    // The layer in front has bounded the body already.
    let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
        return Err(parse::<OrderRequest>(&Bytes::new())
            .err()
            .unwrap_or_else(|| internal("body")));
    };
    let req: OrderRequest = parse(&body)?;
    user_id(req.user)?;
    amount(req.amount, "amount")?;
    name_like(&req.form, "form id")?;
    if shop.guards.on(Guard::Token) {
        // An order already made from this form is the answer: to a retry after the service
        // stopped before answering (whose token is spent), and to a late double click.
        if let Some(answer) = order_of_form(&shop, &req)
            .await
            .map_err(|e| db_problem(&e))?
        {
            return Ok(answer);
        }
        spend_token(&shop, &parts).await?;
    }
    let id = shop.next_id()?;
    Ok(retrying(&shop, || create_order_tx(&shop, id, &req)).await)
}

/// Spends the request's token from the `Form-Token` header.
async fn spend_token(shop: &Shop, parts: &Parts) -> Result<(), Response> {
    let scope = ScopeSource::default().scope_of(parts);
    let token = parts
        .headers
        .get(&FORM_TOKEN)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if token.is_empty() {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "token_missing",
            "Token missing",
            format!("This request needs a one-time token in the {FORM_TOKEN} header."),
        ));
    }
    match shop
        .tokens
        .consume(scope.as_str(), token, FORM_PURPOSE)
        .await
    {
        Ok(_) => Ok(()),
        Err(e) => Err(idem_http::token_problem(&e).into_response()),
    }
}

/// The answer for an order already made from `req.form`, if there is one.
async fn order_of_form(shop: &Shop, req: &OrderRequest) -> Result<Option<Response>, DbError> {
    let sql = format!(
        "SELECT id, user_id, amount FROM {} WHERE form = ?",
        shop.t.orders
    );
    let rows = shop.db.rows(&sql, &[req.form.as_str().into()]).await?;
    Ok(match rows.first().map(Vec::as_slice) {
        Some([Scalar::Int(id), Scalar::Int(user), Scalar::Int(amount)]) => {
            Some(if (*user, *amount) == (req.user, req.amount) {
                let body = order_json(*id, order::CREATED, 1, *amount);
                (StatusCode::CREATED, Json(body)).into_response()
            } else {
                problem(
                    StatusCode::CONFLICT,
                    "form_reused",
                    "Form reused",
                    "This form was submitted for another order.".into(),
                )
            })
        }
        _ => None,
    })
}

async fn create_order_tx(shop: &Shop, id: i64, req: &OrderRequest) -> Result<Reply, DbError> {
    let t = &shop.t;
    let mut tx = shop.db.begin().await?;
    let sql = format!(
        "INSERT INTO {} (id, user_id, form, amount, status, version) VALUES (?, ?, ?, ?, ?, 1)",
        t.orders
    );
    tx.exec(
        &sql,
        &[
            id.into(),
            req.user.into(),
            req.form.as_str().into(),
            req.amount.into(),
            order::CREATED.into(),
        ],
    )
    .await?;
    record_version(&mut tx, t, id, 1, order::CREATED).await?;
    tx.commit().await?;
    let body = order_json(id, order::CREATED, 1, req.amount);
    Ok(Ok(committed(
        shop,
        (StatusCode::CREATED, Json(body)).into_response(),
    )))
}
