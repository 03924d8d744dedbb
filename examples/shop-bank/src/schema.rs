//! The shop's tables, its opening books, and the guards that can be switched off.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use idem_guard::Scalar;

use crate::db::{Db, DbError, Engine};

/// A scheme that protects one scenario. Each can be switched off to see the audit catch what
/// it prevents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Guard {
    /// Transfers keyed by a server-issued ticket, unique in the transfers table (seed 001).
    Ticket,
    /// Deductions keyed by order number, with a conditional decrement (seed 004).
    Stock,
    /// Coupon holds through the state machine, the expired case answered (seed 004).
    Coupon,
    /// The order form's one-time token (seeds 002/003).
    Token,
    /// One fund account per user through a unique index (seed 001).
    Account,
    /// Payment callbacks deduplicated by payment id, the order's state machine (seed 003).
    Payment,
    /// Order status changes under an optimistic lock (seeds 001/004).
    Version,
    /// The inventory consumer of "order paid" events runs each event once through
    /// `idem-mq`'s inbox mode (seed 004's MQ redelivery); off, it deducts and acks by hand.
    Events,
    /// Wires to another bank run in steps with recovery points, the bank called with the
    /// step's own key (seed 001's transfer through a bank); off, each attempt runs the whole
    /// wire again and calls the bank with a key of its own.
    Wire,
}

impl Guard {
    /// Every guard.
    pub const ALL: [Guard; 9] = [
        Guard::Ticket,
        Guard::Stock,
        Guard::Coupon,
        Guard::Token,
        Guard::Account,
        Guard::Payment,
        Guard::Version,
        Guard::Events,
        Guard::Wire,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Guard::Ticket => "ticket",
            Guard::Stock => "stock",
            Guard::Coupon => "coupon",
            Guard::Token => "token",
            Guard::Account => "account",
            Guard::Payment => "payment",
            Guard::Version => "version",
            Guard::Events => "events",
            Guard::Wire => "wire",
        }
    }
}

impl fmt::Display for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Guard {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Guard::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Guard::ALL.iter().map(|g| g.name()).collect();
                format!(
                    "no guard is called {s:?}; the guards are {}",
                    names.join(", ")
                )
            })
    }
}

/// Which guards are on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Guards {
    off: BTreeSet<Guard>,
}

impl Guards {
    /// Every guard on.
    pub fn all() -> Self {
        Self::default()
    }

    /// Switches `guard` off.
    #[must_use]
    pub fn without(mut self, guard: Guard) -> Self {
        self.off.insert(guard);
        self
    }

    /// Whether `guard` is on.
    pub fn on(&self, guard: Guard) -> bool {
        !self.off.contains(&guard)
    }

    /// The guards switched off.
    pub fn off(&self) -> impl Iterator<Item = Guard> + '_ {
        self.off.iter().copied()
    }
}

/// Coupon states.
pub mod coupon {
    /// Can be held.
    pub const AVAILABLE: i64 = 1;
    /// Held by an order.
    pub const HELD: i64 = 2;
    /// Expired before anyone held it.
    pub const EXPIRED: i64 = 3;
}

/// Order states.
pub mod order {
    /// Created, not paid.
    pub const CREATED: i64 = 1;
    /// Paid.
    pub const PAID: i64 = 2;
    /// Paid and shipped.
    pub const SHIPPED: i64 = 3;
    /// Cancelled before payment.
    pub const CANCELLED: i64 = 4;

    /// The state's name.
    pub fn name(state: i64) -> &'static str {
        match state {
            CREATED => "created",
            PAID => "paid",
            SHIPPED => "shipped",
            CANCELLED => "cancelled",
            _ => "unknown",
        }
    }
}

/// The merchant's account id (its user is 0); payments are credited to it.
pub const MERCHANT: i64 = 0;

/// The books the shop opens with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    /// Customer accounts 1..=customers (user n owns account n).
    pub customers: i64,
    /// Each customer's opening balance.
    pub balance: i64,
    /// Stock keeping units `sku-1`…, each with `stock` items.
    pub skus: i64,
    /// Items of each SKU.
    pub stock: i64,
    /// Coupons 1..=coupons, all available.
    pub coupons: i64,
}

impl Default for Opening {
    fn default() -> Self {
        Self {
            customers: 12,
            balance: 1_000,
            skus: 4,
            stock: 60,
            coupons: 24,
        }
    }
}

impl Opening {
    /// The money customers hold between them, before and after any number of transfers.
    pub fn customer_money(&self) -> i64 {
        self.customers * self.balance
    }

    /// The name of SKU `n`.
    pub fn sku(n: i64) -> String {
        format!("sku-{n}")
    }
}

/// The shop's table names, all starting with one prefix so that several shops share a
/// database without meeting.
#[derive(Debug, Clone)]
pub struct Tables {
    /// Fund accounts: `id`, `user_id` (unique when the account guard is on), `balance`.
    pub accounts: String,
    /// Issued tickets: `ticket`, `account`.
    pub tickets: String,
    /// Transfers: `ticket` (unique when the ticket guard is on), `from_account`,
    /// `to_account`, `amount`, `outcome`.
    pub transfers: String,
    /// Stock: `sku`, `avail`.
    pub stock: String,
    /// Deductions: `order_no` (unique when the stock guard is on), `sku`, `qty`, `outcome`.
    pub deductions: String,
    /// Coupons: `coupon`, `status`, `order_no` (`''` when none).
    pub coupons: String,
    /// Orders: `id`, `user_id`, `form`, `amount`, `status`, `version`.
    pub orders: String,
    /// Every version an order had: `order_id`, `version`, `status`.
    pub order_events: String,
    /// Credited payments: `payment`, `order_id`, `amount`.
    pub payments: String,
    /// What the inventory consumer did for each "order paid" event it handled: `order_id`
    /// (deliberately not unique, so that the audit counts duplicates), `sku`, `qty`,
    /// `outcome`.
    pub stock_events: String,
    /// Wires to another bank: `wire` (the request's key, unique), `from_account`,
    /// `to_account` (at the other bank), `amount`, `status` (`debited`, `sent`,
    /// `insufficient_funds`), `receipt` (the bank's, once sent; `''` before).
    pub wires: String,
    /// The other bank's books ([`crate::bank`]): `bank_key` (the key of the call, unique),
    /// `reference` (the shop's wire; deliberately not unique, so that the audit counts
    /// duplicates), `to_account`, `amount`, `receipt`.
    pub bank_wires: String,
    /// idem's records (PostgreSQL and MySQL only; SQLite keeps them in a file of their own).
    pub records: String,
}

impl Tables {
    /// The tables named with `prefix` (letters, digits and `_`).
    pub fn new(prefix: &str) -> Result<Self, String> {
        if prefix.is_empty()
            || prefix.len() > 32
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
            || prefix.as_bytes()[0].is_ascii_digit()
        {
            return Err(format!(
                "the table prefix {prefix:?} must be 1 to 32 letters, digits or '_', not starting with a digit"
            ));
        }
        let t = |name: &str| format!("{prefix}{name}");
        Ok(Self {
            accounts: t("accounts"),
            tickets: t("tickets"),
            transfers: t("transfers"),
            stock: t("stock"),
            deductions: t("deductions"),
            coupons: t("coupons"),
            orders: t("orders"),
            order_events: t("order_events"),
            payments: t("payments"),
            stock_events: t("stock_events"),
            wires: t("wires"),
            bank_wires: t("bank_wires"),
            records: t("idem_records"),
        })
    }

    /// The prefix the tables are named with.
    pub fn prefix(&self) -> &str {
        self.accounts.strip_suffix("accounts").unwrap_or_default()
    }

    fn all(&self) -> [&str; 12] {
        [
            &self.accounts,
            &self.tickets,
            &self.transfers,
            &self.stock,
            &self.deductions,
            &self.coupons,
            &self.orders,
            &self.order_events,
            &self.payments,
            &self.stock_events,
            &self.wires,
            &self.bank_wires,
        ]
    }

    /// Drops the shop's tables (and idem's records table, on a server database).
    pub async fn drop_all(&self, db: &Db) -> Result<(), DbError> {
        for table in self.all() {
            db.exec(&format!("DROP TABLE IF EXISTS {table}"), &[])
                .await?;
        }
        if db.engine() != Engine::Sqlite {
            for table in [
                self.records.clone(),
                format!("{}_locks", self.records),
                format!("{}_counters", self.records),
                format!("{}_migrations", self.records),
            ] {
                db.exec(&format!("DROP TABLE IF EXISTS {table}"), &[])
                    .await?;
            }
        }
        Ok(())
    }

    /// Creates the tables afresh and opens the books. A switched-off guard's unique key is
    /// left out of the table it would protect.
    pub async fn create(&self, db: &Db, guards: &Guards, opening: &Opening) -> Result<(), DbError> {
        self.drop_all(db).await?;
        let unique = |g: Guard| if guards.on(g) { " PRIMARY KEY" } else { "" };
        let ddl = [
            format!(
                "CREATE TABLE {} (id BIGINT PRIMARY KEY, user_id BIGINT NOT NULL, balance BIGINT NOT NULL)",
                self.accounts
            ),
            format!(
                "CREATE TABLE {} (ticket BIGINT PRIMARY KEY, account BIGINT NOT NULL)",
                self.tickets
            ),
            format!(
                "CREATE TABLE {} (ticket BIGINT NOT NULL{}, from_account BIGINT NOT NULL, \
                 to_account BIGINT NOT NULL, amount BIGINT NOT NULL, outcome VARCHAR(32) NOT NULL)",
                self.transfers,
                unique(Guard::Ticket)
            ),
            format!(
                "CREATE TABLE {} (sku VARCHAR(64) PRIMARY KEY, avail BIGINT NOT NULL)",
                self.stock
            ),
            format!(
                "CREATE TABLE {} (order_no VARCHAR(64) NOT NULL{}, sku VARCHAR(64) NOT NULL, \
                 qty BIGINT NOT NULL, outcome VARCHAR(32) NOT NULL)",
                self.deductions,
                unique(Guard::Stock)
            ),
            format!(
                "CREATE TABLE {} (coupon BIGINT PRIMARY KEY, status BIGINT NOT NULL, \
                 order_no VARCHAR(64) NOT NULL)",
                self.coupons
            ),
            format!(
                "CREATE TABLE {} (id BIGINT PRIMARY KEY, user_id BIGINT NOT NULL, \
                 form VARCHAR(64) NOT NULL, amount BIGINT NOT NULL, status BIGINT NOT NULL, \
                 version BIGINT NOT NULL)",
                self.orders
            ),
            format!(
                "CREATE TABLE {} (order_id BIGINT NOT NULL, version BIGINT NOT NULL, status BIGINT NOT NULL)",
                self.order_events
            ),
            format!(
                "CREATE TABLE {} (payment VARCHAR(64) NOT NULL, order_id BIGINT NOT NULL, amount BIGINT NOT NULL)",
                self.payments
            ),
            format!(
                "CREATE TABLE {} (order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, \
                 qty BIGINT NOT NULL, outcome VARCHAR(32) NOT NULL)",
                self.stock_events
            ),
            format!(
                "CREATE TABLE {} (wire VARCHAR(64) PRIMARY KEY, from_account BIGINT NOT NULL, \
                 to_account VARCHAR(64) NOT NULL, amount BIGINT NOT NULL, \
                 status VARCHAR(32) NOT NULL, receipt VARCHAR(64) NOT NULL)",
                self.wires
            ),
            format!(
                "CREATE TABLE {} (bank_key VARCHAR(64) PRIMARY KEY, reference VARCHAR(64) NOT NULL, \
                 to_account VARCHAR(64) NOT NULL, amount BIGINT NOT NULL, receipt VARCHAR(64) NOT NULL)",
                self.bank_wires
            ),
        ];
        for stmt in &ddl {
            db.exec(stmt, &[]).await?;
        }
        // The switched-off guards' tables keep a plain index, so that their hand-written code
        // locks rows, not whole tables, on MySQL.
        let index = |unique: bool, name: &str, table: &str, column: &str| {
            let kind = if unique { "UNIQUE INDEX" } else { "INDEX" };
            format!("CREATE {kind} {table}_{name} ON {table} ({column})")
        };
        let mut indexes = vec![index(
            guards.on(Guard::Account),
            "user",
            &self.accounts,
            "user_id",
        )];
        if !guards.on(Guard::Ticket) {
            indexes.push(index(false, "ticket", &self.transfers, "ticket"));
        }
        if !guards.on(Guard::Stock) {
            indexes.push(index(false, "order_no", &self.deductions, "order_no"));
        }
        indexes.push(index(false, "form", &self.orders, "form"));
        indexes.push(index(false, "order", &self.order_events, "order_id"));
        indexes.push(index(false, "order", &self.payments, "order_id"));
        indexes.push(index(false, "order", &self.stock_events, "order_id"));
        indexes.push(index(false, "reference", &self.bank_wires, "reference"));
        for stmt in &indexes {
            db.exec(stmt, &[]).await?;
        }
        let mut tx = db.begin().await?;
        let insert_account = format!(
            "INSERT INTO {} (id, user_id, balance) VALUES (?, ?, ?)",
            self.accounts
        );
        tx.exec(&insert_account, &[MERCHANT.into(), 0.into(), 0.into()])
            .await?;
        for n in 1..=opening.customers {
            tx.exec(
                &insert_account,
                &[n.into(), n.into(), opening.balance.into()],
            )
            .await?;
        }
        for n in 1..=opening.skus {
            tx.exec(
                &format!("INSERT INTO {} (sku, avail) VALUES (?, ?)", self.stock),
                &[Scalar::Text(Opening::sku(n)), opening.stock.into()],
            )
            .await?;
        }
        for n in 1..=opening.coupons {
            tx.exec(
                &format!(
                    "INSERT INTO {} (coupon, status, order_no) VALUES (?, ?, '')",
                    self.coupons
                ),
                &[n.into(), coupon::AVAILABLE.into()],
            )
            .await?;
        }
        tx.commit().await
    }
}
