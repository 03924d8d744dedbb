//! The other bank: the downstream service the shop's wires go out to (scenario 8). Like a real
//! bank's API it takes an idempotency key with every call and answers a repeated key with the
//! first call's receipt; like a real network, its answers sometimes time out, before the bank
//! took the wire or after.
//!
//! It keeps its books in a table of its own (`bank_wires`), in the shop's database only so that
//! the demo needs nothing more; the shop never reads it, the audit does.

use std::time::Duration;

use idem_guard::{Scalar, UniqueInsert};
use serde::{Deserialize, Serialize};

use crate::chaos::{BankTimeout, ServerChaos};
use crate::db::{Db, DbError, text};

/// Why a call to the bank gave no receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BankError {
    /// No answer came in time: the wire may or may not have been taken.
    Timeout,
    /// The bank could not take the wire now (its database failed); nothing was taken.
    Unavailable(String),
}

/// The other bank.
#[derive(Debug)]
pub struct Bank {
    take: UniqueInsert,
}

impl Bank {
    /// The bank keeping its books in `table` (`bank_key`, `reference`, `to_account`, `amount`,
    /// `receipt`).
    pub fn new(table: &str) -> Result<Self, String> {
        let take = UniqueInsert::new(
            table,
            &["bank_key"],
            &["bank_key", "reference", "to_account", "amount", "receipt"],
        )
        .map_err(|e| e.to_string())?;
        Ok(Self { take })
    }

    /// Takes a wire of `amount` to `to`, the shop's wire `reference`, under the idempotency
    /// `key`: the receipt, the same for every call with the key.
    pub async fn take(
        &self,
        db: &Db,
        chaos: &ServerChaos,
        key: &str,
        reference: &str,
        to: &str,
        amount: i64,
    ) -> Result<String, BankError> {
        let timeout = chaos.bank_timeout();
        if timeout == Some(BankTimeout::Before) {
            tokio::time::sleep(Duration::from_millis(2)).await;
            return Err(BankError::Timeout);
        }
        let receipt = format!("rcpt-{}", key.get(..20).unwrap_or(key));
        let row = [
            key.into(),
            reference.into(),
            to.into(),
            amount.into(),
            receipt.as_str().into(),
        ];
        let receipt = self
            .record(db, &row)
            .await
            .map_err(|e| BankError::Unavailable(e.to_string()))?;
        if timeout == Some(BankTimeout::After) {
            return Err(BankError::Timeout);
        }
        Ok(receipt)
    }

    /// One transaction: the wire taken, or the receipt of the one taken under the same key.
    async fn record(&self, db: &Db, row: &[Scalar; 5]) -> Result<String, DbError> {
        let mut tx = db.begin().await?;
        let receipt = text(&tx.insert(&self.take, row).await?.into_row().0, 4);
        tx.commit().await?;
        Ok(receipt)
    }
}
