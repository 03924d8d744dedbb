//! The seeds' shop-and-bank scenarios as one HTTP service, and a chaos audit of it.
//!
//! The service ([`shop`]) uses each scheme where the seeds use it: a transfer by a
//! server-issued ticket, an inventory deduction keyed by order number with a conditional
//! decrement, a coupon hold through a state machine, an order form with a one-time token, one
//! fund account per user through a unique index, payment callbacks deduplicated by payment id,
//! order status changes under an optimistic lock, and wires to another bank ([`bank`]) in
//! steps with recovery points. Every write from the shop's clients is also behind the
//! `Idempotency-Key` layer.
//!
//! [`run`] opens the books, serves the shop on a loopback port, lets the [`chaos`] clients
//! loose on it (timeouts, lost answers, duplicates, double clicks, a service that stops after
//! committing), and then [`audit`]s the books against the opening books and every answer the
//! clients accepted.
//!
//! On PostgreSQL or MySQL, with a RabbitMQ broker answering, the [`events`] leg runs too: an
//! "order paid" event for every credited payment, consumed by an inventory consumer that is
//! killed and restarted during the run, and audited to have taken stock once per event.

pub mod audit;
pub mod bank;
pub mod chaos;
pub mod db;
pub mod events;
pub mod schema;
pub mod shop;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::SharedStore;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub use audit::{Findings, Violation};
pub use chaos::{Journal, Rates, ServerChaos, Workload};
pub use db::Db;
pub use events::{DEFAULT_AMQP, EventsReport};
pub use schema::{Guard, Guards, Opening, Tables};
pub use shop::Shop;

/// Why the demo could not run (as opposed to an audit that found something).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The shop's database failed.
    #[error("database: {0}")]
    Db(#[from] db::DbError),
    /// idem's store could not be opened.
    #[error("idem store: {0}")]
    Store(String),
    /// Something else could not be set up.
    #[error("{0}")]
    Setup(String),
}

/// One run of the demo.
#[derive(Debug, Clone)]
pub struct Demo {
    /// `postgres://…`, `mysql://…` or `sqlite://PATH`; `None` for SQLite in a temporary
    /// directory.
    pub database: Option<String>,
    /// The prefix of the shop's tables.
    pub prefix: String,
    /// Which guards are on.
    pub guards: Guards,
    /// What the clients do.
    pub workload: Workload,
    /// Whether to print progress to standard error.
    pub progress: bool,
    /// Whether to drop the tables (and the events queue) after the audit.
    pub drop_after: bool,
    /// The AMQP broker for the events leg (`None`: no events leg).
    pub amqp: Option<String>,
}

impl Demo {
    /// The default run: SQLite, every guard on, 16 clients, 1 500 operations, seed 1.
    pub fn new() -> Self {
        Self {
            database: None,
            prefix: "shop_".into(),
            guards: Guards::all(),
            workload: Workload {
                clients: 16,
                operations: 1_500,
                seed: 1,
                rates: Rates::default(),
                opening: Opening::default(),
            },
            progress: false,
            drop_after: false,
            amqp: Some(DEFAULT_AMQP.into()),
        }
    }
}

impl Default for Demo {
    fn default() -> Self {
        Self::new()
    }
}

/// What a run found.
#[derive(Debug)]
pub struct Report {
    /// The audit.
    pub findings: Findings,
    /// The wire's counters, as a table.
    pub traffic: String,
    /// How long the clients ran.
    pub elapsed: Duration,
    /// The events leg: what ran, or why it was skipped.
    pub events: EventsReport,
}

/// The shop's database and idem's store for `database`; the temporary directory holding
/// them, if one was made, lives as long as the returned value.
pub async fn open(
    database: Option<&str>,
    tables: &Tables,
) -> Result<(Db, StoreOpener, Option<tempfile::TempDir>), Error> {
    let (url, dir) = match database {
        Some(url) => (url.to_owned(), None),
        None => {
            let dir = tempfile::tempdir().map_err(|e| Error::Setup(e.to_string()))?;
            let url = format!("sqlite://{}", dir.path().join("shop.db").display());
            (url, Some(dir))
        }
    };
    let db = Db::connect(&url, 16).await?;
    let store = match url.split_once("://") {
        Some(("sqlite", path)) if !path.is_empty() && !path.contains('?') => {
            StoreOpener::Sqlite(format!("{path}.idem"))
        }
        _ if url.starts_with("sqlite:") => {
            return Err(Error::Setup(format!(
                "a SQLite database is named sqlite://PATH, without options: {url}"
            )));
        }
        _ => {
            let sep = if url.contains('?') { '&' } else { '?' };
            StoreOpener::Url(format!("{url}{sep}idem_table={}", tables.records))
        }
    };
    Ok((db, store, dir))
}

/// How to open idem's store once the tables exist.
#[derive(Debug, Clone)]
pub enum StoreOpener {
    /// A SQLite file of its own.
    Sqlite(String),
    /// The shop's own server database, in its own table.
    Url(String),
}

impl StoreOpener {
    /// Opens (and migrates) the store.
    pub async fn open(&self) -> Result<SharedStore, Error> {
        match self {
            StoreOpener::Sqlite(path) => idem::SqliteStore::open(path)
                .map(|s| Arc::new(s) as SharedStore)
                .map_err(|e| Error::Store(e.to_string())),
            StoreOpener::Url(url) => idem::open(url)
                .await
                .map_err(|e| Error::Store(e.to_string())),
        }
    }
}

/// Opens the books, serves the shop on a loopback port, runs the chaos clients against it,
/// and audits the books.
pub async fn run(demo: &Demo) -> Result<Report, Error> {
    let w = &demo.workload;
    let r = &w.rates;
    let rates = [r.timeout, r.drop, r.duplicate, r.double_click, r.crash];
    if !rates.iter().all(|p| (0.0..=1.0).contains(p)) {
        return Err(Error::Setup(
            "every rate is a probability from 0 to 1".into(),
        ));
    }
    let o = &w.opening;
    if o.customers < 2 || o.skus < 1 || o.coupons < 1 || o.balance < 0 || o.stock < 0 {
        return Err(Error::Setup(
            "the books open with at least 2 customers, 1 SKU and 1 coupon".into(),
        ));
    }
    let tables = Tables::new(&demo.prefix).map_err(Error::Setup)?;
    let (db, store, _dir) = open(demo.database.as_deref(), &tables).await?;
    tables.create(&db, &demo.guards, &w.opening).await?;
    let store = store.open().await?;
    let rates = &w.rates;
    let chaos = ServerChaos::new(rates.crash, rates.pause_ms, w.seed.wrapping_add(1));
    let mut shop = Shop::new(
        db.clone(),
        tables.clone(),
        store.clone(),
        demo.guards.clone(),
        chaos,
    )
    .map_err(Error::Setup)?;
    let leg = events::start(
        demo.amqp.as_deref(),
        demo.database.as_deref(),
        &db,
        &tables,
        &demo.guards,
        w,
    )
    .await;
    if let events::Leg::Running(running) = &leg {
        shop = shop.with_events(running.publisher.clone());
    }
    let shop = Arc::new(shop);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::Setup(e.to_string()))?;
    let base = format!(
        "http://{}",
        listener
            .local_addr()
            .map_err(|e| Error::Setup(e.to_string()))?
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let server = {
        let app = shop::app(shop.clone(), store);
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
        })
    };
    let expirer = tokio::spawn(expire_coupons(shop.clone(), w.clone(), stopped.clone()));
    let journal = Arc::new(Journal::default());
    let progress = demo
        .progress
        .then(|| tokio::spawn(show_progress(journal.clone(), w.operations, stopped)));
    let started = Instant::now();
    chaos::run(base, w, journal.clone()).await;
    let elapsed = started.elapsed();
    let _ = stop.send(true);
    let _ = expirer.await;
    if let Some(p) = progress {
        let _ = p.await;
    }
    let _ = server.await;
    let (events, ledger) = match leg {
        events::Leg::Skipped(why) => (
            EventsReport {
                skipped: Some(why),
                ..EventsReport::default()
            },
            None,
        ),
        events::Leg::Running(running) => {
            let ledger = running.ledger.clone();
            let report = running.finish(&db, &tables, demo.drop_after).await;
            (report, Some(ledger))
        }
    };
    let findings = audit::audit(&db, &tables, &w.opening, &journal, ledger.as_deref()).await?;
    if demo.drop_after {
        tables.drop_all(&db).await?;
    }
    // Bounded: a connection a cancelled statement never gave back would hold it up forever.
    let _ = tokio::time::timeout(Duration::from_secs(10), db.close()).await;
    Ok(Report {
        findings,
        traffic: traffic(&journal) + &events.traffic,
        elapsed,
        events,
    })
}

/// The job that expires coupons while the clients hold them: about one coupon in six over a
/// run.
async fn expire_coupons(
    shop: Arc<Shop>,
    w: Workload,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(w.seed.wrapping_add(2));
    let every = Duration::from_millis(40);
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(every) => {}
        }
        if rng.random_bool(0.25) {
            let coupon = rng.random_range(1..=w.opening.coupons);
            // A failed expiry is the job's own business; the next round goes on.
            let _ = shop.expire_coupon(coupon).await;
        }
    }
}

async fn show_progress(
    journal: Arc<Journal>,
    total: u64,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let c = &journal.counters;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        eprintln!(
            "progress: {}/{total} operations, {} requests, {} retries, {} timeouts, {} dropped, {} crashes",
            c.operations.load(Ordering::Relaxed),
            c.requests.load(Ordering::Relaxed),
            c.retries.load(Ordering::Relaxed),
            c.timeouts.load(Ordering::Relaxed),
            c.dropped.load(Ordering::Relaxed),
            c.crashes.load(Ordering::Relaxed),
        );
    }
}

fn traffic(journal: &Journal) -> String {
    let c = &journal.counters;
    let rows = [
        ("operations", &c.operations),
        ("requests", &c.requests),
        ("retries", &c.retries),
        ("timeouts (client hung up)", &c.timeouts),
        ("answers lost", &c.dropped),
        ("duplicates sent at once", &c.duplicates),
        ("double clicks", &c.double_clicks),
        ("service stopped after commit", &c.crashes),
        ("key in use (409)", &c.in_progress),
        ("answers replayed", &c.replays),
        ("operations given up", &c.gave_up),
    ];
    rows.iter()
        .map(|(name, v)| format!("{name:<44} {:>8}\n", v.load(Ordering::Relaxed)))
        .collect()
}

/// Opens fresh books and serves the shop on `listener` with no chaos, until `shutdown`
/// completes: for trying it by hand.
pub async fn serve(
    database: Option<&str>,
    prefix: &str,
    guards: Guards,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let tables = Tables::new(prefix).map_err(Error::Setup)?;
    let (db, store, _dir) = open(database, &tables).await?;
    tables.create(&db, &guards, &Opening::default()).await?;
    let store = store.open().await?;
    let shop = Arc::new(
        Shop::new(db, tables, store.clone(), guards, ServerChaos::off()).map_err(Error::Setup)?,
    );
    axum::serve(listener, shop::app(shop, store))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| Error::Setup(e.to_string()))
}
