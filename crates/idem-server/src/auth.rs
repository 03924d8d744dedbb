//! Callers and their scopes.
//!
//! Each API key maps to a scope; a record's scope is always the caller's, so keys never
//! collide or replay across callers. API keys are kept only as SHA-256 hashes, and a presented
//! key is looked up by its hash, so the lookup does not compare secrets byte by byte.
//!
//! With no API keys configured, every caller shares one scope, `default`.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use idem_core::{Fingerprint, Scope};

use crate::AppState;
use idem_http::{Problem, ProblemCode, ToProblem};

pub use idem_ops::admin::{RESERVED_SCOPE_PREFIX, bearer};

/// Why `scope` may not be an API key's, if it may not: idem's own records, and the scopes the
/// other ways in give their callers (`idem gateway`'s `anonymous` and `cred-…`, `idem relay`'s
/// `relay`, a message consumer's default `mq`). A store may be shared by all of them, and a
/// caller of `idem serve` under such a scope could read, hold or replay their records.
pub fn reserved(scope: &str) -> Option<&'static str> {
    use idem_http::scope::{ANONYMOUS, CREDENTIAL_PREFIX};
    if scope.starts_with(RESERVED_SCOPE_PREFIX) {
        Some("scopes starting with `idem.` hold idem's own records")
    } else if scope == ANONYMOUS || scope.starts_with(CREDENTIAL_PREFIX) {
        Some("`anonymous` and scopes starting with `cred-` are the gateway's callers")
    } else if scope == idem_gateway::relay::SCOPE {
        Some("`relay` is idem relay's")
    } else if scope == idem_mq::DEFAULT_SCOPE {
        Some("`mq` is the message consumers' default")
    } else {
        None
    }
}

/// The scope used when no API keys are configured.
pub const DEFAULT_SCOPE: &str = "default";

/// How callers are told apart.
#[derive(Clone)]
pub enum Auth {
    /// No API keys: one shared scope.
    Anonymous(Scope),
    /// API keys (by their hash) and the scope each belongs to.
    Keys(HashMap<[u8; 32], Scope>),
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Auth::Anonymous(s) => write!(f, "Anonymous({s})"),
            Auth::Keys(k) => write!(f, "Keys({} keys)", k.len()),
        }
    }
}

/// A configuration of API keys that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AuthConfigError(String);

fn hash(api_key: &str) -> [u8; 32] {
    *Fingerprint::of_bytes(api_key.as_bytes()).as_bytes()
}

impl Auth {
    /// One shared `default` scope.
    pub fn anonymous() -> Self {
        Auth::Anonymous(Scope::new(DEFAULT_SCOPE).expect("`default` is a valid scope"))
    }

    /// Parses API keys: one `SCOPE API_KEY` pair per line (separated by spaces or a tab);
    /// blank lines and lines starting with `#` are skipped. `origin` names the source in errors.
    pub fn parse_keys(text: &str, origin: &str) -> Result<Self, AuthConfigError> {
        let mut keys = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("{origin} line {}", n + 1);
            let mut parts = line.split_whitespace();
            let (Some(scope), Some(key), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(AuthConfigError(format!(
                    "{at}: expected `SCOPE API_KEY`, two fields separated by spaces"
                )));
            };
            let scope = Scope::new(scope)
                .map_err(|e| AuthConfigError(format!("{at}: invalid scope: {e}")))?;
            // The scope is not repeated: in a file whose columns were swapped it is the key.
            if let Some(why) = reserved(scope.as_str()) {
                return Err(AuthConfigError(format!(
                    "{at}: the scope is reserved: {why}; choose another name"
                )));
            }
            if key.len() < 16 {
                return Err(AuthConfigError(format!(
                    "{at}: the API key is shorter than 16 characters; use a long random key"
                )));
            }
            if keys.insert(hash(key), scope).is_some() {
                return Err(AuthConfigError(format!(
                    "{at}: this API key is already listed"
                )));
            }
        }
        if keys.is_empty() {
            return Err(AuthConfigError(format!("{origin} lists no API keys")));
        }
        Ok(Auth::Keys(keys))
    }

    /// Reads API keys from a file (see [`Auth::parse_keys`]).
    pub fn from_file(path: &Path) -> Result<Self, AuthConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            AuthConfigError(format!("cannot read API keys file {}: {e}", path.display()))
        })?;
        Self::parse_keys(&text, &path.display().to_string())
    }

    /// Whether callers are anonymous.
    pub fn is_anonymous(&self) -> bool {
        matches!(self, Auth::Anonymous(_))
    }

    fn scope_for(&self, parts: &Parts) -> Result<Scope, Problem> {
        let keys = match self {
            Auth::Anonymous(scope) => return Ok(scope.clone()),
            Auth::Keys(keys) => keys,
        };
        let unauthorized = |detail: &str| ProblemCode::Unauthorized.problem(detail);
        if !parts.headers.contains_key(header::AUTHORIZATION) {
            return Err(unauthorized(
                "Send an API key as `Authorization: Bearer <key>`.",
            ));
        }
        let token = bearer(parts)
            .ok_or_else(|| unauthorized("The Authorization header must be `Bearer <key>`."))?;
        keys.get(&hash(token))
            .cloned()
            .ok_or_else(|| unauthorized("The API key is not known."))
    }
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The caller's scope.
    pub scope: Scope,
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Problem> {
        Ok(Caller {
            scope: state.auth.scope_for(parts)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keys_and_rejects_bad_lines() {
        let auth = Auth::parse_keys(
            "# comment\n\nshop  0123456789abcdef0123\nbank\tfedcba9876543210fedc\n",
            "keys",
        )
        .unwrap();
        let Auth::Keys(keys) = auth else { panic!() };
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[&hash("0123456789abcdef0123")].as_str(), "shop");

        for (bad, why) in [
            ("shop", "expected"),
            ("shop short", "shorter"),
            ("a b c", "expected"),
            ("sh op\u{7f} 0123456789abcdef0123", "expected"),
            ("# only comments", "no API keys"),
            (
                "a 0123456789abcdef0123\nb 0123456789abcdef0123",
                "already listed",
            ),
            ("idem.ids 0123456789abcdef0123", "idem's own"),
            ("idem.tokens 0123456789abcdef0123", "idem's own"),
            ("anonymous 0123456789abcdef0123", "reserved"),
            ("cred-3f9a 0123456789abcdef0123", "gateway"),
            ("relay 0123456789abcdef0123", "idem relay"),
            ("mq 0123456789abcdef0123", "consumers"),
        ] {
            let err = Auth::parse_keys(bad, "keys").unwrap_err().to_string();
            assert!(err.contains(why), "{bad:?}: {err}");
            assert!(!err.contains("0123456789abcdef"), "a key leaked: {err}");
        }
    }
}
