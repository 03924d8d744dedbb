//! The shop-and-bank service: every scheme of the seeds where the seeds use it, each behind
//! the `Idempotency-Key` layer, each written so that a switched-off guard falls back to the
//! hand-written code the seeds warn about.
//!
//! One file for each of the eight scenarios, in `scenarios/`, numbered as the README's table
//! lists them (and as the clients pick them); what their handlers share is in `support.rs`.

// A refusal is an HTTP answer built once per request; boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

mod scenarios;
mod support;

use std::sync::Arc;

use axum::Router;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use idem::{Idempotency, Tokens};
use idem_core::SharedStore;
use idem_guard::{Counter, RowLock, StateMachine, UniqueInsert, Versioned};
use idem_http::{IdempotencyLayer, KeyRequirement, Policy, Problem};
use idem_id::{Layout, Snowflake, SnowflakeOptions};

pub use support::MAX_AMOUNT;

use crate::chaos::ServerChaos;
use crate::db::Db;
use crate::schema::{Guards, Tables, coupon, order};
use scenarios::{
    account, coupon as coupons, inventory, order_form, order_status, payment, transfer, wire,
};
use support::{internal, problem};

/// The service's state.
pub struct Shop {
    db: Db,
    t: Tables,
    guards: Guards,
    ids: Snowflake,
    once: Idempotency<SharedStore>,
    tokens: Tokens,
    chaos: ServerChaos,
    open_account: UniqueInsert,
    transfer: UniqueInsert,
    deduction: UniqueInsert,
    debit: Counter,
    credit: Counter,
    stock: Counter,
    account_row: RowLock,
    order_row: RowLock,
    coupon_state: StateMachine,
    order_state: StateMachine,
    order_version: Versioned,
    events: Option<Arc<crate::events::Publisher>>,
    wire_row: UniqueInsert,
    bank: crate::bank::Bank,
}

impl Shop {
    /// The shop over `db` (whose tables `t` exist), keeping idem's records in `store`.
    pub fn new(
        db: Db,
        t: Tables,
        store: SharedStore,
        guards: Guards,
        chaos: ServerChaos,
    ) -> Result<Self, String> {
        let g = |e: idem_guard::GuardError| e.to_string();
        let ids = Snowflake::new(Layout::default(), 1, SnowflakeOptions::default())
            .map_err(|e| e.to_string())?;
        Ok(Self {
            open_account: UniqueInsert::new(
                &t.accounts,
                &["user_id"],
                &["id", "user_id", "balance"],
            )
            .map_err(g)?,
            transfer: UniqueInsert::new(
                &t.transfers,
                &["ticket"],
                &["ticket", "from_account", "to_account", "amount", "outcome"],
            )
            .map_err(g)?,
            deduction: UniqueInsert::new(
                &t.deductions,
                &["order_no"],
                &["order_no", "sku", "qty", "outcome"],
            )
            .map_err(g)?,
            debit: Counter::new(&t.accounts, "id", "balance")
                .map_err(g)?
                .floor(0),
            credit: Counter::new(&t.accounts, "id", "balance").map_err(g)?,
            stock: Counter::new(&t.stock, "sku", "avail").map_err(g)?.floor(0),
            account_row: RowLock::new(&t.accounts, "id").map_err(g)?,
            order_row: RowLock::new(&t.orders, "id").map_err(g)?,
            coupon_state: StateMachine::new(&t.coupons, "coupon", "status")
                .map_err(g)?
                .states([coupon::AVAILABLE, coupon::HELD, coupon::EXPIRED])
                .edge(coupon::AVAILABLE, coupon::HELD)
                .map_err(g)?
                .edge(coupon::AVAILABLE, coupon::EXPIRED)
                .map_err(g)?,
            order_state: StateMachine::new(&t.orders, "id", "status")
                .map_err(g)?
                .states([
                    order::CREATED,
                    order::PAID,
                    order::SHIPPED,
                    order::CANCELLED,
                ])
                .edge(order::CREATED, order::PAID)
                .map_err(g)?
                .edge(order::PAID, order::SHIPPED)
                .map_err(g)?
                .edge(order::CREATED, order::CANCELLED)
                .map_err(g)?,
            order_version: Versioned::new(&t.orders, "id", "version").map_err(g)?,
            events: None,
            wire_row: UniqueInsert::new(
                &t.wires,
                &["wire"],
                &[
                    "wire",
                    "from_account",
                    "to_account",
                    "amount",
                    "status",
                    "receipt",
                ],
            )
            .map_err(g)?,
            bank: crate::bank::Bank::new(&t.bank_wires)?,
            once: Idempotency::new(store.clone()),
            tokens: Tokens::new(store, Arc::new(idem::SystemClock)),
            db,
            t,
            guards,
            ids,
            chaos,
        })
    }

    /// Publishes an "order paid" event through `events` whenever a payment is credited.
    #[must_use]
    pub fn with_events(mut self, events: Arc<crate::events::Publisher>) -> Self {
        self.events = Some(events);
        self
    }

    /// Publishes the "order paid" event, if events are on. After the commit: the books hold
    /// the payment whether or not the broker takes the event.
    async fn order_paid(&self, order_id: i64) {
        if let Some(events) = &self.events {
            events.order_paid(order_id).await;
        }
    }

    /// The database.
    pub fn db(&self) -> &Db {
        &self.db
    }

    fn next_id(&self) -> Result<i64, Response> {
        let id = self.ids.try_next().map_err(|e| {
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ids_exhausted",
                "No id available",
                e.to_string(),
            )
            .into_response()
        })?;
        i64::try_from(id).map_err(|_| internal("an id does not fit a BIGINT"))
    }
}

/// The service's routes, scenario by scenario. Every write is behind the `Idempotency-Key`
/// layer (required), except the payment provider's callback, which carries no key and is
/// deduplicated by payment id.
pub fn app(shop: Arc<Shop>, store: SharedStore) -> Router {
    let policy = Policy::default()
        .methods([Method::POST, Method::PUT, Method::PATCH])
        .key(KeyRequirement::Required);
    let keyed = IdempotencyLayer::new(store, policy);
    let keyed_routes = [
        ("/tickets", post(transfer::create_ticket)),
        (
            "/accounts/{account}/transfers/{ticket}",
            put(transfer::transfer),
        ),
        ("/inventory/deductions", post(inventory::deduct)),
        ("/coupons/{coupon}/hold", post(coupons::hold_coupon)),
        ("/form-tokens", post(order_form::form_token)),
        ("/orders", post(order_form::create_order)),
        ("/users/{user}/account", post(account::open_account)),
        (
            "/orders/{order}",
            get(order_status::read_order).patch(order_status::update_order),
        ),
        ("/wires", post(wire::wire)),
    ];
    let mut router = Router::new();
    for (path, route) in keyed_routes {
        router = router.route(path, route.layer(keyed.clone()));
    }
    router
        .route("/payments/callback", post(payment::payment_callback))
        .fallback(|| async {
            problem(
                StatusCode::NOT_FOUND,
                "not_found",
                "Not found",
                "The shop has no such route.".into(),
            )
        })
        .method_not_allowed_fallback(|| async {
            problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "Method not allowed",
                "This route does not take that method.".into(),
            )
        })
        .with_state(shop)
}
