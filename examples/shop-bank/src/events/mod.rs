//! The "order paid" events (seed 004's message consumed twice): when a payment is credited
//! the shop publishes an event to RabbitMQ, now and then twice (a publisher that retried),
//! and an inventory consumer takes one item of the order's SKU for it through `idem-mq`'s
//! inbox mode on the shop's database: the deduction, its row in the stock events table and
//! the record of having handled the event commit in one transaction, and only then is the
//! event acked. The chaos kills the consumer at random moments and starts a new one: its
//! connections to the broker and the database are cut (each goes through a relay of its own)
//! and its task is dropped wherever it was, so the broker delivers its unacked events again
//! and the database rolls back its open transaction, as after a crashed process.
//!
//! Inbox mode needs the records in the shop's database, so the leg runs on PostgreSQL and
//! MySQL/MariaDB only; on the SQLite default, or with no broker answering, it is skipped and
//! the rest of the demo runs as before.
//!
//! `publisher.rs` is the shop's side and the ledger of what was published; `inventory.rs`
//! the consumer's work for one event; `consumer.rs` the consumer's lives and deaths, and
//! `relay.rs` the relay through which a kill cuts a life's connections.

mod consumer;
mod inventory;
mod publisher;
mod relay;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_mq::amqp::{AmqpPublisher, AmqpSource};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use inventory::Inventory;
pub use publisher::{Ledger, Publisher};

use crate::chaos::{Rates, Workload};
use crate::db::{Db, Engine};
use crate::schema::{Guard, Guards, Opening, Tables};
use consumer::{Ends, Shared, Tally, Way, kill_and_restart};

/// The broker the demo looks for by default.
pub const DEFAULT_AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How long the demo waits for a broker to answer before it runs without the events leg.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// How often an event is published a second time under the same message id (unless the run
/// is calm).
const TWICE: f64 = 0.3;

/// How long, at most, the consumer gets after the clients stop to handle every event.
const SETTLE_LIMIT: Duration = Duration::from_secs(90);

/// How long the consumer must have received nothing new before the books are audited.
const QUIET: Duration = Duration::from_millis(1_500);

/// The event's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPaid {
    /// The order.
    pub order: i64,
    /// The SKU to take from.
    pub sku: String,
    /// How many items.
    pub qty: i64,
}

impl OrderPaid {
    /// The event for `order`: one item of a SKU the order's id picks among `skus`.
    pub fn of(order: i64, skus: i64) -> Self {
        Self {
            order,
            sku: Opening::sku(order.rem_euclid(skus.max(1)) + 1),
            qty: 1,
        }
    }

    /// The message id it is published under: the idempotency key of its effect.
    pub fn message_id(order: i64) -> String {
        format!("order-{order}")
    }
}

/// Why the events leg did not run, or the running leg.
pub enum Leg {
    /// Skipped, and why.
    Skipped(String),
    /// Running.
    Running(Running),
}

/// The events leg while it runs.
pub struct Running {
    /// What was published.
    pub ledger: Arc<Ledger>,
    /// The shop's publisher.
    pub publisher: Arc<Publisher>,
    tally: Arc<Tally>,
    by_hand: bool,
    url: String,
    queue: String,
    stop_kills: watch::Sender<bool>,
    done: watch::Sender<bool>,
    killer: tokio::task::JoinHandle<()>,
    description: String,
}

/// How the events leg went, for the report.
#[derive(Debug, Clone, Default)]
pub struct EventsReport {
    /// Why it was skipped (`None`: it ran).
    pub skipped: Option<String>,
    /// A sentence on what ran.
    pub description: String,
    /// The counters, as lines of the traffic table.
    pub traffic: String,
    /// Consumers killed.
    pub kills: u64,
    /// Events published.
    pub published: u64,
    /// Deliveries a consumer held, not yet settled, when it was killed (`None` for the
    /// consumer by hand, which does not count them).
    pub held_when_killed: Option<u64>,
}

/// Starts the events leg for a shop on `database` (`None`: the SQLite default) whose tables
/// exist: declares the queue (afresh), starts the consumer and its killer, and connects the
/// shop's publisher. Skipped, with the reason, when it cannot run.
pub async fn start(
    amqp: Option<&str>,
    database: Option<&str>,
    db: &Db,
    t: &Tables,
    guards: &Guards,
    workload: &Workload,
) -> Leg {
    let (opening, chaos, seed) = (&workload.opening, &workload.rates, workload.seed);
    let Some(url) = amqp else {
        return Leg::Skipped("no AMQP broker given".into());
    };
    let (Some(database), Engine::Postgres | Engine::MySql) = (database, db.engine()) else {
        return Leg::Skipped(
            "inbox mode keeps idem's records in the shop's database, which needs PostgreSQL \
             or MySQL/MariaDB (--database); idem has no inbox store for SQLite"
                .into(),
        );
    };
    let queue = format!("{}order_paid", t.prefix());
    let shown = idem::idem_store::redact(url);
    // The probe, with a short timeout: a broker that does not answer skips the leg. It also
    // clears what an earlier run with this prefix left.
    match tokio::time::timeout(PROBE_TIMEOUT, AmqpSource::delete_topology(url, &queue)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Leg::Skipped(format!("no AMQP broker answers at {shown}: {e}")),
        Err(_) => {
            return Leg::Skipped(format!(
                "no AMQP broker answered at {shown} within {PROBE_TIMEOUT:?}"
            ));
        }
    }
    match start_running(url, &queue, database, db, t, guards, opening, chaos, seed).await {
        Ok(r) => Leg::Running(r),
        Err(e) => Leg::Skipped(format!("the events leg could not start: {e}")),
    }
}

#[allow(clippy::too_many_arguments)]
async fn start_running(
    url: &str,
    queue: &str,
    database: &str,
    db: &Db,
    t: &Tables,
    guards: &Guards,
    opening: &Opening,
    chaos: &Rates,
    seed: u64,
) -> Result<Running, String> {
    let inventory = Inventory::new(t, 6, seed.wrapping_add(4))?;
    let database = match database.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => database.to_owned(),
    };
    let (way, how) = if !guards.on(Guard::Events) {
        (Way::ByHand, "by hand: commit, then ack")
    } else {
        let engine = db.engine();
        let how = if engine == Engine::Postgres {
            "idem-mq inbox on PostgreSQL"
        } else {
            "idem-mq inbox on MySQL"
        };
        (
            Way::Inbox {
                engine,
                table: t.records.clone(),
            },
            how,
        )
    };
    // The queue is declared before anything is published to it.
    let first = AmqpSource::builder(url, queue)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    first.shutdown().await;
    let amqp = AmqpPublisher::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let ledger = Arc::new(Ledger::default());
    let publisher = Arc::new(Publisher {
        amqp,
        queue: queue.to_owned(),
        skus: opening.skus,
        twice: if chaos.duplicate > 0.0 { TWICE } else { 0.0 },
        rng: Mutex::new(StdRng::seed_from_u64(seed.wrapping_add(3))),
        ledger: ledger.clone(),
    });
    let (stop_kills, kills_stopped) = watch::channel(false);
    let (done, _) = watch::channel(false);
    let tally = Arc::new(Tally::default());
    let ends = Ends {
        amqp: url.to_owned(),
        database,
        queue: queue.to_owned(),
    };
    let killer = tokio::spawn(kill_and_restart(
        Shared {
            way: way.clone(),
            inventory,
            ends,
            done: done.subscribe(),
            tally: tally.clone(),
            ledger: ledger.clone(),
        },
        kills_stopped,
        chaos.crash > 0.0,
        seed.wrapping_add(5),
    ));
    Ok(Running {
        ledger,
        publisher,
        tally,
        by_hand: matches!(way, Way::ByHand),
        url: url.to_owned(),
        queue: queue.to_owned(),
        stop_kills,
        done,
        killer,
        description: format!(
            "RabbitMQ at {}, queue {queue}, consumer {how}",
            idem::idem_store::redact(url)
        ),
    })
}

impl Running {
    /// Stops the kills, waits until every published event has its row in the stock events
    /// table and the consumer has received nothing new for a while (bounded), then stops the
    /// consumer and deletes the queue if `drop_after`.
    pub async fn finish(self, db: &Db, t: &Tables, drop_after: bool) -> EventsReport {
        let _ = self.stop_kills.send(true);
        let started = Instant::now();
        let sql = format!("SELECT DISTINCT order_id FROM {}", t.stock_events);
        let mut last = (self.tally.now().received, Instant::now());
        while started.elapsed() < SETTLE_LIMIT {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let received = self.tally.now().received;
            if received != last.0 {
                last = (received, Instant::now());
                continue;
            }
            if self.ledger.in_flight.load(Ordering::SeqCst) > 0 || last.1.elapsed() < QUIET {
                continue;
            }
            let Ok(rows) = db.rows(&sql, &[]).await else {
                continue;
            };
            let have: BTreeSet<i64> = rows.iter().map(|r| crate::db::int(r, 0)).collect();
            if self.ledger.published().is_subset(&have) {
                break;
            }
        }
        let _ = self.done.send(true);
        let _ = self.killer.await;
        if drop_after {
            let _ = AmqpSource::delete_topology(&self.url, &self.queue).await;
        }
        let l = &self.ledger;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let n = self.tally.now();
        let mut rows = vec![
            ("order paid events published", get(&l.events)),
            ("  published twice (publisher retry)", get(&l.twice)),
            (
                "  publishes not confirmed, tried again",
                get(&l.publish_failures),
            ),
            ("inventory consumer killed", get(&l.kills)),
            ("  deliveries received", n.received),
        ];
        let held = (!self.by_hand).then(|| n.held());
        if let Some(held) = held {
            rows.extend([
                ("  held by a consumer when it was killed", held),
                ("  handled", n.handled),
                ("  acked without running (duplicates)", n.replayed),
                ("  requeued", n.requeued),
                ("  dead-lettered", n.dead_lettered),
            ]);
        }
        EventsReport {
            skipped: None,
            description: self.description,
            traffic: rows
                .iter()
                .map(|(name, v)| format!("{name:<44} {v:>8}\n"))
                .collect(),
            kills: get(&l.kills),
            published: get(&l.events),
            held_when_killed: held,
        }
    }
}
