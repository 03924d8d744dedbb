//! The audit: the books read back from the database and held against the opening books and
//! against every answer the clients accepted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use idem_guard::Scalar;

use crate::chaos::{Ack, Journal};
use crate::db::{Db, DbError, Engine, int, text};
use crate::events::Ledger;
use crate::schema::{MERCHANT, Opening, Tables, coupon, order};

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The check that found it.
    pub check: &'static str,
    /// What is wrong.
    pub detail: String,
}

/// One check's line in the summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// The check.
    pub check: &'static str,
    /// What it looked at.
    pub checked: usize,
    /// How many violations it found.
    pub violations: usize,
}

/// The audit's findings.
#[derive(Debug, Clone, Default)]
pub struct Findings {
    /// One line per check, in order.
    pub lines: Vec<Line>,
    /// Every violation.
    pub violations: Vec<Violation>,
}

impl Findings {
    fn check(&mut self, check: &'static str, checked: usize, found: Vec<String>) {
        self.lines.push(Line {
            check,
            checked,
            violations: found.len(),
        });
        self.violations
            .extend(found.into_iter().map(|detail| Violation { check, detail }));
    }

    /// Whether any check failed.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// Whether `check` found something.
    pub fn failed(&self, check: &str) -> bool {
        self.violations.iter().any(|v| v.check == check)
    }

    /// The summary table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{:<44} {:>8} {:>10}", "check", "checked", "violations");
        for l in &self.lines {
            let _ = writeln!(out, "{:<44} {:>8} {:>10}", l.check, l.checked, l.violations);
        }
        out
    }
}

/// Keys that appear more than once.
fn repeated<K: Ord + Clone>(keys: impl IntoIterator<Item = K>) -> Vec<(K, usize)> {
    let mut counts = BTreeMap::new();
    for k in keys {
        *counts.entry(k).or_insert(0usize) += 1;
    }
    counts.into_iter().filter(|(_, n)| *n > 1).collect()
}

/// Audits the books in `db` against `opening` and the answers in `journal`, and, if the
/// events leg ran, the stock events against the events in `paid_events`.
pub async fn audit(
    db: &Db,
    t: &Tables,
    opening: &Opening,
    journal: &Journal,
    paid_events: Option<&Ledger>,
) -> Result<Findings, DbError> {
    // One transaction, one snapshot of the books (REPEATABLE READ on PostgreSQL; MySQL's
    // default; SQLite's own).
    let mut tx = db.begin_read().await?;
    if db.engine() == Engine::Postgres {
        tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", &[])
            .await?;
    }
    let tx = &mut tx;
    let accounts = tx
        .rows(
            &format!("SELECT id, user_id, balance FROM {}", t.accounts),
            &[],
        )
        .await?;
    let transfers = tx
        .rows(
            &format!(
                "SELECT ticket, from_account, to_account, amount, outcome FROM {}",
                t.transfers
            ),
            &[],
        )
        .await?;
    let stock = tx
        .rows(&format!("SELECT sku, avail FROM {}", t.stock), &[])
        .await?;
    let deductions = tx
        .rows(
            &format!("SELECT order_no, sku, qty, outcome FROM {}", t.deductions),
            &[],
        )
        .await?;
    let coupons = tx
        .rows(
            &format!("SELECT coupon, status, order_no FROM {}", t.coupons),
            &[],
        )
        .await?;
    let orders = tx
        .rows(
            &format!("SELECT id, form, amount, status, version FROM {}", t.orders),
            &[],
        )
        .await?;
    let events = tx
        .rows(
            &format!("SELECT order_id, version, status FROM {}", t.order_events),
            &[],
        )
        .await?;
    let payments = tx
        .rows(
            &format!("SELECT payment, order_id, amount FROM {}", t.payments),
            &[],
        )
        .await?;
    let stock_events = tx
        .rows(
            &format!("SELECT order_id, sku, qty, outcome FROM {}", t.stock_events),
            &[],
        )
        .await?;
    let acks = journal.acks();
    let mut f = Findings::default();

    // Money.
    let customers: Vec<&Vec<Scalar>> = accounts.iter().filter(|r| int(r, 0) != MERCHANT).collect();
    let total: i128 = customers.iter().map(|r| i128::from(int(r, 2))).sum();
    let mut found = Vec::new();
    if total != i128::from(opening.customer_money()) {
        found.push(format!(
            "customers hold {total} between them; they opened with {}",
            opening.customer_money()
        ));
    }
    f.check("money conserved by transfers", customers.len(), found);

    let found = accounts
        .iter()
        .filter(|r| int(r, 2) < 0)
        .map(|r| format!("account {} is overdrawn: {}", int(r, 0), int(r, 2)))
        .collect();
    f.check("no account overdrawn", accounts.len(), found);

    let found = repeated(transfers.iter().map(|r| int(r, 0)))
        .into_iter()
        .map(|(ticket, n)| format!("ticket {ticket} moved money {n} times"))
        .collect();
    f.check("each ticket transfers once", transfers.len(), found);

    let mut expected: HashMap<i64, i64> = HashMap::new();
    for n in 1..=opening.customers {
        expected.insert(n, opening.balance);
    }
    for r in transfers.iter().filter(|r| text(r, 4) == "done") {
        *expected.entry(int(r, 1)).or_default() -= int(r, 3);
        *expected.entry(int(r, 2)).or_default() += int(r, 3);
    }
    let found = customers
        .iter()
        .filter(|r| expected.get(&int(r, 0)).copied().unwrap_or(0) != int(r, 2))
        .map(|r| {
            format!(
                "account {} holds {}, its transfers say {}",
                int(r, 0),
                int(r, 2),
                expected.get(&int(r, 0)).copied().unwrap_or(0)
            )
        })
        .collect();
    f.check("balances match the transfers", customers.len(), found);

    let by_ticket: HashMap<i64, Vec<String>> = transfers.iter().fold(HashMap::new(), |mut m, r| {
        m.entry(int(r, 0)).or_default().push(text(r, 4));
        m
    });
    let mut checked = 0;
    let mut found = Vec::new();
    for ack in &acks {
        if let Ack::Transfer { ticket, outcome } = ack {
            checked += 1;
            if by_ticket
                .get(ticket)
                .is_none_or(|o| o.len() != 1 || &o[0] != outcome)
            {
                found.push(format!(
                    "ticket {ticket} was answered {outcome}; the books say {:?}",
                    by_ticket.get(ticket)
                ));
            }
        }
    }
    f.check("transfer answers match the books", checked, found);

    // Stock.
    let found = stock
        .iter()
        .filter(|r| int(r, 1) < 0)
        .map(|r| format!("{} has {} items", text(r, 0), int(r, 1)))
        .collect();
    f.check("stock never negative", stock.len(), found);

    let found = repeated(deductions.iter().map(|r| text(r, 0)))
        .into_iter()
        .map(|(order_no, n)| format!("order {order_no} was deducted {n} times"))
        .collect();
    f.check("each order deducted once", deductions.len(), found);

    let mut deducted: HashMap<String, i64> = HashMap::new();
    for r in deductions.iter().filter(|r| text(r, 3) == "deducted") {
        *deducted.entry(text(r, 1)).or_default() += int(r, 2);
    }
    // The inventory consumer's deductions, one per "order paid" event it handled.
    for r in stock_events.iter().filter(|r| text(r, 3) == "deducted") {
        *deducted.entry(text(r, 1)).or_default() += int(r, 2);
    }
    let found = stock
        .iter()
        .filter(|r| opening.stock - int(r, 1) != deducted.get(&text(r, 0)).copied().unwrap_or(0))
        .map(|r| {
            format!(
                "{} lost {} items; its deductions say {}",
                text(r, 0),
                opening.stock - int(r, 1),
                deducted.get(&text(r, 0)).copied().unwrap_or(0)
            )
        })
        .collect();
    f.check("stock matches the deductions", stock.len(), found);

    let by_order: HashMap<String, Vec<String>> =
        deductions.iter().fold(HashMap::new(), |mut m, r| {
            m.entry(text(r, 0)).or_default().push(text(r, 3));
            m
        });
    let mut checked = 0;
    let mut found = Vec::new();
    for ack in &acks {
        if let Ack::Deduction { order_no, outcome } = ack {
            checked += 1;
            if by_order
                .get(order_no)
                .is_none_or(|o| o.len() != 1 || &o[0] != outcome)
            {
                found.push(format!(
                    "order {order_no} was answered {outcome}; the books say {:?}",
                    by_order.get(order_no)
                ));
            }
        }
    }
    f.check("deduction answers match the books", checked, found);

    // Accounts.
    let found = repeated(accounts.iter().map(|r| int(r, 1)))
        .into_iter()
        .map(|(user, n)| format!("user {user} has {n} accounts"))
        .collect();
    f.check("one account per user", accounts.len(), found);

    let account_of: HashMap<i64, Vec<i64>> = accounts.iter().fold(HashMap::new(), |mut m, r| {
        m.entry(int(r, 1)).or_default().push(int(r, 0));
        m
    });
    let mut checked = 0;
    let mut found = Vec::new();
    for ack in &acks {
        if let Ack::Account { user, account } = ack {
            checked += 1;
            if account_of
                .get(user)
                .is_none_or(|a| a.as_slice() != [*account])
            {
                found.push(format!(
                    "user {user} was told account {account}; the books say {:?}",
                    account_of.get(user)
                ));
            }
        }
    }
    f.check("account answers match the books", checked, found);

    // Coupons.
    let coupon_row: HashMap<i64, (i64, String)> = coupons
        .iter()
        .map(|r| (int(r, 0), (int(r, 1), text(r, 2))))
        .collect();
    let mut told: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    let mut checked = 0;
    let mut found = Vec::new();
    for ack in &acks {
        match ack {
            Ack::CouponHeld {
                coupon: c,
                order_no,
            } => {
                checked += 1;
                told.entry(*c).or_default().insert(order_no.clone());
                let row = coupon_row.get(c);
                if row != Some(&(coupon::HELD, order_no.clone())) {
                    found.push(format!(
                        "order {order_no} was told it holds coupon {c}; the books say {row:?}"
                    ));
                }
            }
            Ack::CouponExpired { coupon: c } => {
                checked += 1;
                if coupon_row.get(c).map(|r| r.0) != Some(coupon::EXPIRED) {
                    found.push(format!("coupon {c} was said to be expired; it is not"));
                }
            }
            _ => {}
        }
    }
    for (c, holders) in &told {
        if holders.len() > 1 {
            found.push(format!(
                "coupon {c} was promised to {} orders",
                holders.len()
            ));
        }
    }
    f.check("each coupon held by at most one order", checked, found);

    // Orders and forms.
    let found = repeated(orders.iter().map(|r| text(r, 1)))
        .into_iter()
        .map(|(form, n)| format!("form {form} created {n} orders"))
        .collect();
    f.check("one order per form", orders.len(), found);

    let order_row: HashMap<i64, (String, i64, i64, i64)> = orders
        .iter()
        .map(|r| (int(r, 0), (text(r, 1), int(r, 2), int(r, 3), int(r, 4))))
        .collect();
    let mut checked = 0;
    let mut found = Vec::new();
    for ack in &acks {
        if let Ack::Order { order: o, form } = ack {
            checked += 1;
            if order_row.get(o).is_none_or(|r| &r.0 != form) {
                found.push(format!(
                    "order {o} of form {form} was created; it is not in the books"
                ));
            }
        }
    }
    f.check("order answers match the books", checked, found);

    // Payments.
    let paid_total: i128 = orders
        .iter()
        .filter(|r| matches!(int(r, 3), order::PAID | order::SHIPPED))
        .map(|r| i128::from(int(r, 2)))
        .sum();
    let merchant = accounts
        .iter()
        .find(|r| int(r, 0) == MERCHANT)
        .map_or(0, |r| int(r, 2));
    let mut found = Vec::new();
    if i128::from(merchant) != paid_total {
        found.push(format!(
            "the merchant holds {merchant}; its paid and shipped orders come to {paid_total}"
        ));
    }
    for (o, n) in repeated(payments.iter().map(|r| int(r, 1))) {
        found.push(format!("order {o} was credited {n} times"));
    }
    for r in &payments {
        if order_row.get(&int(r, 1)).map(|o| o.2) == Some(order::CANCELLED) {
            found.push(format!("cancelled order {} was credited", int(r, 1)));
        }
    }
    let mut checked = payments.len();
    for ack in &acks {
        if let Ack::Paid { order: o, payment } = ack {
            checked += 1;
            let paid = order_row
                .get(o)
                .is_some_and(|r| matches!(r.2, order::PAID | order::SHIPPED));
            let by = payments
                .iter()
                .any(|r| int(r, 1) == *o && &text(r, 0) == payment);
            if !paid || !by {
                found.push(format!(
                    "order {o} was said to be paid by {payment}; the books disagree"
                ));
            }
        }
    }
    f.check("each payment credited once", checked, found);

    // "Order paid" events.
    if let Some(ledger) = paid_events {
        let published = ledger.published();
        let unconfirmed = ledger.unconfirmed();
        let mut effects: BTreeMap<i64, usize> = BTreeMap::new();
        for r in &stock_events {
            *effects.entry(int(r, 0)).or_default() += 1;
        }
        let mut found = Vec::new();
        for o in &published {
            match effects.get(o).copied().unwrap_or(0) {
                1 => {}
                0 => found.push(format!("order {o}'s paid event never took its stock")),
                n => found.push(format!("order {o}'s paid event took its stock {n} times")),
            }
            if order_row
                .get(o)
                .is_none_or(|r| !matches!(r.2, order::PAID | order::SHIPPED))
            {
                found.push(format!(
                    "order {o}'s paid event was published; it is not paid"
                ));
            }
        }
        for (o, n) in &effects {
            if published.contains(o) {
                continue;
            }
            if !unconfirmed.contains(o) {
                found.push(format!(
                    "order {o}'s stock was taken {n} times; no event was published for it"
                ));
            } else if *n > 1 {
                found.push(format!("order {o}'s paid event took its stock {n} times"));
            }
        }
        f.check(
            "each paid event takes stock once",
            published.len() + unconfirmed.len(),
            found,
        );
    }

    // Versions.
    let mut history: HashMap<i64, Vec<(i64, i64)>> = HashMap::new();
    for r in &events {
        history
            .entry(int(r, 0))
            .or_default()
            .push((int(r, 1), int(r, 2)));
    }
    let mut found = Vec::new();
    for (o, (_, _, status, version)) in &order_row {
        let mut h = history.get(o).cloned().unwrap_or_default();
        h.sort_unstable();
        let versions: Vec<i64> = h.iter().map(|e| e.0).collect();
        let want: Vec<i64> = (1..=*version).collect();
        if versions != want {
            found.push(format!(
                "order {o} is at version {version}; its changes were made at versions {versions:?}"
            ));
        } else if h.last().map(|e| e.1) != Some(*status) {
            found.push(format!(
                "order {o} is {}, not what its last change made it",
                order::name(*status)
            ));
        }
    }
    let mut checked = order_row.len();
    for ack in &acks {
        if let Ack::Version {
            order: o,
            version,
            status,
        } = ack
        {
            checked += 1;
            let seen = history.get(o).is_some_and(|h| {
                h.iter()
                    .any(|e| e.0 == *version && order::name(e.1) == status)
            });
            if !seen {
                found.push(format!(
                    "order {o} was said to be {status} at version {version}; no such change"
                ));
            }
        }
    }
    f.check("no lost order updates", checked, found);

    let differing = journal.differing();
    let replays = journal
        .counters
        .replays
        .load(std::sync::atomic::Ordering::Relaxed);
    f.check(
        "every retry got the first answer",
        usize::try_from(replays).unwrap_or(usize::MAX),
        differing,
    );
    Ok(f)
}
