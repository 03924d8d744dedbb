//! Scenario 5: one fund account per user (seed 001): a unique index on the user, and
//! insert-or-replay on it, however many opens race.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use idem_guard::{Inserted, Scalar};
use serde_json::json;

use crate::db::{DbError, int};
use crate::schema::Guard;
use crate::shop::Shop;
use crate::shop::support::{Reply, UNGUARDED_WINDOW, committed, path_id, retrying, user_id};

/// `POST /users/{user}/account`: the user's fund account, opened if it has none.
pub(crate) async fn open_account(State(shop): State<Arc<Shop>>, Path(user): Path<String>) -> Reply {
    let user = path_id(&user, "user id")?;
    user_id(user)?;
    let id = shop.next_id()?;
    Ok(retrying(&shop, || open_account_tx(&shop, user, id)).await)
}

async fn open_account_tx(shop: &Shop, user: i64, id: i64) -> Result<Reply, DbError> {
    if !shop.guards.on(Guard::Account) {
        return open_account_unguarded(shop, user, id).await;
    }
    let mut tx = shop.db.begin().await?;
    let (status, account) = match tx
        .insert(&shop.open_account, &[id.into(), user.into(), 0.into()])
        .await?
    {
        Inserted::New(row) => (StatusCode::CREATED, int(&row.0, 0)),
        Inserted::Existing(row) => (StatusCode::OK, int(&row.0, 0)),
    };
    tx.commit().await?;
    let body = json!({ "account": account.to_string(), "user": user });
    Ok(Ok(committed(shop, (status, Json(body)).into_response())))
}

/// By hand: look for the account, and insert one if there was none. Two requests that look
/// at once both insert.
async fn open_account_unguarded(shop: &Shop, user: i64, id: i64) -> Result<Reply, DbError> {
    let sql = format!("SELECT id FROM {} WHERE user_id = ?", shop.t.accounts);
    let found = shop.db.rows(&sql, &[user.into()]).await?;
    tokio::time::sleep(UNGUARDED_WINDOW).await;
    let (status, account) =
        if let Some(Some(Scalar::Int(existing))) = found.first().map(|r| r.first()) {
            (StatusCode::OK, *existing)
        } else {
            let sql = format!(
                "INSERT INTO {} (id, user_id, balance) VALUES (?, ?, 0)",
                shop.t.accounts
            );
            shop.db.exec(&sql, &[id.into(), user.into()]).await?;
            (StatusCode::CREATED, id)
        };
    let body = json!({ "account": account.to_string(), "user": user });
    Ok(Ok(committed(shop, (status, Json(body)).into_response())))
}
