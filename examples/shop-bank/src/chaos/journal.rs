//! What the clients heard: every answer they accepted, the counters of the wire, and the keys
//! whose answers differed, for the audit to hold against the books.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;

use super::wire::Answer;

/// An answer a client accepted as the outcome of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    /// A transfer by `ticket` answered `outcome` (`done` or `insufficient_funds`).
    Transfer {
        /// The ticket.
        ticket: i64,
        /// What the answer said.
        outcome: String,
    },
    /// A deduction for `order_no` answered `outcome` (`deducted` or `insufficient_stock`).
    Deduction {
        /// The order number.
        order_no: String,
        /// What the answer said.
        outcome: String,
    },
    /// Coupon `coupon` was said to be held by `order_no`.
    CouponHeld {
        /// The coupon.
        coupon: i64,
        /// The order told it holds it.
        order_no: String,
    },
    /// Coupon `coupon` was said to have expired.
    CouponExpired {
        /// The coupon.
        coupon: i64,
    },
    /// `user` was told its account is `account`.
    Account {
        /// The user.
        user: i64,
        /// The account.
        account: i64,
    },
    /// Order `order` was created from form `form`.
    Order {
        /// The order.
        order: i64,
        /// The form it came from.
        form: String,
    },
    /// Order `order` was said to be paid by `payment`.
    Paid {
        /// The order.
        order: i64,
        /// The payment.
        payment: String,
    },
    /// Order `order` was said to be at `version` with `status`.
    Version {
        /// The order.
        order: i64,
        /// Its version.
        version: i64,
        /// Its status's name.
        status: String,
    },
    /// Wire `wire` to the other bank was answered `outcome` (`sent` or
    /// `insufficient_funds`).
    Wire {
        /// The wire (its request's key).
        wire: String,
        /// What the answer said.
        outcome: String,
        /// The amount it said.
        amount: i64,
    },
}

/// What happened on the wire.
#[derive(Debug, Default)]
pub struct Counters {
    /// Operations finished.
    pub operations: AtomicU64,
    /// Requests sent.
    pub requests: AtomicU64,
    /// Attempts after the first for one key.
    pub retries: AtomicU64,
    /// Attempts the client gave up on.
    pub timeouts: AtomicU64,
    /// Answers thrown away as lost.
    pub dropped: AtomicU64,
    /// Requests sent twice at once under one key.
    pub duplicates: AtomicU64,
    /// Operations sent again under a fresh key.
    pub double_clicks: AtomicU64,
    /// Answers saying the service stopped after committing.
    pub crashes: AtomicU64,
    /// Answers saying the key was in use by another attempt.
    pub in_progress: AtomicU64,
    /// Replays: answers for a key that had been answered before.
    pub replays: AtomicU64,
    /// Operations given up after too many attempts.
    pub gave_up: AtomicU64,
}

/// Counts one more.
pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Every answer accepted, and every key whose answers differed.
#[derive(Debug, Default)]
pub struct Journal {
    acks: Mutex<Vec<Ack>>,
    finals: Mutex<HashMap<String, (u16, Bytes)>>,
    differing: Mutex<Vec<String>>,
    /// The wire's counters.
    pub counters: Counters,
}

impl Journal {
    pub(super) fn ack(&self, ack: Ack) {
        self.acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(ack);
    }

    /// The answers accepted.
    pub fn acks(&self) -> Vec<Ack> {
        self.acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Keys that got two different final answers.
    pub fn differing(&self) -> Vec<String> {
        self.differing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Holds a final answer against the earlier ones for its key.
    pub(super) fn final_answer(&self, key: &str, answer: &Answer) {
        let mut finals = self.finals.lock().unwrap_or_else(PoisonError::into_inner);
        match finals.get(key) {
            None => {
                finals.insert(key.to_owned(), (answer.status, answer.body.clone()));
            }
            Some((status, body)) => {
                bump(&self.counters.replays);
                if (*status, body) != (answer.status, &answer.body) {
                    self.differing
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(format!(
                            "key {key}: answered {status} {} and then {} {}",
                            String::from_utf8_lossy(body),
                            answer.status,
                            String::from_utf8_lossy(&answer.body)
                        ));
                }
            }
        }
    }
}
