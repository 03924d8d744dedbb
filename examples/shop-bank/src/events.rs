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

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_guard::{Bounded, Counter, Scalar, numbered};
use idem_mq::amqp::{AmqpPublisher, AmqpSource, BasicProperties};
use idem_mq::inbox::{Inbox, InboxHandler, InboxStore};
use idem_mq::{Consumer, Delivery, Disposition, Failure, Message, Source};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Postgres, Transaction};
use tokio::sync::watch;

use crate::chaos::{Rates, Workload};
use crate::db::{Db, DbError, Engine};
use crate::schema::{Guard, Guards, Opening, Tables};

/// The broker the demo looks for by default.
pub const DEFAULT_AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How long the demo waits for a broker to answer before it runs without the events leg.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// How often an event is published a second time under the same message id (unless the run
/// is calm).
const TWICE: f64 = 0.3;

/// How many events one consumer handles at once.
const CONCURRENCY: u16 = 8;

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

/// What was published and what the consumers did, for the audit and the report.
#[derive(Debug, Default)]
pub struct Ledger {
    published: Mutex<BTreeSet<i64>>,
    unconfirmed: Mutex<BTreeSet<i64>>,
    in_flight: AtomicU64,
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
    amqp: AmqpPublisher,
    queue: String,
    skus: i64,
    twice: f64,
    rng: Mutex<StdRng>,
    ledger: Arc<Ledger>,
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

/// The inventory's work for one event: one item of its SKU (never below zero), and a row in
/// the stock events table saying what was done.
#[derive(Debug, Clone)]
pub struct Inventory {
    stock: Counter,
    insert: String,
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
            insert: format!(
                "INSERT INTO {} (order_id, sku, qty, outcome) VALUES (?, ?, ?, ?)",
                t.stock_events
            ),
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

    /// By hand, without idem: its own transaction, committed, then the caller acks. A
    /// duplicate, or a redelivery after a kill between the commit and the ack, deducts again.
    async fn by_hand(&self, db: &Db, payload: &[u8]) -> Result<(), DbError> {
        let Ok(ev) = serde_json::from_slice::<OrderPaid>(payload) else {
            return Ok(());
        };
        let mut tx = db.begin().await?;
        self.pause().await;
        let done = tx
            .add(&self.stock, Scalar::Text(ev.sku.clone()), -ev.qty)
            .await?;
        let (qty, outcome) = match done {
            Bounded::Applied(_) => (ev.qty, "deducted"),
            _ => (0, "insufficient_stock"),
        };
        tx.exec(
            &self.insert,
            &[
                ev.order.into(),
                Scalar::Text(ev.sku),
                qty.into(),
                outcome.into(),
            ],
        )
        .await?;
        tx.commit().await
    }
}

impl InboxHandler<Postgres> for Inventory {
    type Output = String;
    type Error = String;

    async fn handle<'t>(
        &'t self,
        tx: &'t mut Transaction<'static, Postgres>,
        message: Message,
    ) -> Result<String, Failure<String>> {
        let ev = event(&message)?;
        self.pause().await;
        let done = self
            .stock
            .add_pg(tx, Scalar::Text(ev.sku.clone()), -ev.qty)
            .await
            .map_err(retry)?;
        let outcome = outcome(done)?;
        let qty = if outcome == "deducted" { ev.qty } else { 0 };
        sqlx::query(sqlx::AssertSqlSafe(numbered(&self.insert)))
            .bind(ev.order)
            .bind(&ev.sku)
            .bind(qty)
            .bind(outcome)
            .execute(&mut **tx)
            .await
            .map_err(retry)?;
        Ok(outcome.to_owned())
    }
}

impl InboxHandler<MySql> for Inventory {
    type Output = String;
    type Error = String;

    async fn handle<'t>(
        &'t self,
        tx: &'t mut Transaction<'static, MySql>,
        message: Message,
    ) -> Result<String, Failure<String>> {
        let ev = event(&message)?;
        self.pause().await;
        let done = self
            .stock
            .add_mysql(tx, Scalar::Text(ev.sku.clone()), -ev.qty)
            .await
            .map_err(retry)?;
        let outcome = outcome(done)?;
        let qty = if outcome == "deducted" { ev.qty } else { 0 };
        sqlx::query(sqlx::AssertSqlSafe(self.insert.clone()))
            .bind(ev.order)
            .bind(&ev.sku)
            .bind(qty)
            .bind(outcome)
            .execute(&mut **tx)
            .await
            .map_err(retry)?;
        Ok(outcome.to_owned())
    }
}

/// How the inventory consumes.
#[derive(Debug, Clone)]
enum Way {
    /// `idem-mq` in inbox mode, idem's records in `table` of the shop's database.
    Inbox { engine: Engine, table: String },
    /// By hand: commit, then ack (the events guard off).
    ByHand,
}

/// The consumer of the life now running, for its counts.
#[derive(Clone)]
enum Current {
    Postgres(Consumer<idem::PostgresStore>),
    MySql(Consumer<idem::MySqlStore>),
}

impl Current {
    fn counts(&self) -> idem_mq::Counts {
        match self {
            Current::Postgres(c) => c.counts(),
            Current::MySql(c) => c.counts(),
        }
    }
}

/// The outcomes of every life of the consumer.
#[derive(Default)]
struct Tally {
    /// Received, handled, acked without running, requeued, dead-lettered, unsettled, by lives
    /// that ended (and every delivery the by-hand consumer received).
    ended: Mutex<[u64; 6]>,
    current: Mutex<Option<Current>>,
}

impl Tally {
    fn now(&self) -> [u64; 6] {
        let mut sum = *self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = &*self.current.lock().unwrap_or_else(PoisonError::into_inner) {
            let c = c.counts();
            let live = [
                c.received,
                c.handled,
                c.replayed,
                c.requeued,
                c.dead_lettered,
            ];
            for (s, l) in sum.iter_mut().zip(live) {
                *s += l;
            }
        }
        sum
    }

    fn set_current(&self, c: Current) {
        self.retire();
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(c);
    }

    /// Moves the current life's counts to the ended lives'.
    fn retire(&self) {
        let now = self.now();
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = None;
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) = now;
    }

    fn received_by_hand(&self) {
        self.ended.lock().unwrap_or_else(PoisonError::into_inner)[0] += 1;
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

async fn inbox<S>(
    consumer: Consumer<S>,
    store: S,
    inventory: Inventory,
    source: AmqpSource,
    done: impl Future<Output = ()> + Send,
) -> Result<(), String>
where
    S: InboxStore + Send + Sync + 'static,
    Inventory: InboxHandler<S::Db>,
{
    consumer
        .run(source, Inbox::new(store, inventory), done)
        .await
        .map_err(|e| e.to_string())
}

/// Where one life of the consumer connects.
#[derive(Debug, Clone)]
struct Ends {
    amqp: String,
    database: String,
    queue: String,
}

/// One life of the consumer: connects to the broker and the database, and consumes until
/// `done` (or until it is killed).
async fn live(
    way: Way,
    inventory: Inventory,
    ends: Ends,
    mut done: watch::Receiver<bool>,
    tally: Arc<Tally>,
) -> Result<(), String> {
    let mut source = AmqpSource::builder(ends.amqp, ends.queue)
        .prefetch(CONCURRENCY)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let stop = {
        let mut done = done.clone();
        async move {
            let _ = done.wait_for(|d| *d).await;
        }
    };
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
            let c = consumer(store.clone());
            tally.set_current(Current::Postgres(c.clone()));
            inbox(c, store, inventory, source, stop).await
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
            let c = consumer(store.clone());
            tally.set_current(Current::MySql(c.clone()));
            inbox(c, store, inventory, source, stop).await
        }
        Way::ByHand => {
            let db = Db::connect(&ends.database, pool)
                .await
                .map_err(|e| e.to_string())?;
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
                let how = match inventory.by_hand(&db, delivery.payload()).await {
                    Ok(()) => Disposition::Ack,
                    Err(_) => Disposition::Requeue {
                        delay: Duration::from_millis(100),
                    },
                };
                let _ = delivery.settle(how).await;
            }
            source.close().await;
            db.close().await;
            Ok(())
        }
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

/// A TCP relay on a loopback port to a server: a consumer connects through its own, so that
/// killing the consumer can cut its connections the way a crashed process's sockets close.
/// (Dropping a consumer's task alone would leave its connections open: the broker would keep
/// its unacked events, and the database its open transaction and the locks it holds.)
struct Wire {
    url: String,
    relay: tokio::task::JoinHandle<()>,
}

impl Wire {
    /// A relay to the server of `url` (`scheme://[user@]host[:port]/…`; `default_port` when
    /// none is given) and the URL that goes through it. `None` for a URL it cannot relay:
    /// TLS (`amqps://`, which checks the server's name), or no host.
    async fn open(url: &str, default_port: u16) -> Option<Wire> {
        let (scheme, rest) = url.split_once("://")?;
        if scheme == "amqps" {
            return None;
        }
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, host_port) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        if host_port.is_empty() {
            return None;
        }
        let has_port = match host_port.rsplit_once(':') {
            Some((h, p)) => !h.ends_with(':') && p.parse::<u16>().is_ok(),
            None => false,
        };
        let target = if has_port {
            host_port.to_owned()
        } else {
            format!("{host_port}:{default_port}")
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
        let addr = listener.local_addr().ok()?;
        let relay = tokio::spawn(async move {
            // Dropped with the relay task: every connection through it is cut at once.
            let mut links = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                links.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                while links.try_join_next().is_some() {}
            }
        });
        Some(Wire {
            url: format!("{scheme}://{userinfo}{addr}{tail}"),
            relay,
        })
    }

    fn cut(self) {
        self.relay.abort();
    }
}

/// What every life of the consumer shares.
struct Shared {
    way: Way,
    inventory: Inventory,
    ends: Ends,
    done: watch::Receiver<bool>,
    tally: Arc<Tally>,
    ledger: Arc<Ledger>,
}

/// One life of the consumer.
struct Life {
    task: tokio::task::JoinHandle<Result<(), String>>,
    wires: Option<(Wire, Wire)>,
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
            Wire::open(&ends.amqp, 5672).await,
            Wire::open(&ends.database, db_port).await,
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
async fn kill_and_restart(
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

impl Running {
    /// Stops the kills, waits until every published event has its row in the stock events
    /// table and the consumer has received nothing new for a while (bounded), then stops the
    /// consumer and deletes the queue if `drop_after`.
    pub async fn finish(self, db: &Db, t: &Tables, drop_after: bool) -> EventsReport {
        let _ = self.stop_kills.send(true);
        let started = Instant::now();
        let sql = format!("SELECT DISTINCT order_id FROM {}", t.stock_events);
        let mut last = (self.tally.now()[0], Instant::now());
        while started.elapsed() < SETTLE_LIMIT {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let received = self.tally.now()[0];
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
            ("  deliveries received", n[0]),
        ];
        let held = (!self.by_hand).then(|| n[0].saturating_sub(n[1..].iter().sum::<u64>()));
        if let Some(held) = held {
            rows.extend([
                ("  held by a consumer when it was killed", held),
                ("  handled", n[1]),
                ("  acked without running (duplicates)", n[2]),
                ("  requeued", n[3]),
                ("  dead-lettered", n[4]),
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
