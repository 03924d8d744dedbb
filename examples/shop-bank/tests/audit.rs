//! The chaos audit: it passes with every guard on, on SQLite, PostgreSQL and MariaDB, and it
//! fails when any one guard is switched off, so it is known to catch what it claims to.

#![allow(clippy::unwrap_used)]

use idem_testkit::services::{MYSQL, POSTGRES};
use shop_bank::{Demo, Findings, Guard, Guards};

fn demo(database: Option<String>, operations: u64) -> Demo {
    let mut demo = Demo::new();
    // Tables of their own, so that runs on one server never meet.
    let engine = database
        .as_deref()
        .and_then(|u| u.split_once("://"))
        .map_or("sqlite", |(scheme, _)| scheme);
    demo.prefix = format!("shop_t{}_{engine}_", std::process::id());
    demo.database = database;
    // The events leg has tests of its own (tests/events.rs).
    demo.amqp = None;
    demo.drop_after = true;
    demo.workload.operations = operations;
    demo.workload.seed = 7;
    demo
}

async fn audit(demo: &Demo) -> Findings {
    let report = shop_bank::run(demo).await.unwrap();
    eprintln!("{}{}", report.traffic, report.findings.table());
    report.findings
}

fn assert_clean(f: &Findings) {
    assert!(f.ok(), "violations: {:#?}", f.violations);
    // The audit looked at something: every check saw rows or answers.
    for line in &f.lines {
        assert!(line.checked > 0, "{} checked nothing", line.check);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_books_balance_under_chaos_on_sqlite() {
    assert_clean(&audit(&demo(None, 800)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_books_balance_under_chaos_on_postgres() {
    let Some(url) = POSTGRES.url() else { return };
    assert_clean(&audit(&demo(Some(url), 800)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_books_balance_under_chaos_on_mariadb() {
    let Some(url) = MYSQL.url() else { return };
    assert_clean(&audit(&demo(Some(url), 800)).await);
}

/// Which check must fail when a guard is off.
fn caught_by(guard: Guard) -> &'static str {
    match guard {
        Guard::Ticket => "each ticket transfers once",
        Guard::Stock => "each order deducted once",
        Guard::Coupon => "each coupon held by at most one order",
        Guard::Token => "one order per form",
        Guard::Account => "one account per user",
        Guard::Payment => "each payment credited once",
        Guard::Version => "no lost order updates",
        Guard::Events => "each paid event takes stock once",
        Guard::Wire => "each wire reaches the bank once",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switching_off_any_guard_fails_the_audit() {
    // The events leg needs a server database and a broker: tests/events.rs switches its guard
    // off.
    for guard in Guard::ALL.into_iter().filter(|g| *g != Guard::Events) {
        let mut d = demo(None, 500);
        d.guards = Guards::all().without(guard);
        // More double clicks than the default, so that every unguarded path is hit.
        d.workload.rates.double_click = 0.4;
        if guard == Guard::Wire {
            // A wire is sent twice only after a stop between the bank call and its recording
            // (or a bank timeout): more stops, so that a run of 500 operations surely has some.
            d.workload.rates.crash = 0.15;
        }
        let f = audit(&d).await;
        assert!(
            f.failed(caught_by(guard)),
            "with the {guard} guard off, {:?} found nothing: {:#?}",
            caught_by(guard),
            f.lines
        );
    }
}
