//! Scenario 6: the payment provider's callbacks (seed 003): the front and the back channel
//! report one payment, each possibly more than once and with no key; they are deduplicated by
//! payment id (`Idempotency::once`), and the order moves through its state machine from created
//! to paid.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem::{InFlight, RunError};
use idem_core::{ClientKey, Key, Namespace, Scope};
use idem_guard::{Bounded, Scalar, Transition};
use serde::{Deserialize, Serialize};

use crate::db::{DbError, Tx};
use crate::schema::{Guard, MERCHANT, order};
use crate::shop::Shop;
use crate::shop::support::{
    Reply, amount, committed, internal, name_like, parse, problem, record_version, retry_transient,
    retrying, unknown_order,
};

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

impl Paid {
    /// The answer to `cb`: order `order_id` is paid.
    fn of(cb: &Callback, order_id: i64) -> Self {
        Self {
            payment: cb.payment.clone(),
            order: order_id.to_string(),
            status: "paid".into(),
        }
    }
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

/// `POST /payments/callback`: the provider reports payment `payment` of order `order`.
pub(crate) async fn payment_callback(State(shop): State<Arc<Shop>>, body: Bytes) -> Reply {
    let cb: Callback = parse(&body)?;
    name_like(&cb.payment, "payment id")?;
    amount(cb.amount, "amount")?;
    if cb.channel != "front" && cb.channel != "back" {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_channel",
            "Invalid channel",
            "A callback comes on the \"front\" or the \"back\" channel.".into(),
        ));
    }
    let Ok(order_id) = cb.order.parse::<i64>() else {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_order",
            "Invalid order",
            "The order id is a decimal number.".into(),
        ));
    };
    if !shop.guards.on(Guard::Payment) {
        let work = async move { retrying(&shop, || pay_unguarded(&shop, &cb, order_id)).await };
        return Ok(tokio::spawn(work)
            .await
            .unwrap_or_else(|_| internal("the payment's work failed")));
    }
    let key = payment_key(&cb.payment)?;
    // In a task of its own: a provider that hangs up must not cancel the work half way, nor
    // the taking of the payment's key (which would leave it held until its lease ran out).
    let Ok(run) = tokio::spawn(pay_once(shop, cb, order_id, key)).await else {
        return Err(internal("the payment's work failed"));
    };
    Ok(answer(run))
}

/// The answer to a callback: the payment's result, the same for every duplicate.
fn answer(run: Result<idem::Done<Paid>, RunError<PayError>>) -> Response {
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
    let paid = Paid::of(cb, order_id);
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
async fn pay_unguarded(shop: &Shop, cb: &Callback, order_id: i64) -> Result<Reply, DbError> {
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
    let paid = Paid::of(cb, order_id);
    Ok(Ok(committed(shop, Json(paid).into_response())))
}
