//! `idem serve`: the JSON API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, SystemClock};
use idem_server::auth::Auth;
use idem_server::{AppState, DEFAULT_MAX_BODY, router};
use idem_store::StoreUrl;
use tracing::warn;

use super::listen::{AdminListener, LimitArgs, SERVE_ADMIN_LISTEN, limits, run};
use super::parse::{parse_lease, parse_purge_interval, parse_ttl};
use super::{ReplayCacheArgs, open_with_locks};

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// Where records live: sqlite://PATH (the embedded default), memory://, postgres://…,
    /// mysql://…, redis://… or redis+cluster://host:port,host:port (see docs/stores.md).
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,

    /// Where locks live, apart from the records: zk://host:port[,host:port…]/ROOT
    /// (ZooKeeper), etcd://host:port[,host:port…]/PREFIX (etcd, in an idem built with the
    /// `etcd` feature), or another store's URL. By default the store keeps its own locks
    /// (every store but MySQL).
    #[arg(long, env = "IDEM_LOCKS", value_name = "URL")]
    locks: Option<String>,

    /// The address to listen on.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,

    /// The address of the admin page and the record tools (/_idem on it), apart from the
    /// API's; opened only with --admin-token-file.
    #[arg(long, env = "IDEM_ADMIN_LISTEN", default_value = SERVE_ADMIN_LISTEN)]
    admin_listen: SocketAddr,

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
    /// admin page and the record tools (list, counts, show, repair) on --admin-listen.
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

pub(crate) async fn serve(args: &ServeArgs) -> Result<(), String> {
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
        .map(idem_ops::admin::AdminToken::from_file)
        .transpose()?;
    if auth.is_anonymous() && !args.listen.ip().is_loopback() && !args.allow_anonymous {
        return Err(format!(
            "refusing to serve {} without API keys: give --api-keys FILE, or \
             --allow-anonymous if every caller may share one scope",
            args.listen
        ));
    }
    let has_token = admin_token.is_some();
    let (store, locks) = open_with_locks(&args.store).await?;
    let locks = match &args.locks {
        Some(url) => Some(
            idem_store::open_locks(url)
                .await
                .map_err(|e| format!("--locks {:?}: {e}", idem_store::redact(url)))?,
        ),
        None => locks,
    };
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
    let health = idem_ops::health::Monitor::default();
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
    let watch = tokio::spawn(health.clone().watch(state.components()));
    let sampler = tokio::spawn(idem_ops::admin::sampler::run(
        store.clone(),
        clock.clone(),
        state.records_history.clone(),
        idem_ops::admin::sampler::SAMPLE_EVERY,
    ));
    let admin = AdminListener::new(args.listen, args.admin_listen, has_token, "/_idem", || {
        idem_server::admin_router(state.clone())
    })?;
    let served = run(
        args.listen,
        router(state),
        admin,
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
