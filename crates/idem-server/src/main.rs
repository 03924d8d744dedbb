//! The `idem` command.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[path = "cli/records.rs"]
mod records_cli;
use idem::purge::purge_loop_reporting;
use idem_core::{Clock, SharedStore, SystemClock};
use idem_server::auth::Auth;
use idem_server::gateway::{FileConfig, Gateway, Upstream};
use idem_server::listener::{self, Limits};
use idem_server::metered::Metered;
use idem_server::{AppState, DEFAULT_MAX_BODY, router};
use idem_store::StoreUrl;
use tracing::{info, warn};

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
    /// See the README for the endpoints and examples.
    Serve(ServeArgs),

    /// Run a reverse proxy that makes an existing HTTP API safe to retry.
    ///
    /// Forwards every request to --upstream. POST and PATCH requests that carry an
    /// Idempotency-Key run once: retries get the first answer (with Idempotent-Replayed:
    /// true) without reaching the upstream. Routes, presets and limits go in --config (TOML).
    /// The gateway's own /health, /metrics and record tools live under --admin-prefix (/_idem).
    Gateway(GatewayArgs),

    /// Create or upgrade a store's schema, then exit.
    ///
    /// `idem serve` and `idem gateway` do this on start too; run it on its own to apply the
    /// schema as a database user that may change it, and run the services as one that may
    /// only read and write rows. Stores without a schema (memory, Redis) need nothing.
    Migrate(MigrateArgs),

    /// Feed a queue's messages to an HTTP service, once each.
    ///
    /// Consumes a RabbitMQ queue (--from amqp://… --queue NAME) or a durable JetStream
    /// consumer (--from nats://… --stream NAME --consumer NAME) and POSTs each message's body
    /// to --to with Idempotency-Key set to the message's key (its message id, or
    /// --key-header, or --key-json). Answers are recorded in --store and the message acked;
    /// 5xx and network errors are retried with backoff and dead-lettered after
    /// --max-attempts. With `idem gateway` in front of the target, each message runs once
    /// even when the relay is killed mid-call.
    Relay(RelayArgs),

    /// Print new ids, one per line.
    ///
    /// uuid7 (the default) and token need nothing; snowflake leases a worker id from --store
    /// for as long as it runs, so it never repeats an id another process issues in the same
    /// id space; segment takes a range of the sequence --tag from --store.
    Id(IdArgs),

    /// See and repair the records a store holds, with no server running.
    ///
    /// `list` and `counts` show records by scope, namespace, state (in_progress, stuck,
    /// completed, released, expired, unknown) and age; `show` one record with its answer;
    /// `reopen` lets an unknown outcome run again, `release` gives back the keys of attempts
    /// that are gone, `delete` forgets records. A repair shows what it will touch, asks, and
    /// changes only records still as they were shown.
    Records(RecordsArgs),
}

#[derive(clap::Args)]
struct RecordsArgs {
    /// The store: sqlite://PATH, memory://, postgres://…, mysql://…, redis://…
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,

    #[command(subcommand)]
    command: records_cli::RecordsCommand,
}

#[derive(clap::Args)]
struct RelayArgs {
    /// The broker: amqp://user:password@host:5672/vhost (RabbitMQ) or nats://host:4222.
    #[arg(long, env = "IDEM_RELAY_FROM", value_name = "URL")]
    from: String,

    /// The queue to consume (RabbitMQ). Declared if missing, with a dead-letter queue
    /// NAME.dead beside it.
    #[arg(long, env = "IDEM_RELAY_QUEUE", value_name = "NAME")]
    queue: Option<String>,

    /// The stream to consume (NATS JetStream). Dead letters are copied to the subject
    /// STREAM.dead, which a stream must store (the relay checks at start).
    #[arg(long, env = "IDEM_RELAY_STREAM", value_name = "NAME")]
    stream: Option<String>,

    /// The durable JetStream consumer (created if missing) [default: idem-relay].
    #[arg(long, env = "IDEM_RELAY_CONSUMER", value_name = "NAME")]
    consumer: Option<String>,

    /// Only the stream's messages on this subject (wildcards allowed), for a JetStream
    /// consumer the relay creates.
    #[arg(long, env = "IDEM_RELAY_SUBJECT", value_name = "SUBJECT")]
    subject: Option<String>,

    /// Where each message is POSTed: an http:// URL.
    #[arg(long, env = "IDEM_RELAY_TO", value_name = "URL")]
    to: String,

    /// Where the relay records which messages got an answer: sqlite://PATH (the embedded
    /// default), postgres://…, mysql://…, redis://… (see the README's stores).
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem-relay.db")]
    store: String,

    /// Take the key from this message header instead of the message id.
    #[arg(long, value_name = "NAME", conflicts_with = "key_json")]
    key_header: Option<String>,

    /// Take the key from this JSON pointer into the payload (e.g. /order/id).
    #[arg(long, value_name = "POINTER")]
    key_json: Option<String>,

    /// The records' namespace [default: the queue's name, or STREAM.CONSUMER].
    #[arg(long)]
    namespace: Option<String>,

    /// The Content-Type of each POST.
    #[arg(long, default_value = "application/json")]
    content_type: String,

    /// An extra header on each POST, as "Name: value" (repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE")]
    headers: Vec<String>,

    /// How long a POST may take, answer included.
    #[arg(long, default_value = "30s", value_parser = parse_upstream_timeout)]
    timeout: Duration,

    /// POSTs of a message (failed in a retryable way, or cut off by a relay that died) before
    /// it is dead-lettered.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_attempts: u32,

    /// Messages in flight at once (the broker's prefetch, and POSTs at once).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,

    /// How long a message's key is held for a relay that stops answering (killed, cut off)
    /// before another may POST it again; renewed while a POST runs.
    #[arg(long, default_value = "60s", value_parser = parse_lease)]
    lease: Duration,

    /// How long an answer is remembered; a message redelivered later is POSTed again.
    #[arg(long, default_value = "24h", value_parser = parse_ttl)]
    ttl: Duration,

    /// Dead-letter messages the target refuses with a 4xx, instead of recording and acking
    /// them.
    #[arg(long)]
    dead_letter_4xx: bool,

    /// Serve /metrics (Prometheus text) and /healthz on this address.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,

    /// How often to log a status line with the counts (when they changed).
    #[arg(long, default_value = "30s", value_parser = parse_purge_interval)]
    status_every: Duration,
}

#[derive(clap::Args)]
struct IdArgs {
    /// What to print: uuid7, snowflake, segment (with --tag) or token (128 random bits in
    /// hex).
    #[arg(long, default_value = "uuid7", value_parser = ["uuid7", "snowflake", "segment", "token"])]
    kind: String,

    /// The segment sequence to take ids from (--kind segment). The command line's sequences
    /// are its own: `idem serve` keeps each caller's apart from them.
    #[arg(long, required_if_eq("kind", "segment"))]
    tag: Option<String>,

    /// How many (1 to 1,000,000).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    count: u32,

    /// The store Snowflake worker ids are leased from and segment sequences live in.
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,

    /// The Snowflake id space.
    #[arg(long, env = "IDEM_ID_SPACE", default_value = "default")]
    id_space: String,
}

#[derive(clap::Args)]
struct MigrateArgs {
    /// The store, as for serve: sqlite://PATH, postgres://…, mysql://…, redis://…
    #[arg(long, env = "IDEM_STORE")]
    store: String,
}

#[derive(clap::Args)]
struct GatewayArgs {
    /// The API to protect: an http:// URL, optionally with a base path.
    #[arg(long, env = "IDEM_UPSTREAM")]
    upstream: Option<String>,

    /// The address to listen on [default: 127.0.0.1:7080].
    #[arg(long, env = "IDEM_GATEWAY_LISTEN")]
    listen: Option<SocketAddr>,

    /// Where records live: sqlite://PATH, memory://, postgres://…, mysql://…, redis://… or
    /// redis+cluster://… (see the README) [default: sqlite://idem.db].
    #[arg(long, env = "IDEM_STORE")]
    store: Option<String>,

    /// A TOML file of gateway settings and per-route policies (see the README).
    #[arg(long, env = "IDEM_GATEWAY_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,

    /// The reserved path prefix of the gateway's own endpoints [default: /_idem].
    #[arg(long, env = "IDEM_ADMIN_PREFIX")]
    admin_prefix: Option<String>,

    /// A file holding the operator's token for the record tools under the admin prefix
    /// (inspect, reopen an unknown outcome); without it they are disabled.
    #[arg(long, env = "IDEM_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,

    /// How long to wait for the upstream's answer (at most 1h) [default: 30s].
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", value_parser = parse_upstream_timeout)]
    upstream_timeout: Option<Duration>,

    /// How often expired records are purged (at most 24h) [default: 60s].
    #[arg(long, env = "IDEM_PURGE_INTERVAL", value_parser = parse_purge_interval)]
    purge_interval: Option<Duration>,

    #[command(flatten)]
    limits: LimitArgs,

    #[command(flatten)]
    replay_cache: ReplayCacheArgs,
}

/// The replay cache, shared by serve and gateway: completed records answered from memory.
#[derive(clap::Args)]
struct ReplayCacheArgs {
    /// How many completed answers to keep in memory, so that their replays skip the store; 0
    /// turns the cache off.
    #[arg(long, env = "IDEM_REPLAY_CACHE_ENTRIES", default_value_t = 10_000)]
    replay_cache_entries: usize,

    /// How many bytes of answers (and keys) the replay cache keeps at most.
    #[arg(long, env = "IDEM_REPLAY_CACHE_BYTES", default_value_t = 32 << 20)]
    replay_cache_bytes: usize,

    /// How long an answer stays in the replay cache at most (even if its record lives
    /// longer): the longest another instance, or `idem records`, may take to see its repair
    /// of a completed record here (at most 1h).
    #[arg(long, env = "IDEM_REPLAY_CACHE_MAX_AGE", default_value = "60s", value_parser = parse_cache_age)]
    replay_cache_max_age: Duration,
}

impl ReplayCacheArgs {
    /// `store` behind the replay cache, unless it is off; `skip` keeps answers out of it.
    fn wrap(&self, store: SharedStore, skip: Option<fn(&[u8]) -> bool>) -> SharedStore {
        if self.replay_cache_entries == 0 {
            return store;
        }
        let limits = idem_store::ReplayCacheLimits {
            entries: self.replay_cache_entries,
            bytes: self.replay_cache_bytes,
            max_age: self.replay_cache_max_age,
        };
        let mut cache = idem_store::ReplayCache::new(store, limits);
        if let Some(skip) = skip {
            cache = cache.skip(skip);
        }
        tokio::spawn(idem_server::metrics::watch_replay_cache(cache.clone()));
        Arc::new(cache)
    }
}

fn parse_cache_age(s: &str) -> Result<Duration, String> {
    parse_bounded(s, Duration::from_secs(60 * 60))
}

/// Connection limits, shared by serve and gateway (which also reads them from its file).
#[derive(clap::Args)]
struct LimitArgs {
    /// How long a request's head may take to arrive, from the connection's accept or the
    /// first byte of a later request (at most 5m) [default: 10s].
    #[arg(long, env = "IDEM_HEADER_TIMEOUT", value_parser = parse_header_timeout)]
    header_timeout: Option<Duration>,

    /// How long a keep-alive connection may wait for its next request (at most 1h)
    /// [default: 60s].
    #[arg(long, env = "IDEM_IDLE_TIMEOUT", value_parser = parse_idle_or_body_timeout)]
    idle_timeout: Option<Duration>,

    /// How long a request's body may take to arrive, from its head; a slower one is answered
    /// 408 body_timeout (at most 1h) [default: 30s].
    #[arg(long, env = "IDEM_BODY_TIMEOUT", value_parser = parse_idle_or_body_timeout)]
    body_timeout: Option<Duration>,

    /// How many connections are served at once; past it, new connections get only the
    /// health check, anything else 503 overloaded (1 to 1,000,000) [default: the smaller of
    /// 10,000 and three quarters of the open-file limit].
    #[arg(long, env = "IDEM_MAX_CONNECTIONS", value_parser = parse_max_connections)]
    max_connections: Option<usize>,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Where records live: sqlite://PATH (the embedded default), memory://, postgres://…,
    /// mysql://…, redis://… or redis+cluster://host:port,host:port (see the README).
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,

    /// The address to listen on.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,

    /// A file of API keys, one `SCOPE API_KEY` pair per line. Each caller's records live in
    /// its key's scope. Without keys all callers share one scope, and only a loopback
    /// address may be used unless --allow-anonymous is given.
    #[arg(long, env = "IDEM_API_KEYS_FILE", value_name = "FILE")]
    api_keys: Option<PathBuf>,

    /// Serve a non-loopback address without API keys (every caller shares one scope).
    #[arg(long, env = "IDEM_ALLOW_ANONYMOUS")]
    allow_anonymous: bool,

    /// The largest request body accepted, in bytes.
    #[arg(long, env = "IDEM_MAX_BODY", default_value_t = DEFAULT_MAX_BODY)]
    max_body: usize,

    /// How long a record is kept when a begin does not say (e.g. 24h, 90m; at most 365d).
    #[arg(long, env = "IDEM_TTL", default_value = "24h", value_parser = parse_ttl)]
    ttl: Duration,

    /// How long a lease lasts when a begin does not say (e.g. 60s; at most 24h).
    #[arg(long, env = "IDEM_LEASE", default_value = "60s", value_parser = parse_lease)]
    lease: Duration,

    /// How often expired records are purged (at most 24h).
    #[arg(long, env = "IDEM_PURGE_INTERVAL", default_value = "60s", value_parser = parse_purge_interval)]
    purge_interval: Duration,

    /// The Snowflake id space: servers sharing a store and a name never share a worker id.
    #[arg(long, env = "IDEM_ID_SPACE", default_value = "default")]
    id_space: String,

    /// A file holding the admin token (one word, at least 16 characters) that turns on the
    /// record tools under /_idem/records (list, counts, show, repair); without it they
    /// answer 403.
    #[arg(long, env = "IDEM_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,

    /// Make /_idem/metrics need the admin token too.
    #[arg(
        long,
        env = "IDEM_METRICS_REQUIRE_TOKEN",
        requires = "admin_token_file"
    )]
    metrics_require_token: bool,

    #[command(flatten)]
    limits: LimitArgs,

    #[command(flatten)]
    replay_cache: ReplayCacheArgs,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (try 30s, 5m, 24h)"))?;
    if d.is_zero() {
        return Err("must be longer than zero".into());
    }
    Ok(d)
}

fn parse_bounded(s: &str, max: Duration) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > max {
        return Err(format!(
            "must be at most {}",
            humantime::format_duration(max)
        ));
    }
    Ok(d)
}

fn parse_ttl(s: &str) -> Result<Duration, String> {
    parse_bounded(s, idem_server::api::MAX_TTL)
}

fn parse_lease(s: &str) -> Result<Duration, String> {
    parse_bounded(s, idem_server::api::MAX_LEASE)
}

fn parse_upstream_timeout(s: &str) -> Result<Duration, String> {
    parse_bounded(s, idem_server::gateway::config::MAX_UPSTREAM_TIMEOUT)
}

fn parse_purge_interval(s: &str) -> Result<Duration, String> {
    parse_bounded(s, Duration::from_secs(24 * 60 * 60))
}

fn parse_header_timeout(s: &str) -> Result<Duration, String> {
    parse_bounded(s, listener::MAX_HEADER_TIMEOUT)
}

fn parse_idle_or_body_timeout(s: &str) -> Result<Duration, String> {
    parse_bounded(s, listener::MAX_IDLE_OR_BODY_TIMEOUT)
}

fn parse_max_connections(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=listener::MAX_CONNECTIONS).contains(&n) => Ok(n),
        _ => Err(format!(
            "must be a whole number from 1 to {}",
            listener::MAX_CONNECTIONS
        )),
    }
}

/// The connection limits: the command line, else the config file, else the defaults.
fn limits(
    args: &LimitArgs,
    file: Option<&FileConfig>,
    health_path: String,
) -> Result<Limits, String> {
    type Parse = fn(&str) -> Result<Duration, String>;
    /// Where a timeout goes, the flag's value, the file's key and value, and their parser.
    type Setting<'a> = (
        &'a mut Duration,
        Option<Duration>,
        &'a str,
        &'a Option<String>,
        Parse,
    );
    let none = FileConfig::default();
    let file = file.unwrap_or(&none);
    let mut limits = Limits::new(health_path);
    let timeouts: [Setting<'_>; 3] = [
        (
            &mut limits.header_timeout,
            args.header_timeout,
            "header_timeout",
            &file.header_timeout,
            parse_header_timeout,
        ),
        (
            &mut limits.idle_timeout,
            args.idle_timeout,
            "idle_timeout",
            &file.idle_timeout,
            parse_idle_or_body_timeout,
        ),
        (
            &mut limits.body_timeout,
            args.body_timeout,
            "body_timeout",
            &file.body_timeout,
            parse_idle_or_body_timeout,
        ),
    ];
    for (slot, arg, key, text, parse) in timeouts {
        match (arg, text) {
            (Some(d), _) => *slot = d,
            (None, Some(t)) => *slot = parse(t).map_err(|e| format!("{key} = {t:?}: {e}"))?,
            (None, None) => {}
        }
    }
    let from_file = file
        .max_connections
        .map(|n| {
            parse_max_connections(&n.to_string()).map_err(|e| format!("max_connections = {n}: {e}"))
        })
        .transpose()?;
    if let Some(n) = args.max_connections.or(from_file) {
        limits.max_connections = n;
    }
    Ok(limits)
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
                    Command::Serve(args) => serve(&args).await,
                    Command::Gateway(args) => gateway(args).await,
                    Command::Migrate(args) => migrate(&args).await,
                    Command::Relay(args) => relay(args).await,
                    Command::Id(args) => print_ids(&args).await,
                    Command::Records(args) => {
                        let store = open_store(&args.store).await?;
                        records_cli::run(store, args.command).await
                    }
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

/// Opens the store at `url` and, where it keeps them, its locks; an in-memory store also
/// publishes its size as gauges. The error names the store with any password hidden.
async fn open_with_locks(
    url: &str,
) -> Result<(SharedStore, Option<idem_core::SharedLockStore>), String> {
    let parsed: StoreUrl = url
        .parse()
        .map_err(|e| format!("invalid store URL {:?}: {e}", idem_store::redact(url)))?;
    // Installed before the store is wrapped: metric handles taken earlier record nothing.
    idem_server::metrics::Registry::global();
    let metered = |store: SharedStore| -> SharedStore { Arc::new(Metered::new(store)) };
    if let StoreUrl::Memory(limits) = &parsed {
        let store = idem_store::MemoryStore::with_limits(*limits);
        tokio::spawn(idem_server::metrics::watch_memory_store(store.clone()));
        return Ok((metered(Arc::new(store.clone())), Some(Arc::new(store))));
    }
    let (store, locks) = parsed
        .open_with_locks()
        .await
        .map_err(|e| format!("store {:?}: {e}", idem_store::redact(url)))?;
    Ok((metered(store), locks))
}

/// Opens the store at `url`; the error names it with any password hidden.
async fn open_store(url: &str) -> Result<SharedStore, String> {
    idem_store::open(url)
        .await
        .map_err(|e| format!("store {:?}: {e}", idem_store::redact(url)))
}

async fn relay(args: RelayArgs) -> Result<(), String> {
    use idem_server::relay;
    let from = relay::Broker::parse(
        &args.from,
        args.queue.as_deref(),
        args.stream.as_deref(),
        args.consumer.as_deref(),
        args.subject.as_deref(),
    )?;
    let mut target = relay::Target::parse(&args.to)?
        .timeout(args.timeout)
        .dead_letter_4xx(args.dead_letter_4xx)
        .header("content-type", &args.content_type)?;
    for h in &args.headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("--header {h:?} must be \"Name: value\""))?;
        target = target.header(name, value)?;
    }
    let store = open_store(&args.store).await?;
    let mut consumer = idem_mq::Consumer::new(store.clone())
        .scope("relay")
        .max_attempts(args.max_attempts)
        .lease(args.lease)
        .ttl(args.ttl);
    if let Some(name) = &args.key_header {
        consumer = consumer.key(idem_mq::KeyFrom::Header(name.clone()));
    }
    if let Some(pointer) = &args.key_json {
        consumer = consumer.key(idem_mq::KeyFrom::JsonPointer(pointer.clone()));
    }
    if let Some(ns) = &args.namespace {
        consumer = consumer.namespace(ns.clone());
    }
    if let Some(addr) = args.metrics_listen {
        // The recorder first: descriptions sent before it is installed are lost.
        idem_server::metrics::Registry::global();
        idem_mq::describe_metrics();
        metrics::describe_counter!(
            "idem_relay_requests_total",
            "POSTs to the target, by result (2xx, 3xx, 4xx, 5xx, timeout, unreachable, failed)."
        );
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let addr = listener.local_addr().unwrap_or(addr);
        let registry = idem_server::metrics::Registry::global();
        let app = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(move || std::future::ready(registry.response())),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        // The same connection limits as `serve` and `gateway`; it ends with the process.
        tokio::spawn(listener::serve(
            listener,
            app,
            Limits::new("/healthz"),
            std::future::pending(),
        ));
        info!("metrics on http://{addr}/metrics");
    }
    tokio::spawn(idem::purge::purge_loop(
        store,
        Arc::new(SystemClock),
        Duration::from_secs(60),
    ));
    let status = tokio::spawn(relay::status_line(consumer.clone(), args.status_every));
    info!(from = %from.display(), to = %args.to, "relaying");
    let ran = from
        .relay(
            &consumer,
            relay::Relay::new(target),
            args.prefetch,
            shutdown_signal(),
        )
        .await;
    status.abort();
    let c = consumer.counts();
    info!(
        delivered = c.handled,
        replayed = c.replayed,
        requeued = c.requeued,
        dead_lettered = c.dead_lettered,
        "relay stopped"
    );
    ran.map_err(|e| with_causes(&e))
}

/// `e` and the errors beneath it, as one line: "connecting to the broker: Connection refused".
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text = format!("{text}: {c_text}");
        }
        cause = c.source();
    }
    text
}

async fn print_ids(args: &IdArgs) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut line = |text: &str| writeln!(out, "{text}").map_err(|e| format!("cannot write: {e}"));
    match args.kind.as_str() {
        "snowflake" => {
            let store = open_store(&args.store).await?;
            let pool = idem_id::WorkerPool::new(store, Arc::new(SystemClock), &args.id_space);
            let g = pool
                .claim(
                    idem_id::Layout::default(),
                    idem_id::SnowflakeOptions::default(),
                )
                .await
                .map_err(|e| e.to_string())?;
            let issued = (0..args.count).try_for_each(|_| {
                let id = g.next().map_err(|e| e.to_string())?;
                line(&id.to_string())
            });
            g.release().await.map_err(|e| e.to_string())?;
            issued?;
        }
        "segment" => {
            let store = open_store(&args.store).await?;
            let tag = args.tag.as_deref().unwrap_or_default();
            // One range of exactly `count`, and no range fetched ahead: nothing is wasted.
            let options = idem_id::SegmentOptions {
                initial_step: u64::from(args.count),
                min_step: u64::from(args.count),
                prefetch_at: 2.0,
                ..idem_id::SegmentOptions::default()
            };
            let segments =
                idem_id::Segments::new(store, tag, options).map_err(|e| e.to_string())?;
            for _ in 0..args.count {
                let id = segments.next().await.map_err(|e| e.to_string())?;
                line(&id.to_string())?;
            }
        }
        "token" => (0..args.count).try_for_each(|_| line(&idem_id::token()))?,
        _ => (0..args.count).try_for_each(|_| line(&idem_id::uuid7().to_string()))?,
    }
    out.flush().map_err(|e| format!("cannot write: {e}"))
}

async fn migrate(args: &MigrateArgs) -> Result<(), String> {
    // Opening a store applies whatever migrations it lacks, under the store's own lock.
    let store = open_store(&args.store).await?;
    info!(store = store.kind(), "the store's schema is up to date");
    Ok(())
}

async fn serve(args: &ServeArgs) -> Result<(), String> {
    // Checked first, so that a typo is reported before anything else is set up.
    args.store
        .parse::<StoreUrl>()
        .map_err(|e| format!("invalid --store: {e}"))?;
    let auth = match &args.api_keys {
        Some(path) => Auth::from_file(path).map_err(|e| e.to_string())?,
        None => Auth::anonymous(),
    };
    let admin_token = args
        .admin_token_file
        .as_deref()
        .map(idem_server::admin::AdminToken::from_file)
        .transpose()?;
    if auth.is_anonymous() && !args.listen.ip().is_loopback() && !args.allow_anonymous {
        return Err(format!(
            "refusing to serve {} without API keys: give --api-keys FILE, or \
             --allow-anonymous if every caller may share one scope",
            args.listen
        ));
    }
    let (store, locks) = open_with_locks(&args.store).await?;
    let store = args.replay_cache.wrap(store, None);
    if locks.is_none() {
        warn!("this store keeps no locks: /v1/locks answers 501");
    }
    if auth.is_anonymous() {
        warn!(
            "no API keys configured: every caller shares the scope `default`; \
             give --api-keys FILE to separate callers"
        );
    }
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // A Snowflake worker id of its own, leased from the store and kept (or replaced) for as
    // long as it runs; the generator logs what happens to it.
    let pool = idem_id::WorkerPool::new(store.clone(), clock.clone(), &args.id_space);
    let snowflake = idem_id::ManagedSnowflake::start(
        pool,
        idem_id::Layout::default(),
        idem_id::SnowflakeOptions::default(),
    )
    .await
    .map_err(|e| {
        format!(
            "cannot issue Snowflake ids in id space {:?}: {e}",
            args.id_space
        )
    })?;
    let health = idem_server::health::Monitor::default();
    let state = AppState {
        store: store.clone(),
        clock: clock.clone(),
        auth: Arc::new(auth),
        max_body: args.max_body,
        default_lease: args.lease,
        default_ttl: args.ttl,
        snowflake: Some(snowflake.clone()),
        health: health.clone(),
        segments: idem_server::ids::SegmentTable::default(),
        locks: locks.map(idem::Locks::shared),
        admin_token,
        records_history: Arc::default(),
        metrics_require_token: args.metrics_require_token,
    };
    let watch = tokio::spawn(
        health
            .clone()
            .watch(idem_server::health::Components::of(&state)),
    );
    let sampler = tokio::spawn(idem_server::admin::sampler::run(
        store.clone(),
        clock.clone(),
        state.records_history.clone(),
        idem_server::admin::sampler::SAMPLE_EVERY,
    ));
    let served = run(
        args.listen,
        router(state),
        store,
        clock,
        args.purge_interval,
        health.purge_status(),
        limits(&args.limits, None, "/healthz".to_owned())?,
    )
    .await;
    health.shutting_down();
    watch.abort();
    sampler.abort();
    // Into quarantine, so no other process reuses it at once.
    if let Err(e) = snowflake.release().await {
        warn!(error = %e, "could not give the Snowflake worker id back; it expires with its lease");
    }
    served
}

async fn gateway(args: GatewayArgs) -> Result<(), String> {
    let mut file = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            FileConfig::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => FileConfig::default(),
    };
    let upstream = args
        .upstream
        .or(file.upstream.clone())
        .ok_or("no upstream: give --upstream URL (or upstream = \"...\" in --config)")?;
    let upstream = Upstream::parse(&upstream)?;
    let listen = match (args.listen, &file.listen) {
        (Some(addr), _) => addr,
        (None, Some(text)) => text
            .parse()
            .map_err(|e| format!("listen = {text:?} in the config file: {e}"))?,
        (None, None) => SocketAddr::from(([127, 0, 0, 1], 7080)),
    };
    let store_url = args
        .store
        .or(file.store.clone())
        .unwrap_or_else(|| "sqlite://idem.db".to_owned());
    let (store, _) = open_with_locks(&store_url).await?;
    // Unknown outcomes stay out of the cache: an operator reopens them, and every instance
    // must then let the retry through at once.
    let store = args
        .replay_cache
        .wrap(store, Some(idem_http::operator::is_unknown_outcome));
    // The command line wins over the file.
    let mut gateway = Gateway::new(upstream, store.clone());
    if let Some(t) = args.upstream_timeout {
        gateway.upstream_timeout = t;
        file.upstream_timeout = None;
    }
    if args.admin_prefix.is_some() {
        file.admin_prefix = args.admin_prefix;
    }
    if args.admin_token_file.is_some() {
        file.admin_token_file = args.admin_token_file;
    }
    let purge_interval = match (args.purge_interval, &file.purge_interval) {
        (Some(d), _) => d,
        (None, Some(text)) => {
            parse_purge_interval(text).map_err(|e| format!("purge_interval = {text:?}: {e}"))?
        }
        (None, None) => Duration::from_secs(60),
    };
    let gateway = gateway.configure(&file)?;
    let limits = limits(
        &args.limits,
        Some(&file),
        format!("{}/health", gateway.admin_prefix),
    )?;
    info!(
        admin = %gateway.admin_prefix,
        routes = gateway.routes.len(),
        "gateway to the upstream"
    );
    let clock = gateway.clock.clone();
    let health = gateway.health.clone();
    let components = idem_server::health::Components::store_only(store.clone(), clock.clone());
    let watch = tokio::spawn(health.clone().watch(components));
    let sampler = tokio::spawn(idem_server::admin::sampler::run(
        store.clone(),
        clock.clone(),
        gateway.records_history.clone(),
        idem_server::admin::sampler::SAMPLE_EVERY,
    ));
    let served = run(
        listen,
        gateway.router(),
        store,
        clock,
        purge_interval,
        health.purge_status(),
        limits,
    )
    .await;
    watch.abort();
    sampler.abort();
    served
}

/// Serves `app` on `listen` with `limits` until SIGTERM or Ctrl-C, purging expired records
/// meanwhile.
async fn run(
    listen: SocketAddr,
    app: axum::Router,
    store: SharedStore,
    clock: Arc<dyn Clock>,
    purge_interval: Duration,
    purge: idem::purge::PurgeStatus,
    limits: Limits,
) -> Result<(), String> {
    let socket = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let local = socket
        .local_addr()
        .map_err(|e| format!("cannot read the listening address: {e}"))?;
    tokio::spawn(purge_loop_reporting(
        store.clone(),
        clock,
        purge_interval,
        purge,
    ));
    listener::describe_metrics();
    info!(
        header_timeout = %humantime::format_duration(limits.header_timeout),
        idle_timeout = %humantime::format_duration(limits.idle_timeout),
        body_timeout = %humantime::format_duration(limits.body_timeout),
        max_connections = limits.max_connections,
        "connection limits"
    );
    if let Some(soft) = listener::descriptor_limit()
        && u64::try_from(limits.max_connections).is_ok_and(|n| n > soft)
    {
        warn!(
            max_connections = limits.max_connections,
            open_file_limit = soft,
            "--max-connections is above the open-file limit: connections will fail before the cap bites"
        );
    }
    info!(store = store.kind(), "listening on http://{local}");
    listener::serve(socket, app, limits, shutdown_signal()).await;
    info!("stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    info!("shutting down");
}
