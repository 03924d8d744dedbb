//! The `idem` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

/// mimalloc rather than the system's allocator: a guarded request allocates many small,
/// short-lived objects (headers, the canonical JSON of its body, the stored answer), and
/// glibc's malloc spent about a third of the gateway thread's time on them when replaying
/// (`unlink_chunk`, `malloc_consolidate`); with mimalloc, replays through the gateway went
/// from 0.44-0.62x to 0.75-0.84x of calling the upstream directly (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// idem: make every write safe to retry.
///
/// idem keeps one idempotency record per key: the first attempt claims it, runs the work and
/// stores the answer; every retry gets that answer back instead of running the work again.
#[derive(Parser)]
#[command(name = "idem", version, propagate_version = true)]
struct Cli {
    /// How log lines are written to standard error: text, or json (one object a line).
    #[arg(long, global = true, env = "IDEM_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the JSON API (records, ids, one-time tokens, locks, health) over HTTP.
    ///
    /// Services in any language claim a key with POST /v1/records/begin, run their work, and
    /// store its answer with /v1/records/complete (or give the key back with /release).
    /// See docs/guide/serve.md for the endpoints and examples.
    Serve(cli::serve::ServeArgs),

    /// Run a reverse proxy that makes an existing HTTP API safe to retry.
    ///
    /// Forwards every request to --upstream. POST and PATCH requests that carry an
    /// Idempotency-Key run once: retries get the first answer (with Idempotent-Replayed:
    /// true) without reaching the upstream. Routes, presets and limits go in --config (TOML).
    /// The gateway's own /health, /metrics and record tools live under --admin-prefix (/_idem).
    Gateway(cli::gateway::GatewayArgs),

    /// Create or upgrade a store's schema, then exit.
    ///
    /// `idem serve` and `idem gateway` do this on start too; run it on its own to apply the
    /// schema as a database user that may change it, and run the services as one that may
    /// only read and write rows. Stores without a schema (memory, Redis) need nothing.
    Migrate(cli::MigrateArgs),

    /// Feed a queue's messages to an HTTP service, once each.
    ///
    /// Consumes a RabbitMQ queue (--from amqp://… --queue NAME) or a durable JetStream
    /// consumer (--from nats://… --stream NAME --consumer NAME) and POSTs each message's body
    /// to --to with Idempotency-Key set to the message's key (its message id, or
    /// --key-header, or --key-json). Answers are recorded in --store and the message acked;
    /// 5xx and network errors are retried with backoff and dead-lettered after
    /// --max-attempts. With `idem gateway` in front of the target, each message runs once
    /// even when the relay is killed mid-call.
    Relay(cli::relay::RelayArgs),

    /// Print new ids, one per line.
    ///
    /// uuid7 (the default) and token need nothing; snowflake leases a worker id from --store
    /// for as long as it runs, so it never repeats an id another process issues in the same
    /// id space; segment takes a range of the sequence --tag from --store.
    Id(cli::id::IdArgs),

    /// See and repair the records a store holds, with no server running.
    ///
    /// `list` and `counts` show records by scope, namespace, state (in_progress, stuck,
    /// completed, released, expired, unknown) and age; `show` one record with its answer;
    /// `reopen` lets an unknown outcome run again, `release` gives back the keys of attempts
    /// that are gone, `delete` forgets records. A repair shows what it will touch, asks, and
    /// changes only records still as they were shown.
    Records(cli::records::RecordsArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    if cli.log_format == "json" {
        logs.json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
        .and_then(|runtime| {
            runtime.block_on(async {
                match cli.command {
                    Command::Serve(args) => cli::serve::serve(&args).await,
                    Command::Gateway(args) => cli::gateway::gateway(args).await,
                    Command::Migrate(args) => cli::migrate(&args).await,
                    Command::Relay(args) => cli::relay::relay(args).await,
                    Command::Id(args) => cli::id::print_ids(&args).await,
                    Command::Records(args) => cli::records::records(args).await,
                }
            })
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("idem: error: {message}");
            ExitCode::FAILURE
        }
    }
}
