//! The run-once API: at most once per key, stored results replayed, failures classified,
//! in-flight attempts rejected or awaited, store failures failing closed.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{
    Done, Idempotency, InFlight, Key, ManualClock, MemoryStore, RunError, Status, Store, Timestamp,
};
use idem_testkit::{Fault, FaultyStore, Op, PATIENCE, Stall, within};
use serde::{Deserialize, Serialize};

fn key(k: &str) -> Key {
    Key::parse("tests", "run", k).unwrap()
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum PayError {
    Declined,
    Timeout,
}

/// Starts a run whose work waits for `go`, and returns once it holds the key.
async fn start_blocked<S: Store + Clone>(
    idem: &Idempotency<S, ManualClock>,
    k: &str,
    lease: Duration,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<idem::Done<String>, RunError<PayError>>>,
) {
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let idem = idem.clone();
    let k = key(k);
    let handle = tokio::spawn(async move {
        idem.once(&k)
            .lease(lease)
            .run(|_| async move {
                started_tx.send(()).unwrap();
                let _ = wait.await;
                Ok::<_, PayError>("first".to_owned())
            })
            .await
    });
    started.await.unwrap();
    (go, handle)
}

mod dropped;
mod failures;
mod in_flight;
mod outcomes;
