//! The inventory consumer's work for one "order paid" event: one item of its SKU (never below
//! zero), and a row in the stock events table saying what was done. Written once, over the
//! shop's database layer: idem-mq's inbox runs it in the transaction that also completes the
//! event's record, on PostgreSQL or MySQL/MariaDB alike; the consumer by hand (the events
//! guard off) runs it in a transaction of its own. Its statement is put in each database's
//! placeholders once, not per event.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_guard::{Bounded, Counter, Scalar};
use idem_mq::inbox::InboxHandler;
use idem_mq::{Failure, Message};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sqlx::Transaction;

use super::OrderPaid;
use crate::db::{Conn, Db, DbError, Statement};
use crate::schema::Tables;

/// The inventory's work for one event: one item of its SKU (never below zero), and a row in
/// the stock events table saying what was done.
#[derive(Debug, Clone)]
pub struct Inventory {
    stock: Counter,
    /// The stock events row for an event.
    record: Statement,
    pause_ms: u64,
    rng: Arc<Mutex<StdRng>>,
}

/// What the inventory did for an event, as stored in its record.
fn outcome(b: Bounded) -> Result<&'static str, Failure<String>> {
    match b {
        Bounded::Applied(_) => Ok("deducted"),
        Bounded::Insufficient(_) => Ok("insufficient_stock"),
        Bounded::NotFound => Err(Failure::Permanent("the event names an unknown SKU".into())),
        Bounded::Exceeded(_) => Err(Failure::Permanent("the stock cannot grow".into())),
    }
}

fn event(m: &Message) -> Result<OrderPaid, Failure<String>> {
    serde_json::from_slice(&m.payload)
        .map_err(|e| Failure::Permanent(format!("not an order paid event: {e}")))
}

fn retry(e: impl std::fmt::Display) -> Failure<String> {
    Failure::Retry(e.to_string())
}

impl Inventory {
    /// The inventory over the shop's tables, taking up to `pause_ms` in each event.
    pub fn new(t: &Tables, pause_ms: u64, seed: u64) -> Result<Self, String> {
        Ok(Self {
            stock: Counter::new(&t.stock, "sku", "avail")
                .map_err(|e| e.to_string())?
                .floor(0),
            record: Statement::new(&format!(
                "INSERT INTO {} (order_id, sku, qty, outcome) VALUES (?, ?, ?, ?)",
                t.stock_events
            )),
            pause_ms,
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
        })
    }

    /// Takes its time, inside the transaction: a kill then often lands mid-way.
    async fn pause(&self) {
        let ms = self
            .rng
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .random_range(0..=self.pause_ms);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// Takes the event's items, never below zero, in `conn`'s transaction: what the counter
    /// answered.
    async fn take(&self, conn: &mut Conn<'_>, ev: &OrderPaid) -> Result<Bounded, DbError> {
        self.pause().await;
        conn.add(&self.stock, Scalar::Text(ev.sku.clone()), -ev.qty)
            .await
    }

    /// Writes the stock events row saying that `ev` was answered `outcome`.
    async fn record(
        &self,
        conn: &mut Conn<'_>,
        ev: &OrderPaid,
        outcome: &str,
    ) -> Result<(), DbError> {
        let qty = if outcome == "deducted" { ev.qty } else { 0 };
        let row = [
            ev.order.into(),
            Scalar::Text(ev.sku.clone()),
            qty.into(),
            outcome.into(),
        ];
        conn.run(&self.record, &row).await.map(drop)
    }

    /// By hand, without idem: its own transaction, committed, then the caller acks. A
    /// duplicate, or a redelivery after a kill between the commit and the ack, deducts again.
    pub(super) async fn by_hand(&self, db: &Db, payload: &[u8]) -> Result<(), DbError> {
        let Ok(ev) = serde_json::from_slice::<OrderPaid>(payload) else {
            return Ok(());
        };
        let mut tx = db.begin().await?;
        let mut conn = tx.conn();
        // By hand, whatever the counter refused is taken for insufficient stock.
        let outcome = match self.take(&mut conn, &ev).await? {
            Bounded::Applied(_) => "deducted",
            _ => "insufficient_stock",
        };
        self.record(&mut conn, &ev, outcome).await?;
        tx.commit().await
    }
}

/// In idem-mq's inbox transaction, on whichever database the shop's connection is.
impl<D: sqlx::Database> InboxHandler<D> for Inventory
where
    for<'c> &'c mut D::Connection: Into<Conn<'c>>,
{
    type Output = String;
    type Error = String;

    async fn handle<'t>(
        &'t self,
        tx: &'t mut Transaction<'static, D>,
        message: Message,
    ) -> Result<String, Failure<String>> {
        let ev = event(&message)?;
        let mut conn: Conn<'_> = (&mut **tx).into();
        let outcome = outcome(self.take(&mut conn, &ev).await.map_err(retry)?)?;
        self.record(&mut conn, &ev, outcome).await.map_err(retry)?;
        Ok(outcome.to_owned())
    }
}
