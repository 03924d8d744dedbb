//! The shop's side of the events: publishing an "order paid" event after a payment's commit,
//! now and then twice as a publisher that retried would, and the ledger of what was
//! published, which the audit holds the stock events against.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_mq::amqp::{AmqpPublisher, BasicProperties};
use rand::RngExt;
use rand::rngs::StdRng;

use super::OrderPaid;

/// What was published and what the consumers did, for the audit and the report.
#[derive(Debug, Default)]
pub struct Ledger {
    published: Mutex<BTreeSet<i64>>,
    unconfirmed: Mutex<BTreeSet<i64>>,
    /// Publishes under way.
    pub(super) in_flight: AtomicU64,
    /// Events published (confirmed by the broker), one per order.
    pub events: AtomicU64,
    /// Events published a second time under the same id.
    pub twice: AtomicU64,
    /// Publishes the broker did not confirm (tried again).
    pub publish_failures: AtomicU64,
    /// Consumers killed mid-way.
    pub kills: AtomicU64,
}

impl Ledger {
    /// The orders whose event the broker confirmed at least once.
    pub fn published(&self) -> BTreeSet<i64> {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The orders whose event was sent but never confirmed: it may or may not have been taken.
    pub fn unconfirmed(&self) -> BTreeSet<i64> {
        let published = self.published();
        self.unconfirmed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .difference(&published)
            .copied()
            .collect()
    }
}

/// Publishes the shop's "order paid" events.
pub struct Publisher {
    /// The broker.
    pub(super) amqp: AmqpPublisher,
    /// The queue the inventory consumes.
    pub(super) queue: String,
    /// The SKUs there are, for the events' choice of one.
    pub(super) skus: i64,
    /// How often an event is published a second time.
    pub(super) twice: f64,
    /// Which events go twice.
    pub(super) rng: Mutex<StdRng>,
    /// What was published.
    pub(super) ledger: Arc<Ledger>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Publishes the event for `order`, and now and then again under the same id, as a
    /// publisher that did not hear the first confirm would. Called after the payment's
    /// commit; an event the broker does not confirm is tried again a few times.
    pub async fn order_paid(&self, order: i64) {
        self.ledger.in_flight.fetch_add(1, Ordering::SeqCst);
        let twice = self
            .rng
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .random_bool(self.twice);
        let id = OrderPaid::message_id(order);
        let body = serde_json::to_vec(&OrderPaid::of(order, self.skus)).unwrap_or_default();
        let mut confirmed = 0;
        for _copy in 0..if twice { 2 } else { 1 } {
            for attempt in 0..4u32 {
                let sent = self
                    .amqp
                    .publish_once("", &self.queue, &id, &body, BasicProperties::default())
                    .await;
                if sent.is_ok() {
                    confirmed += 1;
                    break;
                }
                self.ledger.publish_failures.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
            }
        }
        let set = if confirmed > 0 {
            self.ledger.events.fetch_add(1, Ordering::Relaxed);
            &self.ledger.published
        } else {
            &self.ledger.unconfirmed
        };
        set.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(order);
        if confirmed > 1 {
            self.ledger.twice.fetch_add(1, Ordering::Relaxed);
        }
        self.ledger.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}
