//! The shop-and-bank service: every scheme of the seeds where the seeds use it, each behind
//! the `Idempotency-Key` layer, each written so that a switched-off guard falls back to the
//! hand-written code the seeds warn about.

// A refusal is an HTTP answer built once per request; boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use idem::{Idempotency, InFlight, RunError, Tokens};
use idem_core::{ClientKey, Key, Namespace, Scope, SharedStore};
use idem_guard::{
    Bounded, Cas, Counter, Inserted, Locked, RowLock, Scalar, StateMachine, Transition,
    UniqueInsert, Versioned,
};
use idem_http::{FORM_TOKEN, IdempotencyLayer, KeyRequirement, Policy, Problem, ScopeSource};
use idem_id::{Layout, Snowflake, SnowflakeOptions};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::db::{Db, DbError, Tx, int, text};
use crate::schema::{Guard, Guards, MERCHANT, Tables, coupon, order};

/// What the service itself does wrong on purpose: it stops (as a crashed process would) after
/// committing, before answering, and it takes its time.
#[derive(Debug)]
pub struct ServerChaos {
    crash: f64,
    pause_ms: u64,
    rng: Mutex<StdRng>,
}

impl ServerChaos {
    /// No failures, no pauses.
    pub fn off() -> Self {
        Self::new(0.0, 0, 0)
    }

    /// Fails after committing with probability `crash`; pauses up to `pause_ms` inside each
    /// operation.
    pub fn new(crash: f64, pause_ms: u64, seed: u64) -> Self {
        Self {
            crash: crash.clamp(0.0, 1.0),
            pause_ms,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
        }
    }

    fn roll(&self) -> (bool, u64) {
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        let crash = rng.random_bool(self.crash);
        let pause = if self.pause_ms == 0 {
            0
        } else {
            rng.random_range(0..=self.pause_ms)
        };
        (crash, pause)
    }

    /// Takes its time.
    async fn pause(&self) {
        let (_, ms) = self.roll();
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// Whether to fail now, after the work committed.
    fn crashes(&self) -> bool {
        self.roll().0
    }
}

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
}

/// How long a form token is good for.
const FORM_TTL: Duration = Duration::from_secs(600);

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

/// The service's routes. Every write is behind the `Idempotency-Key` layer (required), except
/// the payment provider's callback, which carries no key and is deduplicated by payment id.
pub fn app(shop: Arc<Shop>, store: SharedStore) -> Router {
    let policy = Policy::default()
        .methods([Method::POST, Method::PUT, Method::PATCH])
        .key(KeyRequirement::Required);
    let keyed = IdempotencyLayer::new(store, policy);
    Router::new()
        .route(
            "/users/{user}/account",
            post(open_account).layer(keyed.clone()),
        )
        .route("/tickets", post(create_ticket).layer(keyed.clone()))
        .route(
            "/accounts/{account}/transfers/{ticket}",
            put(transfer).layer(keyed.clone()),
        )
        .route("/inventory/deductions", post(deduct).layer(keyed.clone()))
        .route(
            "/coupons/{coupon}/hold",
            post(hold_coupon).layer(keyed.clone()),
        )
        .route("/form-tokens", post(form_token).layer(keyed.clone()))
        .route("/orders", post(create_order).layer(keyed.clone()))
        .route(
            "/orders/{order}",
            get(read_order).patch(update_order).layer(keyed),
        )
        .route("/payments/callback", post(payment_callback))
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

const FORM_PURPOSE: &str = "order-form";

fn problem(
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
) -> Response {
    Problem::new(status, code, title, detail).into_response()
}

fn internal(detail: &str) -> Response {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "Internal error",
        detail.to_owned(),
    )
}

fn crashed() -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "simulated_crash",
        "The service stopped",
        "The work was committed and then the service stopped before answering (chaos).".into(),
    )
}

fn db_problem(e: &DbError) -> Response {
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

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, Response> {
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

fn amount(value: i64, what: &'static str) -> Result<(), Response> {
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

fn user_id(value: i64) -> Result<(), Response> {
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
fn path_id(raw: &str, what: &'static str) -> Result<i64, Response> {
    raw.parse::<i64>().map_err(|_| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid_path",
            "Invalid path",
            format!("The {what} in the path must be a decimal number."),
        )
    })
}

fn name_like(value: &str, what: &'static str) -> Result<(), Response> {
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

/// Runs one transaction's worth of work, again after a deadlock or a busy database (the
/// transaction rolled back, so trying again is safe), a few times.
async fn retry_transient<T, F, Fut>(shop: &Shop, mut work: F) -> Result<T, DbError>
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
async fn retrying<F, Fut>(shop: &Shop, work: F) -> Response
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Result<Response, Response>, DbError>>,
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
const UNGUARDED_WINDOW: Duration = Duration::from_millis(20);

/// Answers after a commit, unless the chaos stops the service first.
fn committed(shop: &Shop, answer: Response) -> Response {
    if shop.chaos.crashes() {
        crashed()
    } else {
        answer
    }
}

// ---- 5. one fund account per user (unique index) ----

async fn open_account(State(shop): State<Arc<Shop>>, Path(user): Path<String>) -> Response {
    let user = match path_id(&user, "user id") {
        Ok(u) => u,
        Err(r) => return r,
    };
    if let Err(r) = user_id(user) {
        return r;
    }
    let id = match shop.next_id() {
        Ok(id) => id,
        Err(r) => return r,
    };
    retrying(&shop, || open_account_tx(&shop, user, id)).await
}

async fn open_account_tx(
    shop: &Shop,
    user: i64,
    id: i64,
) -> Result<Result<Response, Response>, DbError> {
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
async fn open_account_unguarded(
    shop: &Shop,
    user: i64,
    id: i64,
) -> Result<Result<Response, Response>, DbError> {
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

// ---- 1. transfer by a server-issued ticket ----

#[derive(Deserialize)]
struct TicketRequest {
    account: i64,
}

async fn create_ticket(State(shop): State<Arc<Shop>>, body: Bytes) -> Response {
    let req: TicketRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let ticket = match shop.next_id() {
        Ok(id) => id,
        Err(r) => return r,
    };
    retrying(&shop, || create_ticket_tx(&shop, req.account, ticket)).await
}

async fn create_ticket_tx(
    shop: &Shop,
    account: i64,
    ticket: i64,
) -> Result<Result<Response, Response>, DbError> {
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

async fn transfer(
    State(shop): State<Arc<Shop>>,
    Path((from, ticket)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let (from, ticket) =
        match path_id(&from, "account").and_then(|f| Ok((f, path_id(&ticket, "ticket")?))) {
            Ok(ids) => ids,
            Err(r) => return r,
        };
    let req: TransferRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = amount(req.amount, "amount") {
        return r;
    }
    if req.to == from || req.to == MERCHANT {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid_transfer",
            "Invalid transfer",
            "A transfer goes to another customer account.".into(),
        );
    }
    retrying(&shop, || transfer_tx(&shop, from, ticket, &req)).await
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
) -> Result<Result<Response, Response>, DbError> {
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

// ---- 2. inventory deduction keyed by order number ----

#[derive(Deserialize)]
struct DeductRequest {
    order_no: String,
    sku: String,
    qty: i64,
}

async fn deduct(State(shop): State<Arc<Shop>>, body: Bytes) -> Response {
    let req: DeductRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = name_like(&req.order_no, "order number")
        .and_then(|()| name_like(&req.sku, "SKU"))
        .and_then(|()| amount(req.qty, "quantity"))
    {
        return r;
    }
    retrying(&shop, || deduct_tx(&shop, &req)).await
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

async fn deduct_tx(
    shop: &Shop,
    req: &DeductRequest,
) -> Result<Result<Response, Response>, DbError> {
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
async fn deduct_unguarded(
    shop: &Shop,
    req: &DeductRequest,
) -> Result<Result<Response, Response>, DbError> {
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

// ---- 3. coupon hold through the state machine ----

#[derive(Deserialize)]
struct HoldRequest {
    order_no: String,
}

async fn hold_coupon(
    State(shop): State<Arc<Shop>>,
    Path(coupon_id): Path<String>,
    body: Bytes,
) -> Response {
    let coupon_id = match path_id(&coupon_id, "coupon") {
        Ok(c) => c,
        Err(r) => return r,
    };
    let req: HoldRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = name_like(&req.order_no, "order number") {
        return r;
    }
    retrying(&shop, || hold_tx(&shop, coupon_id, &req.order_no)).await
}

fn held(coupon_id: i64, order_no: &str) -> Response {
    let body = json!({ "coupon": coupon_id, "order_no": order_no, "status": "held" });
    (StatusCode::OK, Json(body)).into_response()
}

async fn hold_tx(
    shop: &Shop,
    coupon_id: i64,
    order_no: &str,
) -> Result<Result<Response, Response>, DbError> {
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

// ---- 4. the order form and its one-time token ----

async fn form_token(State(shop): State<Arc<Shop>>, req: Request) -> Response {
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

async fn create_order(State(shop): State<Arc<Shop>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    // The layer in front has bounded the body already.
    let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
        return parse::<OrderRequest>(&Bytes::new())
            .err()
            .unwrap_or_else(|| internal("body"));
    };
    let req: OrderRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = user_id(req.user)
        .and_then(|()| amount(req.amount, "amount"))
        .and_then(|()| name_like(&req.form, "form id"))
    {
        return r;
    }
    if shop.guards.on(Guard::Token) {
        // An order already made from this form is the answer: to a retry after the service
        // stopped before answering (whose token is spent), and to a late double click.
        match order_of_form(&shop, &req).await {
            Err(e) => return db_problem(&e),
            Ok(Some(answer)) => return answer,
            Ok(None) => {
                let scope = ScopeSource::default().scope_of(&parts);
                let token = parts
                    .headers
                    .get(&FORM_TOKEN)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                if token.is_empty() {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        "token_missing",
                        "Token missing",
                        format!("This request needs a one-time token in the {FORM_TOKEN} header."),
                    );
                }
                if let Err(e) = shop
                    .tokens
                    .consume(scope.as_str(), token, FORM_PURPOSE)
                    .await
                {
                    return idem_http::token_problem(&e).into_response();
                }
            }
        }
    }
    let id = match shop.next_id() {
        Ok(id) => id,
        Err(r) => return r,
    };
    retrying(&shop, || create_order_tx(&shop, id, &req)).await
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

async fn create_order_tx(
    shop: &Shop,
    id: i64,
    req: &OrderRequest,
) -> Result<Result<Response, Response>, DbError> {
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

fn order_json(id: i64, status: i64, version: i64, amount: i64) -> Value {
    json!({ "order": id.to_string(), "status": order::name(status), "version": version, "amount": amount })
}

async fn record_version(
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

async fn read_order(State(shop): State<Arc<Shop>>, Path(id): Path<String>) -> Response {
    let id = match path_id(&id, "order") {
        Ok(id) => id,
        Err(r) => return r,
    };
    let sql = format!(
        "SELECT status, version, amount FROM {} WHERE id = ?",
        shop.t.orders
    );
    // In a task of its own, like every database call here: a client that hangs up must not
    // drop a connection in the middle of a statement.
    let db = shop.db.clone();
    let read = tokio::spawn(async move { db.rows(&sql, &[id.into()]).await });
    let Ok(read) = read.await else {
        return internal("the read failed");
    };
    match read {
        Ok(rows) => match rows.first().map(|r| r.as_slice()) {
            Some([Scalar::Int(s), Scalar::Int(v), Scalar::Int(a)]) => {
                Json(order_json(id, *s, *v, *a)).into_response()
            }
            _ => unknown_order(id),
        },
        Err(e) => db_problem(&e),
    }
}

fn unknown_order(id: i64) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "unknown_order",
        "Unknown order",
        format!("There is no order {id}."),
    )
}

// ---- 7. order status under an optimistic lock ----

#[derive(Deserialize)]
struct UpdateRequest {
    expected_version: i64,
    status: String,
}

async fn update_order(
    State(shop): State<Arc<Shop>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let id = match path_id(&id, "order") {
        Ok(id) => id,
        Err(r) => return r,
    };
    let req: UpdateRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let to = match req.status.as_str() {
        "shipped" => order::SHIPPED,
        "cancelled" => order::CANCELLED,
        _ => {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid_status",
                "Invalid status",
                "An order can be set to \"shipped\" or \"cancelled\".".into(),
            );
        }
    };
    if shop.guards.on(Guard::Version) {
        retrying(&shop, || {
            update_order_tx(&shop, id, req.expected_version, to)
        })
        .await
    } else {
        retrying(&shop, || {
            update_order_unguarded(&shop, id, req.expected_version, to)
        })
        .await
    }
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

async fn update_order_tx(
    shop: &Shop,
    id: i64,
    expected: i64,
    to: i64,
) -> Result<Result<Response, Response>, DbError> {
    let mut tx = shop.db.begin().await?;
    // The row lock first, as in `pay_tx`.
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
) -> Result<Result<Response, Response>, DbError> {
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

// ---- 6. payment callbacks, front and back channel ----

#[derive(Deserialize)]
struct Callback {
    payment: String,
    order: String,
    amount: i64,
    channel: String,
}

/// What a payment callback answers, stored under the payment id and replayed to its
/// duplicates.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Paid {
    payment: String,
    order: String,
    status: String,
}

/// Why a callback is refused for good, or why it could not be handled now.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum PayError {
    Refused { code: String, detail: String },
    Transient(String),
}

impl PayError {
    fn refused(code: &str, detail: String) -> Self {
        PayError::Refused {
            code: code.to_owned(),
            detail,
        }
    }
}

async fn payment_callback(State(shop): State<Arc<Shop>>, body: Bytes) -> Response {
    let cb: Callback = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = name_like(&cb.payment, "payment id").and_then(|()| amount(cb.amount, "amount"))
    {
        return r;
    }
    if cb.channel != "front" && cb.channel != "back" {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid_channel",
            "Invalid channel",
            "A callback comes on the \"front\" or the \"back\" channel.".into(),
        );
    }
    let Ok(order_id) = cb.order.parse::<i64>() else {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid_order",
            "Invalid order",
            "The order id is a decimal number.".into(),
        );
    };
    if !shop.guards.on(Guard::Payment) {
        let work = async move { retrying(&shop, || pay_unguarded(&shop, &cb, order_id)).await };
        return tokio::spawn(work)
            .await
            .unwrap_or_else(|_| internal("the payment's work failed"));
    }
    let key = match payment_key(&cb.payment) {
        Ok(k) => k,
        Err(r) => return r,
    };
    // In a task of its own: a provider that hangs up must not cancel the work half way, nor
    // the taking of the payment's key (which would leave it held until its lease ran out).
    let Ok(run) = tokio::spawn(pay_once(shop, cb, order_id, key)).await else {
        return internal("the payment's work failed");
    };
    match run {
        Ok(done) => Json(done.value).into_response(),
        Err(RunError::Failed {
            error: PayError::Refused { code, detail },
            ..
        }) => {
            let (status, code) = match code.as_str() {
                "unknown_order" => (StatusCode::NOT_FOUND, "unknown_order"),
                "amount_mismatch" => (StatusCode::CONFLICT, "amount_mismatch"),
                "order_cancelled" => (StatusCode::CONFLICT, "order_cancelled"),
                "already_paid" => (StatusCode::CONFLICT, "already_paid"),
                _ => return internal("a stored refusal has an unknown code"),
            };
            problem(status, code, "Payment refused", detail)
        }
        Err(RunError::Failed {
            error: PayError::Transient(detail),
            ..
        }) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "payment_not_recorded",
            "Payment not recorded",
            detail,
        ),
        Err(RunError::Mismatch) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "payment_mismatch",
            "Payment mismatch",
            "This payment id was reported with another order or amount.".into(),
        ),
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "payment_not_recorded",
            "Payment not recorded",
            e.to_string(),
        ),
    }
}

/// Both channels' callbacks for one payment share its record: the first runs the work, a
/// concurrent one waits for it, a late one gets the stored answer. The channel is not part of
/// the input.
async fn pay_once(
    shop: Arc<Shop>,
    cb: Callback,
    order_id: i64,
    key: Key,
) -> Result<idem::Done<Paid>, RunError<PayError>> {
    let once = shop
        .once
        .once(&key)
        .input(&(&cb.payment, order_id, cb.amount))
        .map_err(RunError::Codec)?;
    once.in_flight(InFlight::Wait(Duration::from_secs(10)))
        .permanent_if(|e: &PayError| matches!(e, PayError::Refused { .. }))
        .run(|_lease| pay(&shop, &cb, order_id))
        .await
}

fn payment_key(payment: &str) -> Result<Key, Response> {
    let namespace = Namespace::new("payment-callback").map_err(|_| internal("namespace"))?;
    let scope = Scope::new("provider").map_err(|_| internal("scope"))?;
    let key = ClientKey::new(payment).map_err(|_| internal("payment key"))?;
    Ok(Key::new(scope, namespace, key))
}

async fn pay(shop: &Shop, cb: &Callback, order_id: i64) -> Result<Paid, PayError> {
    retry_transient(shop, || pay_tx(shop, cb, order_id))
        .await
        .unwrap_or_else(|e| Err(PayError::Transient(e.to_string())))
}

async fn pay_tx(
    shop: &Shop,
    cb: &Callback,
    order_id: i64,
) -> Result<Result<Paid, PayError>, DbError> {
    let t = &shop.t;
    let mut tx = shop.db.begin().await?;
    // The row lock first: on MySQL/MariaDB (REPEATABLE READ) the reads below then see the
    // order as it is now, not as an earlier snapshot had it.
    tx.lock(&shop.order_row, order_id.into()).await?;
    let sql = format!("SELECT amount FROM {} WHERE id = ?", t.orders);
    let Some(amount) = tx.int(&sql, &[order_id.into()]).await? else {
        return Ok(Err(PayError::refused(
            "unknown_order",
            format!("There is no order {order_id}."),
        )));
    };
    if amount != cb.amount {
        return Ok(Err(PayError::refused(
            "amount_mismatch",
            format!("Order {order_id} costs {amount}, not {}.", cb.amount),
        )));
    }
    let paid = Paid {
        payment: cb.payment.clone(),
        order: order_id.to_string(),
        status: "paid".into(),
    };
    match tx
        .transition(
            &shop.order_state,
            order_id.into(),
            order::CREATED,
            order::PAID,
        )
        .await?
    {
        Transition::Applied => {
            let sql = format!("UPDATE {} SET version = version + 1 WHERE id = ?", t.orders);
            tx.exec(&sql, &[order_id.into()]).await?;
            let sql = format!("SELECT version FROM {} WHERE id = ?", t.orders);
            let version = tx.int(&sql, &[order_id.into()]).await?.unwrap_or_default();
            record_version(&mut tx, t, order_id, version, order::PAID).await?;
            if !credit_merchant(shop, &mut tx, cb, order_id).await? {
                return Ok(Err(PayError::Transient(
                    "the merchant cannot be credited".into(),
                )));
            }
            tx.commit().await?;
            shop.order_paid(order_id).await;
            if shop.chaos.crashes() {
                // Committed, and the answer lost with the process: the record is released,
                // and the next callback finds the order paid.
                return Ok(Err(PayError::Transient(
                    "simulated crash after commit".into(),
                )));
            }
            Ok(Ok(paid))
        }
        Transition::AlreadyThere | Transition::Conflict(Scalar::Int(order::SHIPPED)) => {
            let sql = format!("SELECT payment FROM {} WHERE order_id = ?", t.payments);
            let by = tx.rows(&sql, &[order_id.into()]).await?;
            if by
                .iter()
                .any(|r| r.first() == Some(&Scalar::Text(cb.payment.clone())))
            {
                Ok(Ok(paid))
            } else {
                Ok(Err(PayError::refused(
                    "already_paid",
                    format!("Order {order_id} was paid by another payment."),
                )))
            }
        }
        Transition::Conflict(_) => Ok(Err(PayError::refused(
            "order_cancelled",
            format!("Order {order_id} was cancelled; the payment must be refunded."),
        ))),
        Transition::NotFound => Ok(Err(PayError::refused(
            "unknown_order",
            format!("There is no order {order_id}."),
        ))),
    }
}

async fn credit_merchant(
    shop: &Shop,
    tx: &mut Tx,
    cb: &Callback,
    order_id: i64,
) -> Result<bool, DbError> {
    if !matches!(
        tx.add(&shop.credit, MERCHANT.into(), cb.amount).await?,
        Bounded::Applied(_)
    ) {
        return Ok(false);
    }
    let sql = format!(
        "INSERT INTO {} (payment, order_id, amount) VALUES (?, ?, ?)",
        shop.t.payments
    );
    tx.exec(
        &sql,
        &[
            cb.payment.as_str().into(),
            order_id.into(),
            cb.amount.into(),
        ],
    )
    .await?;
    Ok(true)
}

/// By hand: mark the order paid and credit the merchant, for every callback that arrives.
async fn pay_unguarded(
    shop: &Shop,
    cb: &Callback,
    order_id: i64,
) -> Result<Result<Response, Response>, DbError> {
    let mut tx = shop.db.begin().await?;
    let sql = format!(
        "UPDATE {} SET status = ?, version = version + 1 WHERE id = ?",
        shop.t.orders
    );
    if tx
        .exec(&sql, &[order::PAID.into(), order_id.into()])
        .await?
        == 0
    {
        return Ok(Err(unknown_order(order_id)));
    }
    let sql = format!("SELECT version FROM {} WHERE id = ?", shop.t.orders);
    let version = tx.int(&sql, &[order_id.into()]).await?.unwrap_or_default();
    record_version(&mut tx, &shop.t, order_id, version, order::PAID).await?;
    if !credit_merchant(shop, &mut tx, cb, order_id).await? {
        return Ok(Err(internal("the merchant cannot be credited")));
    }
    tx.commit().await?;
    shop.order_paid(order_id).await;
    let paid = Paid {
        payment: cb.payment.clone(),
        order: order_id.to_string(),
        status: "paid".into(),
    };
    Ok(Ok(committed(shop, Json(paid).into_response())))
}
