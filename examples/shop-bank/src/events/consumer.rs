//! The inventory consumer, and its deaths: each life connects to the broker and the database
//! through relays of its own and consumes (through idem-mq's inbox, or by hand) until it is
//! killed, when its connections are cut and its task dropped wherever it was, and a new life
//! starts; the tally adds up what every life received and settled.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_mq::amqp::AmqpSource;
use idem_mq::inbox::{Inbox, InboxHandler, InboxStore};
use idem_mq::{Consumer, Delivery, Disposition, Source};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::watch;

use super::inventory::Inventory;
use super::publisher::Ledger;
use super::relay::Relay;
use crate::db::{Db, Engine};

/// How many events one consumer handles at once.
const CONCURRENCY: u16 = 8;

/// How the inventory consumes.
#[derive(Debug, Clone)]
pub(super) enum Way {
    /// `idem-mq` in inbox mode, idem's records in `table` of the shop's database.
    Inbox {
        /// The shop's database.
        engine: Engine,
        /// idem's records table.
        table: String,
    },
    /// By hand: commit, then ack (the events guard off).
    ByHand,
}

/// Deliveries a consumer received, and how it settled them.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Deliveries {
    /// Received.
    pub(super) received: u64,
    /// Handled and acked.
    pub(super) handled: u64,
    /// Acked without running (duplicates).
    pub(super) replayed: u64,
    /// Requeued.
    pub(super) requeued: u64,
    /// Dead-lettered.
    pub(super) dead_lettered: u64,
}

impl Deliveries {
    fn of(c: idem_mq::Counts) -> Self {
        Self {
            received: c.received,
            handled: c.handled,
            replayed: c.replayed,
            requeued: c.requeued,
            dead_lettered: c.dead_lettered,
        }
    }

    fn plus(self, other: Self) -> Self {
        Self {
            received: self.received + other.received,
            handled: self.handled + other.handled,
            replayed: self.replayed + other.replayed,
            requeued: self.requeued + other.requeued,
            dead_lettered: self.dead_lettered + other.dead_lettered,
        }
    }

    /// Received and never settled: held by a consumer when it was killed.
    pub(super) fn held(self) -> u64 {
        self.received
            .saturating_sub(self.handled + self.replayed + self.requeued + self.dead_lettered)
    }
}

/// The counts of the life now running, read from its consumer.
type Live = Box<dyn Fn() -> Deliveries + Send>;

/// The deliveries of every life of the consumer.
#[derive(Default)]
pub(super) struct Tally {
    /// Those of the lives that ended (and every delivery the by-hand consumer received).
    ended: Mutex<Deliveries>,
    /// The life now running, if it runs through idem-mq.
    current: Mutex<Option<Live>>,
}

impl Tally {
    /// Every life's deliveries so far.
    pub(super) fn now(&self) -> Deliveries {
        let ended = *self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        match &*self.current.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(live) => ended.plus(live()),
            None => ended,
        }
    }

    fn set_current(&self, live: Live) {
        self.retire();
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(live);
    }

    /// Moves the current life's counts to the ended lives'.
    fn retire(&self) {
        let now = self.now();
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = None;
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) = now;
    }

    fn received_by_hand(&self) {
        self.ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .received += 1;
    }
}

/// The consumer's settings: a short lease, so that a key a killed consumer held is taken
/// over soon; a short backoff; and no attempt limit a run of kills could reach.
fn consumer<S: idem_core::Store + Clone>(store: S) -> Consumer<S> {
    Consumer::new(store)
        .concurrency(usize::from(CONCURRENCY))
        .lease(Duration::from_secs(1))
        .wait_in_flight(Duration::from_millis(500))
        .backoff(Duration::from_millis(100), Duration::from_secs(1))
        .max_attempts(1_000)
        .drain(Duration::from_secs(10))
}

/// Where one life of the consumer connects.
#[derive(Debug, Clone)]
pub(super) struct Ends {
    /// The broker.
    pub(super) amqp: String,
    /// The shop's database.
    pub(super) database: String,
    /// The queue.
    pub(super) queue: String,
}

/// One life of the consumer: connects to the broker and the database, and consumes until
/// `done` (or until it is killed).
async fn live(
    way: Way,
    inventory: Inventory,
    ends: Ends,
    done: watch::Receiver<bool>,
    tally: Arc<Tally>,
) -> Result<(), String> {
    let source = AmqpSource::builder(ends.amqp, ends.queue)
        .prefetch(CONCURRENCY)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let pool = u32::from(CONCURRENCY) + 2;
    match way {
        Way::Inbox {
            engine: Engine::Postgres,
            table,
        } => {
            let options = idem::PostgresOptions {
                table,
                max_connections: pool,
                ..idem::PostgresOptions::default()
            };
            let store = idem::PostgresStore::connect_with(&ends.database, options)
                .await
                .map_err(|e| e.to_string())?;
            inbox(store, inventory, source, done, &tally).await
        }
        Way::Inbox { table, .. } => {
            let options = idem::MySqlOptions {
                table,
                max_connections: pool,
                ..idem::MySqlOptions::default()
            };
            let store = idem::MySqlStore::connect_with(&ends.database, options)
                .await
                .map_err(|e| e.to_string())?;
            inbox(store, inventory, source, done, &tally).await
        }
        Way::ByHand => {
            let db = Db::connect(&ends.database, pool)
                .await
                .map_err(|e| e.to_string())?;
            by_hand(&inventory, &db, source, done, &tally).await;
            db.close().await;
            Ok(())
        }
    }
}

/// Consumes through idem-mq's inbox on `store` until `done`.
async fn inbox<S>(
    store: S,
    inventory: Inventory,
    source: AmqpSource,
    mut done: watch::Receiver<bool>,
    tally: &Tally,
) -> Result<(), String>
where
    S: InboxStore + Send + Sync + 'static,
    Inventory: InboxHandler<S::Db>,
{
    let c = consumer(store.clone());
    let counts = c.clone();
    tally.set_current(Box::new(move || Deliveries::of(counts.counts())));
    let stop = async move {
        let _ = done.wait_for(|d| *d).await;
    };
    c.run(source, Inbox::new(store, inventory), stop)
        .await
        .map_err(|e| e.to_string())
}

/// Consumes by hand until `done`: each event's work committed, then acked.
async fn by_hand(
    inventory: &Inventory,
    db: &Db,
    mut source: AmqpSource,
    mut done: watch::Receiver<bool>,
    tally: &Tally,
) {
    loop {
        let next = tokio::select! {
            _ = done.wait_for(|d| *d) => break,
            next = source.next() => next,
        };
        let delivery = match next {
            None => break,
            Some(Err(_)) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Some(Ok(d)) => d,
        };
        tally.received_by_hand();
        let how = match inventory.by_hand(db, delivery.payload()).await {
            Ok(()) => Disposition::Ack,
            Err(_) => Disposition::Requeue {
                delay: Duration::from_millis(100),
            },
        };
        let _ = delivery.settle(how).await;
    }
    source.close().await;
}

/// What every life of the consumer shares.
pub(super) struct Shared {
    /// How it consumes.
    pub(super) way: Way,
    /// Its work.
    pub(super) inventory: Inventory,
    /// Where it connects.
    pub(super) ends: Ends,
    /// Set when the consumer alive is to stop.
    pub(super) done: watch::Receiver<bool>,
    /// Its counts.
    pub(super) tally: Arc<Tally>,
    /// Where its kills are counted.
    pub(super) ledger: Arc<Ledger>,
}

/// One life of the consumer.
struct Life {
    task: tokio::task::JoinHandle<Result<(), String>>,
    wires: Option<(Relay, Relay)>,
}

impl Life {
    async fn start(shared: &Shared) -> Life {
        let ends = &shared.ends;
        let db_port = if ends.database.starts_with("mysql") {
            3306
        } else {
            5432
        };
        let wires = match (
            Relay::open(&ends.amqp, 5672).await,
            Relay::open(&ends.database, db_port).await,
        ) {
            (Some(a), Some(d)) => Some((a, d)),
            (a, d) => {
                for w in [a, d].into_iter().flatten() {
                    w.cut();
                }
                None
            }
        };
        let through = match &wires {
            Some((a, d)) => Ends {
                amqp: a.url.clone(),
                database: d.url.clone(),
                queue: ends.queue.clone(),
            },
            None => ends.clone(),
        };
        let task = tokio::spawn(live(
            shared.way.clone(),
            shared.inventory.clone(),
            through,
            shared.done.clone(),
            shared.tally.clone(),
        ));
        Life { task, wires }
    }

    /// A crash, as the broker and the database see it: the consumer's connections are cut
    /// (the broker delivers its unacked events again, the database rolls back its open
    /// transaction), and its task is dropped wherever it was, its handlers with it.
    async fn kill(self) {
        if let Some((a, d)) = self.wires {
            a.cut();
            d.cut();
        }
        self.task.abort();
        let _ = self.task.await;
    }

    fn end(self) {
        if let Some((a, d)) = self.wires {
            a.cut();
            d.cut();
        }
    }
}

/// Runs the consumer, killing it (if `kills`) after 100 to 600 ms and starting a new one,
/// until told to stop killing; the consumer alive then runs on until `done`.
pub(super) async fn kill_and_restart(
    shared: Shared,
    mut stop_kills: watch::Receiver<bool>,
    kills: bool,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut life = Life::start(&shared).await;
    loop {
        let lifetime = Duration::from_millis(rng.random_range(100..=600));
        // Without relays (a TLS broker) a kill could not cut the connections; that consumer
        // is left to live.
        let killable = kills && life.wires.is_some();
        let kill = tokio::select! {
            _ = stop_kills.wait_for(|s| *s) => false,
            () = tokio::time::sleep(lifetime), if killable => true,
        };
        if !kill {
            break;
        }
        life.kill().await;
        shared.tally.retire();
        shared.ledger.kills.fetch_add(1, Ordering::Relaxed);
        life = Life::start(&shared).await;
    }
    // The last consumer lives on until `done`; if it failed (to connect), a new one runs.
    loop {
        let ended = (&mut life.task).await;
        let finished = *shared.done.borrow();
        if matches!(ended, Ok(Ok(()))) || finished {
            life.end();
            shared.tally.retire();
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        life.end();
        shared.tally.retire();
        life = Life::start(&shared).await;
    }
}
