//! Serving on an address, shared by `serve` and `gateway`: the connection limits, the purge
//! of expired records meanwhile, and stopping on SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem::purge::purge_loop_reporting;
use idem_core::{Clock, SharedStore};
use idem_gateway::gateway::FileConfig;
use idem_gateway::listener::{self, Limits};
use tracing::{info, warn};

use super::parse::{parse_header_timeout, parse_idle_or_body_timeout, parse_max_connections};

/// Connection limits, shared by serve and gateway (which also reads them from its file).
#[derive(clap::Args)]
pub(crate) struct LimitArgs {
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

/// The connection limits: the command line, else the config file, else the defaults.
pub(crate) fn limits(
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

/// The admin listener's default address on `idem serve` (the API's port plus one).
pub(crate) const SERVE_ADMIN_LISTEN: &str = "127.0.0.1:7071";

/// The admin listener's default address on `idem gateway` (the gateway's port plus one).
pub(crate) const GATEWAY_ADMIN_LISTEN: &str = "127.0.0.1:7081";

/// The admin listener: the admin page and the record tools on an address of their own.
pub(crate) struct AdminListener {
    addr: SocketAddr,
    routes: axum::Router,
    /// The page's path, for the log.
    page: String,
}

impl AdminListener {
    /// The admin listener on `addr`, when the server has an admin token (without one the page
    /// and the record tools are off, and health and metrics are on the main listener anyway).
    /// Refuses the main listener's own address.
    pub(crate) fn new(
        listen: SocketAddr,
        addr: SocketAddr,
        has_token: bool,
        page: &str,
        routes: impl FnOnce() -> axum::Router,
    ) -> Result<Option<Self>, String> {
        if !has_token {
            return Ok(None);
        }
        if addr == listen && listen.port() != 0 {
            return Err(format!(
                "--admin-listen {addr} is the address the server listens on: the admin page \
                 needs an address of its own"
            ));
        }
        Ok(Some(Self {
            addr,
            routes: routes(),
            page: page.to_owned(),
        }))
    }
}

async fn bind(listen: SocketAddr, what: &str) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}{what}: {e}"))
}

/// Serves `app` on `listen` (and `admin`'s routes on its address) with `limits` until SIGTERM
/// or Ctrl-C, purging expired records meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    listen: SocketAddr,
    app: axum::Router,
    admin: Option<AdminListener>,
    store: SharedStore,
    clock: Arc<dyn Clock>,
    purge_interval: Duration,
    purge: idem::purge::PurgeStatus,
    limits: Limits,
) -> Result<(), String> {
    let socket = bind(listen, "").await?;
    let local = socket
        .local_addr()
        .map_err(|e| format!("cannot read the listening address: {e}"))?;
    let admin = match admin {
        Some(admin) => {
            let socket = bind(admin.addr, " (--admin-listen)").await?;
            let local = socket
                .local_addr()
                .map_err(|e| format!("cannot read the admin listening address: {e}"))?;
            Some((socket, local, admin))
        }
        None => None,
    };
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
    // One signal stops both listeners.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let on_stop = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let admin = admin.map(|(socket, local, admin)| {
        info!(
            "admin page on http://{local}{} (the record tools beside it)",
            admin.page
        );
        tokio::spawn(listener::serve(
            socket,
            admin.routes,
            limits.clone(),
            on_stop(),
        ))
    });
    let signal = tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    });
    listener::serve(socket, app, limits, on_stop()).await;
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    signal.abort();
    info!("stopped");
    Ok(())
}

pub(crate) async fn shutdown_signal() {
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
