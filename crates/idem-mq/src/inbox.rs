//! Inbox mode: the handler's business writes and the record of having handled the message
//! commit in one transaction, on the database that holds both (PostgreSQL with feature
//! `postgres`, MySQL/MariaDB with `mysql`).
//!
//! The key is claimed on its own first, so that a redelivery to another consumer sees it
//! held; then a transaction is opened, the handler writes in it, the record is completed in
//! it (`complete_in`), and it commits; only then is the message acked. A crash before the
//! commit rolls back both the writes and the completion (the lease runs out and a redelivery
//! runs the handler again, on a clean slate); a crash after it leaves both, and the
//! redelivery is acked without running. Either way the database holds exactly one effect per
//! message key.
//!
//! A consumer *process* that dies takes its transactions with it: the database rolls them back
//! when their connections close. A consumer *future* dropped mid-handler (a drain time that
//! ran out, a task aborted) leaves the rollback to sqlx, which sends it when the connection
//! goes back to its pool; a query dropped while it waits (on a row lock, say) holds that
//! connection, and the transaction's locks, until the query ends. Give the pool a
//! `lock_timeout` and a `statement_timeout` shorter than the lease, so that a dropped handler
//! can never hold a row another attempt needs for longer than that.
//!
//! ```no_run
//! # async fn demo(store: idem::PostgresStore, source: idem_mq::memory::MemorySource)
//! # -> Result<(), idem_mq::MqError> {
//! use idem_mq::inbox::{Inbox, inbox_fn};
//! use idem_mq::{Consumer, Failure};
//!
//! let deduct = inbox_fn(|tx: &mut sqlx::Transaction<'static, sqlx::Postgres>, msg| {
//!     Box::pin(async move {
//!         sqlx::query("UPDATE stock SET qty = qty - 1 WHERE sku = 7")
//!             .execute(&mut **tx)
//!             .await
//!             .map_err(|e| Failure::Retry(e.to_string()))?;
//!         Ok::<_, Failure<String>>(msg.attempt)
//!     })
//! });
//! let consumer = Consumer::new(store.clone());
//! consumer.run(source, Inbox::new(store, deduct), std::future::pending()).await
//! # }
//! ```

use std::fmt::{self, Display};
use std::future::Future;

use futures_util::future::BoxFuture;
use idem_core::{Bytes, Key, Lease, LeaseError, Store, StoreError, Timestamp};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use crate::consumer::{Failure, Handler, Message};

/// A store that keeps its records in the business database and can complete one inside a
/// transaction of the caller's.
pub trait InboxStore: Store + Clone {
    /// The database.
    type Db: sqlx::Database;

    /// Opens a transaction on the store's pool.
    fn begin_tx(
        &self,
    ) -> impl Future<Output = Result<Transaction<'static, Self::Db>, StoreError>> + Send;

    /// Completes the record for `key` inside `tx`.
    fn complete_in(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), LeaseError>> + Send;
}

/// `InboxStore` for a SQL store of idem's, over its pool and its own `complete_in`.
macro_rules! sql_inbox_store {
    ($feature:literal, $store:ty, $db:ty) => {
        #[cfg(feature = $feature)]
        impl InboxStore for $store {
            type Db = $db;

            async fn begin_tx(&self) -> Result<Transaction<'static, $db>, StoreError> {
                self.pool()
                    .begin()
                    .await
                    .map_err(|e| StoreError::unavailable("cannot open a transaction", e))
            }

            async fn complete_in(
                &self,
                tx: &mut Transaction<'static, $db>,
                key: &Key,
                lease: &Lease,
                response: Bytes,
                now: Timestamp,
            ) -> Result<(), LeaseError> {
                <$store>::complete_in(self, tx, key, lease, response, now).await
            }
        }
    };
}

sql_inbox_store!("postgres", idem::PostgresStore, sqlx::Postgres);
sql_inbox_store!("mysql", idem::MySqlStore, sqlx::MySql);

/// A handler that writes in the inbox's transaction.
pub trait InboxHandler<Db: sqlx::Database>: Send + Sync + 'static {
    /// The result stored for the message.
    type Output: Serialize + DeserializeOwned + Send + 'static;
    /// The error; a permanent one is stored.
    type Error: Serialize + DeserializeOwned + Display + Send + 'static;

    /// Handles one message, writing in `tx`. Do not commit it: the inbox completes the
    /// record in it and commits.
    fn handle<'t>(
        &'t self,
        tx: &'t mut Transaction<'static, Db>,
        message: Message,
    ) -> impl Future<Output = Result<Self::Output, Failure<Self::Error>>> + Send + 't;
}

/// A closure as an [`InboxHandler`]; see [`inbox_fn`].
#[derive(Debug, Clone)]
pub struct InboxFn<F>(F);

/// Makes an [`InboxHandler`] of a closure that returns a boxed future borrowing the
/// transaction: `inbox_fn(|tx, msg| Box::pin(async move { ... }))`.
pub fn inbox_fn<Db, F, T, E>(f: F) -> InboxFn<F>
where
    Db: sqlx::Database,
    F: for<'t> Fn(
            &'t mut Transaction<'static, Db>,
            Message,
        ) -> BoxFuture<'t, Result<T, Failure<E>>>
        + Send
        + Sync
        + 'static,
{
    InboxFn(f)
}

impl<Db, F, T, E> InboxHandler<Db> for InboxFn<F>
where
    Db: sqlx::Database,
    F: for<'t> Fn(
            &'t mut Transaction<'static, Db>,
            Message,
        ) -> BoxFuture<'t, Result<T, Failure<E>>>
        + Send
        + Sync
        + 'static,
    T: Serialize + DeserializeOwned + Send + 'static,
    E: Serialize + DeserializeOwned + Display + Send + 'static,
{
    type Output = T;
    type Error = E;

    fn handle<'t>(
        &'t self,
        tx: &'t mut Transaction<'static, Db>,
        message: Message,
    ) -> impl Future<Output = Result<T, Failure<E>>> + Send + 't {
        (self.0)(tx, message)
    }
}

/// Why an inbox run failed: the handler's own error, or the database's around it (opening or
/// committing the transaction, completing the record), which is always retryable.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum InboxError<E> {
    /// The handler failed.
    Handler(E),
    /// The transaction could not be opened or committed, or the record not completed in it
    /// (another attempt took the key over): nothing was committed.
    Database(String),
}

impl<E: Display> Display for InboxError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InboxError::Handler(e) => e.fmt(f),
            InboxError::Database(e) => write!(f, "the inbox transaction failed: {e}"),
        }
    }
}

/// An inbox handler with its store: give it to [`crate::Consumer::run`] as the handler.
#[derive(Debug, Clone)]
pub struct Inbox<S, H> {
    store: S,
    handler: H,
}

impl<S: InboxStore, H: InboxHandler<S::Db>> Inbox<S, H> {
    /// `handler` writing in transactions of `store`, which must be the consumer's store.
    pub fn new(store: S, handler: H) -> Self {
        Self { store, handler }
    }
}

impl<S, H> Handler for Inbox<S, H>
where
    S: InboxStore,
    H: InboxHandler<S::Db>,
{
    type Output = H::Output;
    type Error = InboxError<H::Error>;

    async fn handle(&self, message: Message) -> Result<H::Output, Failure<Self::Error>> {
        let db = |e: &dyn Display| Failure::Retry(InboxError::Database(e.to_string()));
        let (Some(key), Some(lease)) = (message.key.clone(), message.lease) else {
            // A message run without a key has no record to complete; it is refused rather
            // than run outside the inbox's guarantee.
            return Err(Failure::Permanent(InboxError::Database(
                "a message without a key cannot run in inbox mode".into(),
            )));
        };
        let mut tx = self.store.begin_tx().await.map_err(|e| db(&e))?;
        let value = match self.handler.handle(&mut tx, message).await {
            Ok(value) => value,
            Err(Failure::Permanent(e)) => return Err(Failure::Permanent(InboxError::Handler(e))),
            Err(Failure::Retry(e)) => return Err(Failure::Retry(InboxError::Handler(e))),
            Err(Failure::RetryAfter(e, after)) => {
                return Err(Failure::RetryAfter(InboxError::Handler(e), after));
            }
            Err(Failure::DeadLetter(e)) => return Err(Failure::DeadLetter(InboxError::Handler(e))),
        };
        // The bytes `run` stores afterwards, so that its own `complete` changes nothing.
        let response = idem::stored_value(&value).map_err(|e| db(&e))?;
        self.store
            .complete_in(&mut tx, &key, &lease, response, Timestamp::now())
            .await
            .map_err(|e| db(&e))?;
        tx.commit().await.map_err(|e| db(&e))?;
        Ok(value)
    }
}
