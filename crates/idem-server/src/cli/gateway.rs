//! `idem gateway`: the reverse proxy in front of an existing API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use idem_gateway::gateway::{FileConfig, Gateway, Upstream};
use tracing::info;

use super::listen::{AdminListener, GATEWAY_ADMIN_LISTEN, LimitArgs, limits, run};
use super::parse::{parse_purge_interval, parse_upstream_timeout};
use super::{ReplayCacheArgs, open_with_locks};

#[derive(clap::Args)]
pub(crate) struct GatewayArgs {
    /// The API to protect: an http:// URL, optionally with a base path.
    #[arg(long, env = "IDEM_UPSTREAM")]
    upstream: Option<String>,

    /// The address to listen on [default: 127.0.0.1:7080].
    #[arg(long, env = "IDEM_GATEWAY_LISTEN")]
    listen: Option<SocketAddr>,

    /// Where records live: sqlite://PATH, memory://, postgres://…, mysql://…, redis://… or
    /// redis+cluster://… (see docs/stores.md) [default: sqlite://idem.db].
    #[arg(long, env = "IDEM_STORE")]
    store: Option<String>,

    /// A TOML file of gateway settings and per-route policies (see docs/guide/gateway.md).
    #[arg(long, env = "IDEM_GATEWAY_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,

    /// The address of the admin page and the record tools (under the admin prefix), apart
    /// from the upstream's origin; opened only with an admin token [default: 127.0.0.1:7081].
    #[arg(long, env = "IDEM_GATEWAY_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,

    /// The reserved path prefix of the gateway's own endpoints [default: /_idem].
    #[arg(long, env = "IDEM_ADMIN_PREFIX")]
    admin_prefix: Option<String>,

    /// A file holding the operator's token for the admin page and the record tools on
    /// --admin-listen (inspect, reopen an unknown outcome); without them they are off.
    #[arg(long, env = "IDEM_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,

    /// How long to wait for the upstream's answer (at most 1h) [default: 30s].
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", value_parser = parse_upstream_timeout)]
    upstream_timeout: Option<Duration>,

    /// How often expired records are purged (at most 24h) [default: 60s].
    #[arg(long, env = "IDEM_PURGE_INTERVAL", value_parser = parse_purge_interval)]
    purge_interval: Option<Duration>,

    /// How many bytes of answers the store has not taken yet (stalled or down) the gateway
    /// keeps to offer again; an answer that finds no room is not kept, and its record is
    /// marked an unknown outcome, never run again unasked.
    #[arg(long, env = "IDEM_UNSTORED_ANSWERS_BYTES", default_value_t = idem_http::DEFAULT_UNSTORED_BYTES)]
    unstored_answers_bytes: usize,

    #[command(flatten)]
    limits: LimitArgs,

    #[command(flatten)]
    replay_cache: ReplayCacheArgs,
}

pub(crate) async fn gateway(args: GatewayArgs) -> Result<(), String> {
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
    let admin_listen = match (args.admin_listen, &file.admin_listen) {
        (Some(addr), _) => addr,
        (None, Some(text)) => text
            .parse()
            .map_err(|e| format!("admin_listen = {text:?} in the config file: {e}"))?,
        (None, None) => GATEWAY_ADMIN_LISTEN
            .parse()
            .map_err(|e| format!("{GATEWAY_ADMIN_LISTEN}: {e}"))?,
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
    gateway.unstored_answers = idem_http::UnstoredAnswers::new(args.unstored_answers_bytes);
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
    let components = idem_ops::health::Components::store_only(store.clone(), clock.clone());
    let watch = tokio::spawn(health.clone().watch(components));
    let sampler = tokio::spawn(idem_ops::admin::sampler::run(
        store.clone(),
        clock.clone(),
        gateway.records_history.clone(),
        idem_ops::admin::sampler::SAMPLE_EVERY,
    ));
    let admin = AdminListener::new(
        listen,
        admin_listen,
        gateway.admin_token.is_some(),
        &gateway.admin_prefix,
        || gateway.admin_router(),
    )?;
    let served = run(
        listen,
        gateway.router(),
        admin,
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
