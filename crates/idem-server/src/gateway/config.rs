//! The gateway's configuration file (TOML) and its validation.
//!
//! ```toml
//! upstream = "http://127.0.0.1:8080"
//! upstream_timeout = "30s"
//! scope_header = "authorization"
//! admin_prefix = "/_idem"
//! admin_token_file = "/etc/idem/admin-token"   # enables the record tools
//!
//! [defaults]              # every route, and requests no route matches
//! methods = ["POST", "PATCH"]
//! key = "optional"
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

use crate::api::{MAX_LEASE, MAX_TTL};
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
    /// The store URL.
    pub store: Option<String>,
    /// The reserved path prefix of the gateway's own endpoints.
    pub admin_prefix: Option<String>,
    /// A file holding the operator's token for the record tools.
    pub admin_token_file: Option<std::path::PathBuf>,
    /// How long to wait for the upstream's answer.
    pub upstream_timeout: Option<String>,
    /// The header whose (hashed) value scopes keys.
    pub scope_header: Option<String>,
    /// How often expired records are purged.
    pub purge_interval: Option<String>,
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<String>,
    rest: bool,
}

impl PathPattern {
    /// Parses a pattern such as `/v1/orders/*/capture` or `/v1/**`.
    pub fn parse(pattern: &str) -> Result<Self, String> {
        let Some(body) = pattern.strip_prefix('/') else {
            return Err(format!("route path {pattern:?} must start with /"));
        };
        let mut segments: Vec<String> = body.split('/').map(str::to_owned).collect();
        if segments.last().is_some_and(String::is_empty) {
            segments.pop();
        }
        let rest = segments.last().is_some_and(|s| s == "**");
        if rest {
            segments.pop();
        }
        if segments.iter().any(|s| s == "**") {
            return Err(format!(
                "route path {pattern:?}: ** may only be the last segment"
            ));
        }
        if segments.iter().any(String::is_empty) {
            return Err(format!("route path {pattern:?} has an empty segment"));
        }
        Ok(Self { segments, rest })
    }

    /// Whether `path` matches. Empty segments are skipped and percent-encodings decoded
    /// before comparing (`//v1/%70ayments` matches `/v1/payments`), so a request cannot slip
    /// past its route's policy by spelling the path differently from the upstream's router.
    pub fn matches(&self, path: &str) -> bool {
        let mut parts = path.split('/').filter(|s| !s.is_empty());
        for want in &self.segments {
            match parts.next() {
                Some(got) if want == "*" || decoded_eq(got, want) => {}
                _ => return false,
            }
        }
        self.rest || parts.next().is_none()
    }
}

/// Whether a path segment, percent-decoded, equals `want`. Allocates nothing.
fn decoded_eq(got: &str, want: &str) -> bool {
    let (mut got, mut want) = (got.as_bytes(), want.as_bytes());
    loop {
        let (byte, rest) = match got {
            [] => return want.is_empty(),
            [b'%', h, l, rest @ ..] => match (hex(*h), hex(*l)) {
                (Some(h), Some(l)) => (h << 4 | l, rest),
                _ => (b'%', &got[1..]),
            },
            [b, rest @ ..] => (*b, rest),
        };
        match want {
            [w, wrest @ ..] if *w == byte => (got, want) = (rest, wrest),
            _ => return false,
        }
    }
}

fn hex(b: u8) -> Option<u8> {
    char::from(b)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
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
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let p = PathPattern::parse("/v1/orders/*/capture").unwrap();
        assert!(p.matches("/v1/orders/42/capture"));
        assert!(p.matches("/v1/orders/42/capture/"));
        assert!(p.matches("/v1/orders//42/capture"));
        assert!(p.matches("//v1/%6Frders/42/capture"));
        assert!(!p.matches("/v1/orders//capture"));
        assert!(!p.matches("/v1/order%/42/capture"));
        assert!(!p.matches("/v1/orders/42"));
        assert!(!p.matches("/v1/orders/42/capture/x"));
        let any = PathPattern::parse("/v1/**").unwrap();
        assert!(any.matches("/v1"));
        assert!(any.matches("/v1/a/b/c"));
        assert!(!any.matches("/v2/a"));
        assert!(
            PathPattern::parse("/**")
                .unwrap()
                .matches("/anything/at/all")
        );
        assert!(PathPattern::parse("/exact").unwrap().matches("/exact"));
        for bad in ["v1", "/a/**/b", "/a//b"] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn routes_inherit_defaults() {
        let file = FileConfig::parse(
            r#"
            upstream = "http://127.0.0.1:1"
            [defaults]
            key = "required"
            ttl = "1h"
            [[route]]
            path = "/pay/**"
            preset = "stripe"
            wait = "2s"
            methods = ["post", "put"]
            "#,
        )
        .unwrap();
        let t = Duration::from_secs(30);
        let route = policy(&file.routes[0], &file.defaults, t).unwrap();
        assert_eq!(route.key, KeyRequirement::Required);
        assert_eq!(route.preset, Preset::Stripe);
        assert_eq!(route.ttl, Duration::from_secs(3600));
        assert_eq!(route.in_flight, InFlight::Wait(Duration::from_secs(2)));
        assert_eq!(route.methods, [Method::POST, Method::PUT]);
        assert!(route.lease > t);
        let default = policy(&file.defaults, &RouteSettings::default(), t).unwrap();
        assert_eq!(default.preset, Preset::Ietf);
    }

    #[test]
    fn bad_settings_are_explained() {
        let t = Duration::from_secs(30);
        let d = RouteSettings::default();
        for (toml, needle) in [
            ("key = \"maybe\"", "required or optional"),
            ("preset = \"paypal\"", "ietf or stripe"),
            ("lease = \"10s\"", "longer than upstream_timeout"),
            ("ttl = \"soon\"", "ttl"),
            ("on_unknown = \"retry\"", "hold or release_after_lease"),
            ("fingerprint_json_fields = [\"amount\"]", "JSON Pointer"),
            ("methods = [\"PO ST\"]", "not an HTTP method"),
            ("namespace = \"a b\"", "namespace"),
            ("methods = []", "at least one method"),
            (
                "fingerprint_json_fields = []",
                "every JSON body would match",
            ),
            ("ttl = \"1000y\"", "at most"),
            ("lease = \"300000000000y\"", "at most"),
            ("wait = \"2d\"", "at most"),
        ] {
            let route: RouteSettings = toml::from_str(toml).unwrap();
            let err = policy(&route, &d, t).unwrap_err();
            assert!(err.contains(needle), "{toml}: {err}");
        }
        assert!(FileConfig::parse("unknown_setting = 1").is_err());
        assert!(FileConfig::parse("[[route]]\npath = \"/a\"\nkeys = \"required\"").is_err());
    }
}
