//! The parsers of the command line's values: durations within bounds, connection counts.

use std::time::Duration;

use idem_gateway::listener;

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (try 30s, 5m, 24h)"))?;
    if d.is_zero() {
        return Err("must be longer than zero".into());
    }
    Ok(d)
}

pub(crate) fn parse_bounded(s: &str, max: Duration) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > max {
        return Err(format!(
            "must be at most {}",
            humantime::format_duration(max)
        ));
    }
    Ok(d)
}

pub(crate) fn parse_ttl(s: &str) -> Result<Duration, String> {
    parse_bounded(s, idem_server::api::MAX_TTL)
}

pub(crate) fn parse_lease(s: &str) -> Result<Duration, String> {
    parse_bounded(s, idem_server::api::MAX_LEASE)
}

pub(crate) fn parse_upstream_timeout(s: &str) -> Result<Duration, String> {
    parse_bounded(s, idem_gateway::gateway::config::MAX_UPSTREAM_TIMEOUT)
}

pub(crate) fn parse_purge_interval(s: &str) -> Result<Duration, String> {
    parse_bounded(s, Duration::from_secs(24 * 60 * 60))
}

pub(crate) fn parse_header_timeout(s: &str) -> Result<Duration, String> {
    parse_bounded(s, listener::MAX_HEADER_TIMEOUT)
}

pub(crate) fn parse_idle_or_body_timeout(s: &str) -> Result<Duration, String> {
    parse_bounded(s, listener::MAX_IDLE_OR_BODY_TIMEOUT)
}

pub(crate) fn parse_max_connections(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=listener::MAX_CONNECTIONS).contains(&n) => Ok(n),
        _ => Err(format!(
            "must be a whole number from 1 to {}",
            listener::MAX_CONNECTIONS
        )),
    }
}

pub(crate) fn parse_cache_age(s: &str) -> Result<Duration, String> {
    parse_bounded(s, Duration::from_secs(60 * 60))
}
