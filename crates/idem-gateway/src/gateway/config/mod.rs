//! The gateway's configuration file (TOML) and its validation.
//!
//! ```toml
//! upstream = "http://127.0.0.1:8080"
//! upstream_timeout = "30s"
//! scope_header = "authorization"
//! scope_secret_file = "/etc/idem/scope-secret" # keyed scope hashes, logged with outcomes
//! trusted_proxies = ["10.0.0.0/8"]             # whose X-Forwarded-* / Forwarded are kept
//! admin_prefix = "/_idem"
//! admin_token_file = "/etc/idem/admin-token"   # enables the record tools and the admin page
//! admin_listen = "127.0.0.1:7081"              # where they are served, apart from the upstream
//! metrics_require_token = false                # true: /_idem/metrics needs the admin token
//!
//! [defaults]              # every route, and requests no route matches
//! methods = ["POST", "PATCH"]
//! key = "optional"
//! anonymous = "refuse"    # guarded requests without the scope header: 401
//!
//! [[route]]               # the first route whose path matches wins
//! path = "/v1/payments/**"
//! key = "required"
//! preset = "stripe"
//! ttl = "48h"
//! wait = "5s"
//! ```

use std::time::Duration;

use axum::http::{HeaderName, Method};
use idem_core::Namespace;

use idem_core::record::{MAX_LEASE, MAX_TTL};
use idem_http::{InFlight, KeyRequirement, OnUnknown, Policy, Preset, ReplayHeaders};
use serde::Deserialize;

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The upstream URL.
    pub upstream: Option<String>,
    /// The address to listen on.
    pub listen: Option<String>,
    /// The address of the admin page and the record tools (default `127.0.0.1:7081`).
    pub admin_listen: Option<String>,
    /// The store URL.
    pub store: Option<String>,
    /// The reserved path prefix of the gateway's own endpoints.
    pub admin_prefix: Option<String>,
    /// A file holding the operator's token for the record tools.
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Whether `{admin_prefix}/metrics` needs the admin token too.
    pub metrics_require_token: Option<bool>,
    /// How long to wait for the upstream's answer.
    pub upstream_timeout: Option<String>,
    /// How long a request waits for the store to take its answer, and for room in the
    /// unstored answers' budget, before it is answered 503 `answer_not_stored`.
    pub store_timeout: Option<String>,
    /// The header whose (hashed) value scopes keys.
    pub scope_header: Option<String>,
    /// A file holding the secret that keys the hash of callers' credentials; every gateway on
    /// one store needs the same one.
    pub scope_secret_file: Option<std::path::PathBuf>,
    /// Addresses (`10.0.0.7`) and networks (`10.0.0.0/8`) of the proxies in front whose
    /// `X-Forwarded-*` and `Forwarded` headers are passed on; everyone else's are replaced.
    pub trusted_proxies: Option<Vec<String>>,
    /// How often expired records are purged.
    pub purge_interval: Option<String>,
    /// How long a request's head may take to arrive (`10s`).
    pub header_timeout: Option<String>,
    /// How long a keep-alive connection may wait for its next request (`60s`).
    pub idle_timeout: Option<String>,
    /// How long a request's body may take to arrive, from its head (`30s`).
    pub body_timeout: Option<String>,
    /// How many connections are served at once.
    pub max_connections: Option<u64>,
    /// Settings for every route.
    #[serde(default)]
    pub defaults: RouteSettings,
    /// Per-route settings, first match wins.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteSettings>,
}

/// One route's settings as written; anything left out comes from `[defaults]`, then from the
/// built-in defaults.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSettings {
    /// The path pattern (routes only): `/exact`, `*` for one segment, a final `**` for any rest.
    pub path: Option<String>,
    /// Whether the pattern's letters must match in case (`true` by default); `false` for
    /// upstreams that route without regard to case.
    pub case_sensitive: Option<bool>,
    /// What guarded requests without the scope header get: `refuse` (401) or `shared` (one
    /// scope for all of them).
    pub anonymous: Option<String>,
    /// The guarded methods.
    pub methods: Option<Vec<String>>,
    /// `required` or `optional`.
    pub key: Option<String>,
    /// `ietf` or `stripe`.
    pub preset: Option<String>,
    /// Retention of stored answers.
    pub ttl: Option<String>,
    /// How long an attempt holds the key; longer than `upstream_timeout`.
    pub lease: Option<String>,
    /// How long a request whose key is in flight waits for the first answer (0: 409 at once).
    pub wait: Option<String>,
    /// `hold` or `release_after_lease`.
    pub on_unknown: Option<String>,
    /// The key namespace.
    pub namespace: Option<String>,
    /// The largest request body on guarded requests, in bytes.
    pub max_body: Option<usize>,
    /// The largest response body stored, in bytes.
    pub max_response: Option<usize>,
    /// Request headers in the fingerprint.
    pub fingerprint_headers: Option<Vec<String>>,
    /// JSON Pointers fingerprinted instead of the whole JSON body.
    pub fingerprint_json_fields: Option<Vec<String>>,
    /// Only these response headers are replayed.
    pub replay_headers: Option<Vec<String>>,
}

impl FileConfig {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

/// A path pattern: segments, each literal or `*`; a final `**` matches any rest (even none).
///
/// Patterns are matched against paths in normal form ([`super::path::normalize`]), segment
/// by segment with every percent-encoding decoded on both sides, so `/v1/%70ayments`,
/// `/v1/./payments` and `//v1/payments` all match `/v1/payments`. A final slash is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    text: String,
    segments: Vec<Segment>,
    rest: bool,
    case_sensitive: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Any,
    Literal(Vec<u8>),
}

impl PathPattern {
    /// Parses a pattern such as `/v1/orders/*/capture` or `/v1/**`.
    pub fn parse(pattern: &str) -> Result<Self, String> {
        let Some(body) = pattern.strip_prefix('/') else {
            return Err(format!("route path {pattern:?} must start with /"));
        };
        let mut parts: Vec<&str> = body.split('/').collect();
        if parts.last().is_some_and(|s| s.is_empty()) {
            parts.pop();
        }
        let rest = parts.last().is_some_and(|s| *s == "**");
        if rest {
            parts.pop();
        }
        let segments = parts
            .into_iter()
            .map(|s| match s {
                "**" => Err(format!(
                    "route path {pattern:?}: ** may only be the last segment"
                )),
                "*" => Ok(Segment::Any),
                "" => Err(format!("route path {pattern:?} has an empty segment")),
                "." | ".." => Err(format!("route path {pattern:?} has a dot segment")),
                literal => match super::path::normalize(&format!("/{literal}")) {
                    Ok(normal) if normal.len() > 1 && !normal[1..].contains('/') => {
                        Ok(Segment::Literal(super::path::decoded(&normal[1..])))
                    }
                    Ok(_) => Err(format!("route path {pattern:?} has a dot segment")),
                    Err(e) => Err(format!("route path {pattern:?}: {e}")),
                },
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            text: pattern.to_owned(),
            segments,
            rest,
            case_sensitive: true,
        })
    }

    /// The same pattern, matching letters with or without regard to case.
    #[must_use]
    pub fn case_sensitive(mut self, yes: bool) -> Self {
        self.case_sensitive = yes;
        self
    }

    /// Whether a literal segment has a byte past ASCII (a letter such as `ä`, once decoded),
    /// which matching without regard to case would not fold.
    pub fn has_non_ascii(&self) -> bool {
        self.segments
            .iter()
            .any(|s| matches!(s, Segment::Literal(l) if !l.is_ascii()))
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `path`, in normal form, matches.
    pub fn matches(&self, path: &str) -> bool {
        let mut parts = path.split('/').filter(|s| !s.is_empty());
        for want in &self.segments {
            match (parts.next(), want) {
                (Some(_), Segment::Any) => {}
                (Some(got), Segment::Literal(want)) => {
                    let got = super::path::decoded(got);
                    let same = if self.case_sensitive {
                        got == *want
                    } else {
                        got.eq_ignore_ascii_case(want)
                    };
                    if !same {
                        return false;
                    }
                }
                (None, _) => return false,
            }
        }
        self.rest || parts.next().is_none()
    }
}

impl std::fmt::Display for PathPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// What a guarded request without the scope header gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Anonymous {
    /// 401 `credential_required`: no caller's record can be read or taken by one who does not
    /// say who it is.
    #[default]
    Refuse,
    /// Every such request shares the scope `anonymous`, so each can replay the others'
    /// answers by reusing their keys: only for upstreams whose anonymous callers are one
    /// party, or that scope callers some other way.
    Shared,
}

/// One route's rules: its policy and what its anonymous callers get.
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// The layer's policy.
    pub policy: Policy,
    /// Guarded requests without the scope header.
    pub anonymous: Anonymous,
}

/// Builds a route's rules from its settings over the defaults.
pub fn route(
    route: &RouteSettings,
    defaults: &RouteSettings,
    upstream_timeout: Duration,
) -> Result<Route, String> {
    let anonymous = match route.anonymous.as_ref().or(defaults.anonymous.as_ref()) {
        None => Anonymous::default(),
        Some(a) => match a.as_str() {
            "refuse" => Anonymous::Refuse,
            "shared" => Anonymous::Shared,
            other => return Err(format!("anonymous = {other:?}: expected refuse or shared")),
        },
    };
    Ok(Route {
        policy: policy(route, defaults, upstream_timeout)?,
        anonymous,
    })
}

/// Parses a duration such as `30s`, `5m`, `24h`.
pub fn duration(what: &str, s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{what} {s:?}: {e} (try 30s, 5m, 24h)"))
}

/// Builds a route's policy from its settings over the defaults.
pub fn policy(
    route: &RouteSettings,
    defaults: &RouteSettings,
    upstream_timeout: Duration,
) -> Result<Policy, String> {
    macro_rules! pick {
        ($field:ident) => {
            route.$field.as_ref().or(defaults.$field.as_ref())
        };
    }
    let mut p = Policy::default();
    if let Some(methods) = pick!(methods) {
        let parsed: Result<Vec<Method>, String> = methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("method {m:?} is not an HTTP method"))
            })
            .collect();
        if methods.is_empty() {
            return Err("methods = []: a route must guard at least one method".into());
        }
        p = p.methods(parsed?);
    }
    if let Some(key) = pick!(key) {
        p = p.key(match key.as_str() {
            "required" => KeyRequirement::Required,
            "optional" => KeyRequirement::Optional,
            other => return Err(format!("key = {other:?}: expected required or optional")),
        });
    }
    if let Some(preset) = pick!(preset) {
        p = p.preset(match preset.as_str() {
            "ietf" => Preset::Ietf,
            "stripe" => Preset::Stripe,
            other => return Err(format!("preset = {other:?}: expected ietf or stripe")),
        });
    }
    if let Some(ttl) = pick!(ttl) {
        p = p.ttl(bounded("ttl", ttl, MAX_TTL)?);
    }
    let lease = match pick!(lease) {
        Some(lease) => bounded("lease", lease, MAX_LEASE)?,
        None => p
            .lease
            .max(upstream_timeout.saturating_mul(2))
            .min(MAX_LEASE),
    };
    p = p.lease(lease);
    if p.lease <= upstream_timeout {
        return Err(format!(
            "lease ({}) must be longer than upstream_timeout ({}): otherwise a retry could run \
             while the first attempt is still waiting for the upstream",
            humantime::format_duration(p.lease),
            humantime::format_duration(upstream_timeout)
        ));
    }
    if let Some(wait) = pick!(wait) {
        let d = duration("wait", wait)?;
        if d > MAX_LEASE {
            return Err(format!(
                "wait must be at most {}",
                humantime::format_duration(MAX_LEASE)
            ));
        }
        p = p.in_flight(if d.is_zero() {
            InFlight::Reject
        } else {
            InFlight::Wait(d)
        });
    }
    if let Some(on_unknown) = pick!(on_unknown) {
        p = p.on_unknown(match on_unknown.as_str() {
            "hold" => OnUnknown::Hold,
            "release_after_lease" => OnUnknown::ReleaseAfterLease,
            other => {
                return Err(format!(
                    "on_unknown = {other:?}: expected hold or release_after_lease"
                ));
            }
        });
    }
    if let Some(ns) = pick!(namespace) {
        p = p.namespace(Namespace::new(ns.as_str()).map_err(|e| format!("namespace: {e}"))?);
    }
    if let Some(&n) = pick!(max_body) {
        p = p.max_body(n);
    }
    if let Some(&n) = pick!(max_response) {
        p = p.max_response(n);
    }
    if let Some(names) = pick!(fingerprint_headers) {
        p = p.fingerprint_headers(header_names(names)?);
    }
    if let Some(pointers) = pick!(fingerprint_json_fields) {
        if pointers.is_empty() {
            return Err(
                "fingerprint_json_fields = []: with no fields every JSON body would match; \
                 leave the setting out to fingerprint the whole body"
                    .into(),
            );
        }
        if let Some(bad) = pointers
            .iter()
            .find(|p| !p.is_empty() && !p.starts_with('/'))
        {
            return Err(format!(
                "fingerprint_json_fields: {bad:?} is not a JSON Pointer (they start with /)"
            ));
        }
        p = p.fingerprint_json_fields(pointers.iter().cloned());
    }
    if let Some(names) = pick!(replay_headers) {
        p = p.replay_headers(ReplayHeaders::Only(header_names(names)?));
    }
    Ok(p)
}

/// The longest `upstream_timeout`: any longer and a lease (at most 24 h) could not cover it.
pub const MAX_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// The longest `store_timeout`: a caller waits that long for a stalled store.
pub const MAX_STORE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// A duration longer than zero and at most `max`.
pub fn bounded(what: &str, s: &str, max: Duration) -> Result<Duration, String> {
    let d = duration(what, s)?;
    if d.is_zero() {
        return Err(format!("{what} must be longer than zero"));
    }
    if d > max {
        return Err(format!(
            "{what} must be at most {}",
            humantime::format_duration(max)
        ));
    }
    Ok(d)
}

fn header_names(names: &[String]) -> Result<Vec<HeaderName>, String> {
    names
        .iter()
        .map(|n| {
            HeaderName::from_bytes(n.as_bytes()).map_err(|_| format!("{n:?} is not a header name"))
        })
        .collect()
}

#[cfg(test)]
mod tests;
