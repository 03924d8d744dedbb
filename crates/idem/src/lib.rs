//! idem makes writes safe to retry.
//!
//! A caller that timed out does not know whether its transfer happened. With idem the work
//! runs under an idempotency key: the first attempt claims the key, runs, and stores its
//! result; every retry with the same key gets that result back instead of running again; an
//! attempt that fails in a retryable way gives the key back.
//!
//! This crate is the entry point: [`Idempotency`] runs a closure at most once per key (for jobs
//! and message consumers), [`purge::purge_loop`] deletes expired records in the background, and it re-exports the record model ([`idem_core`]) and the stores
//! ([`idem_store`]: memory, SQLite as the embedded default, and with features `postgres`,
//! `mysql` and `redis` the server stores).
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idem::{Idempotency, InFlight, Key, RunError, SqliteStore};
//!
//! # let dir = tempfile_dir();
//! let store = SqliteStore::open(dir.join("idem.db"))?;
//! let idem = Idempotency::new(store);
//! let key = Key::parse("shop", "stock.deduct", "order-1001")?;
//!
//! #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! enum StockError { Insufficient, DatabaseDown }
//!
//! let result = idem
//!     .once(&key)
//!     .input(&("sku-7", 2))?
//!     .ttl(Duration::from_secs(3600))
//!     .in_flight(InFlight::Wait(Duration::from_secs(2)))
//!     // "insufficient stock" is an answer: store it and replay it to every retry;
//!     // a database outage is not: release the key so that a retry runs again.
//!     .permanent_if(|e: &StockError| matches!(e, StockError::Insufficient))
//!     .run(|lease| async move {
//!         // lease.fence can guard writes elsewhere
//!         Err::<u32, _>(StockError::Insufficient)
//!     })
//!     .await;
//! assert!(matches!(result, Err(RunError::Failed { error: StockError::Insufficient, replayed: false })));
//! # Ok(()) }
//! # fn tempfile_dir() -> std::path::PathBuf {
//! #     let d = std::env::temp_dir().join(format!("idem-doc-{}", std::process::id()));
//! #     std::fs::create_dir_all(&d).unwrap(); d
//! # }
//! # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
//! ```

pub mod claim;
pub mod locks;
pub mod purge;
mod run;
pub mod steps;

pub use claim::InFlight;
// Store calls finished for a caller who left, shared with the claim helpers.
use idem_claim::cancel;
pub use idem_core::token as tokens;
pub use idem_core::{IssuedToken, TokenError, Tokens};
pub use locks::{LockGuard, Locks};

pub use run::{
    AllRetryable, Done, ErrorPolicy, Idempotency, Once, PermanentIf, RunError, stored_value,
};
pub use steps::{StepContext, StepFailure, StepProblem, Steps};

pub use idem_core::{
    self, BeginOutcome, BeginRequest, Bytes, Clock, DynLockStore, DynStore, Fingerprint, Key,
    KeyError, Lease, LeaseError, LockError, LockName, LockOwner, LockStore, ManualClock, Record,
    SharedLockStore, SharedStore, Status, Step, StepName, StepOutcome, Store, StoreError,
    SystemClock, Timestamp,
};
#[cfg(feature = "sqlite")]
pub use idem_store::SqliteStore;
pub use idem_store::{self, MemoryStore, ReplayCache, ReplayCacheLimits, StoreUrl, open};
#[cfg(feature = "etcd")]
pub use idem_store::{EtcdLocks, EtcdOptions};
#[cfg(feature = "mysql")]
pub use idem_store::{MySqlOptions, MySqlStore};
#[cfg(feature = "postgres")]
pub use idem_store::{PostgresOptions, PostgresStore};
#[cfg(feature = "redis")]
pub use idem_store::{RedisOptions, RedisStore};
#[cfg(feature = "zookeeper")]
pub use idem_store::{ZooKeeperLocks, ZooKeeperOptions};
