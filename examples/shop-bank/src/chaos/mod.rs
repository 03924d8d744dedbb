//! The chaos: the clients', and the service's own.
//!
//! The clients run many at once, each operation sent over HTTP with an `Idempotency-Key` and
//! retried until it has an answer, while the network and the users misbehave: attempts time
//! out (the client hangs up), answers are lost on the way back, the same request is sent
//! twice at once, and users double-click (the same operation again under a new key). The
//! service ([`ServerChaos`]) now and then stops after committing, before answering.
//!
//! Every answer a client accepts is written to the [`Journal`], which the audit holds against
//! the books.
//!
//! `wire.rs` sends one operation under one key until it is answered, rolling the trouble for
//! each attempt; `operations.rs` holds the operations, one for each scenario; `journal.rs`
//! what the clients heard; `server.rs` the service's own chaos.

mod journal;
mod operations;
mod server;
mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::SeedableRng;
use rand::rngs::StdRng;

pub use journal::{Ack, Counters, Journal};
pub use server::{BankTimeout, ServerChaos};
pub use wire::Answer;

use crate::schema::Opening;
use journal::bump;
use operations::{Op, Orders};
use wire::Wire;

/// How often each kind of trouble happens, per attempt (probabilities from 0 to 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Rates {
    /// The client gives up on an attempt after 1 to 25 ms and tries again.
    pub timeout: f64,
    /// An answer is lost on its way back; the client tries again.
    pub drop: f64,
    /// The same request (same key) is sent twice at once.
    pub duplicate: f64,
    /// The user clicks twice: the operation is sent again at once under a fresh key.
    pub double_click: f64,
    /// The service stops after committing, before answering.
    pub crash: f64,
    /// The service takes up to this long inside an operation.
    pub pause_ms: u64,
}

impl Default for Rates {
    fn default() -> Self {
        Self {
            timeout: 0.15,
            drop: 0.1,
            duplicate: 0.1,
            double_click: 0.15,
            crash: 0.05,
            pause_ms: 8,
        }
    }
}

impl Rates {
    /// No trouble at all.
    pub fn calm() -> Self {
        Self {
            timeout: 0.0,
            drop: 0.0,
            duplicate: 0.0,
            double_click: 0.0,
            crash: 0.0,
            pause_ms: 0,
        }
    }
}

/// What the clients are to do.
#[derive(Debug, Clone)]
pub struct Workload {
    /// How many clients run at once.
    pub clients: usize,
    /// How many operations they run between them.
    pub operations: u64,
    /// The seed of every random choice the clients make.
    pub seed: u64,
    /// The trouble.
    pub rates: Rates,
    /// The books the shop opened with.
    pub opening: Opening,
}

/// Runs the workload against the service at `base` (`http://host:port`), writing to
/// `journal`.
pub async fn run(base: String, workload: &Workload, journal: Arc<Journal>) {
    let wire = Wire::new(base, workload.rates.clone(), journal);
    let orders = Arc::new(Orders::default());
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..workload.clients {
        let (wire, orders, next) = (wire.clone(), orders.clone(), next.clone());
        let workload = workload.clone();
        tasks.spawn(async move {
            let mut rng = StdRng::seed_from_u64(
                workload.seed ^ (client as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= workload.operations {
                    break;
                }
                let op = Op {
                    wire: &wire,
                    orders: &orders,
                    opening: &workload.opening,
                    n,
                };
                op.run(&mut rng).await;
                bump(&wire.journal.counters.operations);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}
