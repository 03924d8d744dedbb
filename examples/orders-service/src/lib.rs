//! A small order service: `POST /orders` creates an order and is guarded by
//! [`IdempotencyLayer`], so a client that retries after a timeout never creates two orders;
//! `GET /orders/{id}` reads one back (reads need no key).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_core::SharedStore;
use idem_http::{IdempotencyLayer, KeyRequirement, Policy};
use serde::{Deserialize, Serialize};

/// What a client asks for.
#[derive(Debug, Deserialize)]
pub struct NewOrder {
    /// The item.
    pub item: String,
    /// How many.
    pub quantity: u32,
}

/// A created order.
#[derive(Debug, Clone, Serialize)]
pub struct Order {
    /// Its id.
    pub id: u64,
    /// The item.
    pub item: String,
    /// How many.
    pub quantity: u32,
}

/// The service's orders.
#[derive(Clone, Default)]
pub struct Orders(Arc<Mutex<BTreeMap<u64, Order>>>);

impl Orders {
    /// How many orders exist.
    pub fn count(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

async fn create(State(orders): State<Orders>, Json(new): Json<NewOrder>) -> Response {
    if new.quantity == 0 {
        // A 4xx answer is stored too: a retry of a bad request gets the same refusal.
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            "quantity must be at least 1",
        )
            .into_response();
    }
    let mut map = orders.0.lock().unwrap_or_else(PoisonError::into_inner);
    let id = map.len() as u64 + 1;
    let order = Order {
        id,
        item: new.item,
        quantity: new.quantity,
    };
    map.insert(id, order.clone());
    (StatusCode::CREATED, Json(order)).into_response()
}

async fn read(State(orders): State<Orders>, Path(id): Path<u64>) -> Response {
    let map = orders.0.lock().unwrap_or_else(PoisonError::into_inner);
    match map.get(&id) {
        Some(order) => Json(order.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The service's routes over `store`, with `orders` as its data.
pub fn app(store: SharedStore, orders: Orders) -> Router {
    let idempotent = IdempotencyLayer::new(store, Policy::default().key(KeyRequirement::Required));
    Router::new()
        .route("/orders", post(create).layer(idempotent))
        .route("/orders/{id}", get(read))
        .with_state(orders)
}
