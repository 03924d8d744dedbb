//! The "order paid" events leg on a real RabbitMQ: with the inventory consumer killed and
//! restarted during the run, every event takes its stock once through `idem-mq`'s inbox
//! mode; without idem (commit, then ack) the audit catches the duplicates; with no broker
//! answering, the demo runs without the leg and says why.

#![allow(clippy::unwrap_used)]

use idem_testkit::services::{MYSQL, POSTGRES, RABBITMQ};
use shop_bank::{Demo, Guard, Guards, Report};

const CHECK: &str = "each paid event takes stock once";

fn demo(database: String, amqp: Option<String>, tag: &str) -> Demo {
    let mut demo = Demo::new();
    demo.database = Some(database);
    // Tables and a queue of their own, so that runs on one server or broker never meet.
    demo.prefix = format!("shop_e{}_{tag}_", std::process::id());
    demo.drop_after = true;
    demo.workload.operations = 800;
    demo.workload.seed = 11;
    demo.amqp = amqp;
    demo
}

async fn run(demo: &Demo) -> Report {
    let report = shop_bank::run(demo).await.unwrap();
    eprintln!(
        "events: {:?} {}\n{}{}",
        report.events.skipped,
        report.events.description,
        report.traffic,
        report.findings.table()
    );
    report
}

/// The leg ran, the consumer was killed, and the events check looked at every event.
fn assert_events_ran(report: &Report) {
    assert_eq!(report.events.skipped, None, "the events leg ran");
    assert!(report.events.published > 0, "events were published");
    assert!(report.events.kills > 0, "the consumer was killed");
    let line = report
        .findings
        .lines
        .iter()
        .find(|l| l.check == CHECK)
        .expect("the events check is in the audit");
    assert_eq!(
        u64::try_from(line.checked).unwrap(),
        report.events.published,
        "it checked every published event"
    );
}

/// The audit found nothing.
fn assert_audit_ok(report: &Report) {
    assert!(
        report.findings.ok(),
        "violations: {:#?}",
        report.findings.violations
    );
}

/// Runs the leg with the inventory consumer killed and restarted, on `db` (`None`: the
/// database is not there, and the test is skipped, as it is without a broker), and checks
/// that the leg ran and the audit found nothing.
async fn run_with_kills(db: Option<String>, tag: &str) -> Option<Report> {
    let (Some(db), Some(amqp)) = (db, RABBITMQ.url()) else {
        return None;
    };
    let report = run(&demo(db, Some(amqp), tag)).await;
    assert_events_ran(&report);
    assert_audit_ok(&report);
    Some(report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_paid_event_takes_stock_once_with_the_consumer_killed_on_postgres() {
    let Some(report) = run_with_kills(POSTGRES.url(), "pg").await else {
        return;
    };
    assert!(
        report.events.held_when_killed.unwrap() > 0,
        "some kills caught the consumer holding events"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_paid_event_takes_stock_once_with_the_consumer_killed_on_mariadb() {
    run_with_kills(MYSQL.url(), "my").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_without_idem_deducts_twice_and_the_audit_says_so() {
    let (Some(db), Some(amqp)) = (POSTGRES.url(), RABBITMQ.url()) else {
        return;
    };
    let mut d = demo(db, Some(amqp), "pgu");
    d.guards = Guards::all().without(Guard::Events);
    let report = run(&d).await;
    assert_events_ran(&report);
    // About one event in three is published twice; by hand, each copy takes stock.
    let twice: Vec<_> = report
        .findings
        .violations
        .iter()
        .filter(|v| v.check == CHECK && v.detail.contains("took its stock 2 times"))
        .collect();
    assert!(
        !twice.is_empty(),
        "the duplicates were not caught: {:#?}",
        report.findings.lines
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_no_broker_answering_the_demo_runs_without_the_events_leg() {
    let Some(db) = POSTGRES.url() else { return };
    // Nothing listens on port 1.
    let mut d = demo(db, Some("amqp://guest:guest@127.0.0.1:1/%2f".into()), "pgn");
    d.workload.operations = 200;
    let report = run(&d).await;
    let why = report.events.skipped.as_deref().unwrap_or_default();
    assert!(why.contains("no AMQP broker"), "skipped because: {why:?}");
    assert!(report.findings.lines.iter().all(|l| l.check != CHECK));
    assert_audit_ok(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_the_sqlite_default_the_events_leg_is_skipped_with_its_reason() {
    let mut d = Demo::new();
    d.workload.operations = 200;
    let report = run(&d).await;
    let why = report.events.skipped.as_deref().unwrap_or_default();
    assert!(why.contains("SQLite"), "skipped because: {why:?}");
    assert!(report.findings.ok());
}
