//! The audit: the books read back from the database and held against the opening books and
//! against every answer the clients accepted. The wires to the other bank have their checks
//! in `wires.rs`.

mod wires;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::{Display, Write as _};
use std::hash::Hash;

use idem_guard::Scalar;

use crate::chaos::{Ack, Journal};
use crate::db::{Db, DbError, Engine, Tx, int, text};
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

    /// A check of every row: `wrong` says what is wrong with one, if anything.
    fn each_row<R: AsRef<[Scalar]>>(
        &mut self,
        check: &'static str,
        rows: &[R],
        wrong: impl Fn(&[Scalar]) -> Option<String>,
    ) {
        let found = rows.iter().filter_map(|r| wrong(r.as_ref())).collect();
        self.check(check, rows.len(), found);
    }

    /// A check that no two rows share a `key`: `say` says what a key found `n` times means.
    fn unique<K: Ord + Clone>(
        &mut self,
        check: &'static str,
        rows: &[Vec<Scalar>],
        key: impl Fn(&[Scalar]) -> K,
        say: impl Fn(K, usize) -> String,
    ) {
        let found = repeated(rows.iter().map(|r| key(r)))
            .into_iter()
            .map(|(k, n)| say(k, n))
            .collect();
        self.check(check, rows.len(), found);
    }

    /// Holds each of `answers` against the books: `wrong` says what is wrong with one, if
    /// anything.
    fn check_answers<T>(
        &mut self,
        check: &'static str,
        answers: impl Iterator<Item = T>,
        wrong: impl Fn(&T) -> Option<String>,
    ) {
        let answers: Vec<T> = answers.collect();
        let found = answers.iter().filter_map(wrong).collect();
        self.check(check, answers.len(), found);
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

/// The rows grouped by `key`, each key's `value`s in the rows' order.
fn group<K: Eq + Hash, V>(
    rows: &[Vec<Scalar>],
    key: impl Fn(&[Scalar]) -> K,
    value: impl Fn(&[Scalar]) -> V,
) -> HashMap<K, Vec<V>> {
    let mut groups: HashMap<K, Vec<V>> = HashMap::new();
    for r in rows {
        groups.entry(key(r)).or_default().push(value(r));
    }
    groups
}

/// Holds each answer, a key and the outcome it was answered, against the outcomes the books
/// hold for the key: exactly that one. What was checked, and what was wrong.
fn one_outcome_each<'a, K: Eq + Hash + Display + 'a>(
    noun: &str,
    books: &HashMap<K, Vec<String>>,
    answers: impl Iterator<Item = (&'a K, &'a String)>,
) -> (usize, Vec<String>) {
    let mut checked = 0;
    let mut found = Vec::new();
    for (key, outcome) in answers {
        checked += 1;
        let held = books.get(key);
        if held.is_none_or(|o| o.len() != 1 || &o[0] != outcome) {
            found.push(format!(
                "{noun} {key} was answered {outcome}; the books say {held:?}"
            ));
        }
    }
    (checked, found)
}

/// Every row of `table`, with its `columns` in that order.
async fn all(tx: &mut Tx, columns: &str, table: &str) -> Result<Vec<Vec<Scalar>>, DbError> {
    tx.rows(&format!("SELECT {columns} FROM {table}"), &[])
        .await
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
    let accounts = all(tx, "id, user_id, balance", &t.accounts).await?;
    let transfers = all(
        tx,
        "ticket, from_account, to_account, amount, outcome",
        &t.transfers,
    )
    .await?;
    let stock = all(tx, "sku, avail", &t.stock).await?;
    let deductions = all(tx, "order_no, sku, qty, outcome", &t.deductions).await?;
    let coupons = all(tx, "coupon, status, order_no", &t.coupons).await?;
    let orders = all(tx, "id, form, amount, status, version", &t.orders).await?;
    let events = all(tx, "order_id, version, status", &t.order_events).await?;
    let payments = all(tx, "payment, order_id, amount", &t.payments).await?;
    let stock_events = all(tx, "order_id, sku, qty, outcome", &t.stock_events).await?;
    let wire_rows = all(tx, wires::WIRE_COLUMNS, &t.wires).await?;
    let bank_rows = all(tx, wires::BANK_COLUMNS, &t.bank_wires).await?;
    let acks = journal.acks();
    let mut f = Findings::default();

    // Money.
    let customers: Vec<&Vec<Scalar>> = accounts.iter().filter(|r| int(r, 0) != MERCHANT).collect();
    let total: i128 = customers.iter().map(|r| i128::from(int(r, 2))).sum();
    let wired = wires::debited(&wire_rows);
    let wired_out: i128 = wired.iter().map(|(_, amount)| i128::from(*amount)).sum();
    let mut found = Vec::new();
    if total + wired_out != i128::from(opening.customer_money()) {
        found.push(format!(
            "customers hold {total} between them and wired {wired_out} away; they opened with {}",
            opening.customer_money()
        ));
    }
    f.check("money conserved by transfers", customers.len(), found);

    f.each_row("no account overdrawn", &accounts, |r| {
        (int(r, 2) < 0).then(|| format!("account {} is overdrawn: {}", int(r, 0), int(r, 2)))
    });

    f.unique(
        "each ticket transfers once",
        &transfers,
        |r| int(r, 0),
        |ticket, n| format!("ticket {ticket} moved money {n} times"),
    );

    let mut expected: HashMap<i64, i64> = HashMap::new();
    for n in 1..=opening.customers {
        expected.insert(n, opening.balance);
    }
    for r in transfers.iter().filter(|r| text(r, 4) == "done") {
        *expected.entry(int(r, 1)).or_default() -= int(r, 3);
        *expected.entry(int(r, 2)).or_default() += int(r, 3);
    }
    for (from, amount) in &wired {
        *expected.entry(*from).or_default() -= amount;
    }
    f.each_row("balances match the transfers", &customers, |r| {
        let said = expected.get(&int(r, 0)).copied().unwrap_or(0);
        (said != int(r, 2)).then(|| {
            let (account, holds) = (int(r, 0), int(r, 2));
            format!("account {account} holds {holds}, its transfers say {said}")
        })
    });

    let answers = acks.iter().filter_map(|a| match a {
        Ack::Transfer { ticket, outcome } => Some((ticket, outcome)),
        _ => None,
    });
    let by_ticket = group(&transfers, |r| int(r, 0), |r| text(r, 4));
    let (checked, found) = one_outcome_each("ticket", &by_ticket, answers);
    f.check("transfer answers match the books", checked, found);

    // Stock.
    f.each_row("stock never negative", &stock, |r| {
        (int(r, 1) < 0).then(|| format!("{} has {} items", text(r, 0), int(r, 1)))
    });

    f.unique(
        "each order deducted once",
        &deductions,
        |r| text(r, 0),
        |order_no, n| format!("order {order_no} was deducted {n} times"),
    );

    let mut deducted: HashMap<String, i64> = HashMap::new();
    for r in deductions.iter().filter(|r| text(r, 3) == "deducted") {
        *deducted.entry(text(r, 1)).or_default() += int(r, 2);
    }
    // The inventory consumer's deductions, one per "order paid" event it handled.
    for r in stock_events.iter().filter(|r| text(r, 3) == "deducted") {
        *deducted.entry(text(r, 1)).or_default() += int(r, 2);
    }
    f.each_row("stock matches the deductions", &stock, |r| {
        let lost = opening.stock - int(r, 1);
        let said = deducted.get(&text(r, 0)).copied().unwrap_or(0);
        (lost != said).then(|| {
            format!(
                "{} lost {lost} items; its deductions say {said}",
                text(r, 0)
            )
        })
    });

    let answers = acks.iter().filter_map(|a| match a {
        Ack::Deduction { order_no, outcome } => Some((order_no, outcome)),
        _ => None,
    });
    let by_order = group(&deductions, |r| text(r, 0), |r| text(r, 3));
    let (checked, found) = one_outcome_each("order", &by_order, answers);
    f.check("deduction answers match the books", checked, found);

    // Accounts.
    f.unique(
        "one account per user",
        &accounts,
        |r| int(r, 1),
        |user, n| format!("user {user} has {n} accounts"),
    );

    let account_of = group(&accounts, |r| int(r, 1), |r| int(r, 0));
    let answers = acks.iter().filter_map(|a| match a {
        Ack::Account { user, account } => Some((user, account)),
        _ => None,
    });
    f.check_answers(
        "account answers match the books",
        answers,
        |(user, account)| {
            let books = account_of.get(*user);
            books
                .is_none_or(|a| a.as_slice() != [**account])
                .then(|| format!("user {user} was told account {account}; the books say {books:?}"))
        },
    );

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
    f.unique(
        "one order per form",
        &orders,
        |r| text(r, 1),
        |form, n| format!("form {form} created {n} orders"),
    );

    let order_row: HashMap<i64, (String, i64, i64, i64)> = orders
        .iter()
        .map(|r| (int(r, 0), (text(r, 1), int(r, 2), int(r, 3), int(r, 4))))
        .collect();
    let answers = acks.iter().filter_map(|a| match a {
        Ack::Order { order, form } => Some((order, form)),
        _ => None,
    });
    f.check_answers("order answers match the books", answers, |(o, form)| {
        order_row
            .get(*o)
            .is_none_or(|r| &r.0 != *form)
            .then(|| format!("order {o} of form {form} was created; it is not in the books"))
    });

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

    wires::check(&mut f, &wire_rows, &bank_rows, &acks);

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
