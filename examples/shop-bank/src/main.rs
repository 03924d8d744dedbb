//! `shop-bank`: runs the shop-and-bank demo and its chaos audit, or serves the shop.

// The report is the program's output.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use clap::Parser;
use shop_bank::{Demo, Guard, Guards, Rates};

/// The seeds' shop-and-bank scenarios under retries, timeouts, lost answers and double clicks,
/// audited at the end. The last line is `audit: OK` or `audit: FAILED (N violations)`.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// The shop's database: postgres://…, mysql://… or sqlite://PATH. By default a SQLite
    /// file in a temporary directory. Its tables are dropped and created afresh.
    #[arg(long, env = "SHOP_DATABASE")]
    database: Option<String>,
    /// The prefix of the shop's tables.
    #[arg(long, default_value = "shop_")]
    prefix: String,
    /// The seed of the clients' choices (which operations, which amounts, which trouble);
    /// timing still differs from run to run.
    #[arg(long, default_value_t = 1, conflicts_with = "random")]
    seed: u64,
    /// A longer run with a random seed (printed, to replay the same choices with --seed).
    #[arg(long)]
    random: bool,
    /// Clients at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    clients: u64,
    /// Operations in all (default 1500, or 20000 with --random).
    #[arg(long)]
    ops: Option<u64>,
    /// The RabbitMQ broker for the "order paid" events leg (PostgreSQL or MySQL only). With
    /// no broker answering, the demo runs without that leg and says so.
    #[arg(long, env = "SHOP_AMQP", default_value = shop_bank::DEFAULT_AMQP, value_name = "URL")]
    amqp: String,
    /// Run without the events leg.
    #[arg(long)]
    no_events: bool,
    /// Switch a guard off to watch the audit catch it: ticket, stock, coupon, token, account,
    /// payment, version, events or wire. Repeatable.
    #[arg(long = "unguard", value_name = "GUARD")]
    unguard: Vec<Guard>,
    /// No timeouts, lost answers, duplicates, double clicks or crashes.
    #[arg(long)]
    calm: bool,
    /// Serve the shop on this address with no chaos (Ctrl-C stops it) instead of running the
    /// audit.
    #[arg(long, value_name = "ADDR")]
    serve: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut guards = Guards::all();
    for g in &cli.unguard {
        guards = guards.without(*g);
    }
    if let Some(addr) = &cli.serve {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("shop-bank: cannot listen on {addr}: {e}");
                return ExitCode::from(2);
            }
        };
        eprintln!("shop-bank: serving on http://{addr} (Ctrl-C stops)");
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        return match shop_bank::serve(cli.database.as_deref(), &cli.prefix, guards, listener, stop)
            .await
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("shop-bank: {e}");
                ExitCode::from(2)
            }
        };
    }
    let mut demo = Demo::new();
    demo.database = cli.database.clone();
    demo.prefix = cli.prefix.clone();
    demo.guards = guards;
    demo.progress = true;
    demo.amqp = (!cli.no_events).then(|| cli.amqp.clone());
    let w = &mut demo.workload;
    w.clients = usize::try_from(cli.clients).unwrap_or(16);
    if cli.random {
        w.seed = rand::random();
    } else {
        w.seed = cli.seed;
    }
    w.operations = cli.ops.unwrap_or(if cli.random { 20_000 } else { 1_500 });
    if cli.calm {
        w.rates = Rates::calm();
    }
    let off: Vec<String> = demo.guards.off().map(|g| g.to_string()).collect();
    println!(
        "shop-bank: {} clients, {} operations, seed {}, database {}, guards off: {}",
        w.clients,
        w.operations,
        w.seed,
        demo.database
            .as_deref()
            .map_or("embedded SQLite".into(), idem::idem_store::redact),
        if off.is_empty() {
            "none".into()
        } else {
            off.join(", ")
        }
    );
    let report = match shop_bank::run(&demo).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("shop-bank: {e}");
            println!("audit: FAILED (could not run: {e})");
            return ExitCode::from(2);
        }
    };
    match &report.events.skipped {
        Some(why) => println!("events leg skipped: {why}"),
        None => println!("events leg: {}", report.events.description),
    }
    println!("\ntraffic ({:.1} s)", report.elapsed.as_secs_f64());
    print!("{}", report.traffic);
    println!("\naudit");
    print!("{}", report.findings.table());
    let violations = &report.findings.violations;
    for v in violations.iter().take(20) {
        println!("violation: {}: {}", v.check, v.detail);
    }
    if violations.len() > 20 {
        println!("… and {} more", violations.len() - 20);
    }
    if violations.is_empty() {
        println!("audit: OK");
        ExitCode::SUCCESS
    } else {
        println!("audit: FAILED ({} violations)", violations.len());
        ExitCode::from(1)
    }
}
