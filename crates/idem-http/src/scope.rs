//! Where a request's scope (its caller) comes from.
//!
//! Keys are scoped: the same `Idempotency-Key` from two callers names two records, so one
//! caller can never read another's stored response by guessing or reusing its key.
//!
//! A credential header's value is hashed into the scope, never stored. The plain hash
//! ([`ScopeSource::Header`]) is stable across deployments, so anyone holding a logged scope can
//! test guesses of a weak credential against it: it is kept out of logs ([`ScopeSource::log_form`]
//! withholds it). The keyed hash ([`ScopeSource::KeyedHeader`]) mixes in a secret of the
//! deployment (HMAC-SHA-256), so a scope says nothing to someone without the secret and is
//! safe to log.

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, LazyLock};

use hmac::{KeyInit, Mac};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, header};
use idem_core::Fingerprint;
use idem_core::Scope;

/// The scope of requests that carry no credential under a header source.
pub const ANONYMOUS: &str = "anonymous";

/// The start of every scope hashed from a credential (`cred-…`).
pub const CREDENTIAL_PREFIX: &str = "cred-";

/// What [`ScopeSource::log_form`] writes in place of a scope that must not be logged.
pub const WITHHELD: &str = "withheld";

/// The shortest [`ScopeSecret`] accepted, in bytes.
pub const MIN_SCOPE_SECRET_LEN: usize = 32;

/// How the layer tells callers apart.
#[derive(Clone)]
#[non_exhaustive]
pub enum ScopeSource {
    /// A credential header (`Authorization`, `X-Api-Key`); its value is hashed (SHA-256),
    /// never stored. Requests without it share the scope `anonymous`. The scope is kept out of
    /// logs, since a plain hash of a weak credential can be guessed back.
    Header(HeaderName),
    /// A credential header, hashed with a secret of the deployment (HMAC-SHA-256): scopes can
    /// be logged. Every instance sharing a store needs the same secret, since the scope names
    /// the records.
    KeyedHeader(HeaderName, ScopeSecret),
    /// One scope for every request: only for services with a single caller.
    Fixed(Scope),
    /// A function of the request, such as the tenant an authentication layer has put in the
    /// request's extensions.
    Fn(Arc<dyn Fn(&Parts) -> Scope + Send + Sync>),
}

impl Default for ScopeSource {
    /// The hashed `Authorization` header.
    fn default() -> Self {
        Self::Header(header::AUTHORIZATION)
    }
}

impl fmt::Debug for ScopeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => f.debug_tuple("Header").field(name).finish(),
            Self::KeyedHeader(name, secret) => f
                .debug_tuple("KeyedHeader")
                .field(name)
                .field(secret)
                .finish(),
            Self::Fixed(scope) => f.debug_tuple("Fixed").field(scope).finish(),
            Self::Fn(_) => f.write_str("Fn(..)"),
        }
    }
}

impl ScopeSource {
    /// A scope computed by `f`.
    pub fn from_fn(f: impl Fn(&Parts) -> Scope + Send + Sync + 'static) -> Self {
        Self::Fn(Arc::new(f))
    }

    /// The scope of a request.
    pub fn scope_of(&self, parts: &Parts) -> Scope {
        static ANONYMOUS_SCOPE: LazyLock<Scope> =
            LazyLock::new(|| Scope::new(ANONYMOUS).expect("a valid scope"));
        match self {
            Self::Header(name) | Self::KeyedHeader(name, _) => {
                if self.credential_missing(&parts.headers) {
                    return ANONYMOUS_SCOPE.clone();
                }
                let values = parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(|v| canonical_credential(name, v));
                match self {
                    Self::KeyedHeader(_, secret) => keyed(secret, values),
                    _ => hashed(values),
                }
            }
            Self::Fixed(scope) => scope.clone(),
            Self::Fn(f) => f(parts),
        }
    }

    /// The credential header, for sources that read one.
    pub fn header_name(&self) -> Option<&HeaderName> {
        match self {
            Self::Header(name) | Self::KeyedHeader(name, _) => Some(name),
            Self::Fixed(_) | Self::Fn(_) => None,
        }
    }

    /// Whether a header source finds no credential in `headers`: the header is absent or
    /// every line of it is blank. Always `false` for the other sources.
    pub fn credential_missing(&self, headers: &HeaderMap) -> bool {
        self.header_name().is_some_and(|name| {
            headers
                .get_all(name)
                .iter()
                .all(|v| v.as_bytes().trim_ascii().is_empty())
        })
    }

    /// What may be written to a log for `scope`: the scope itself, except a plain hash of a
    /// credential ([`ScopeSource::Header`]), which is [`WITHHELD`].
    pub fn log_form<'a>(&self, scope: &'a Scope) -> &'a str {
        match self {
            Self::Header(_) if scope.as_str() != ANONYMOUS => WITHHELD,
            _ => scope.as_str(),
        }
    }
}

/// The secret that keys [`ScopeSource::KeyedHeader`]: at least [`MIN_SCOPE_SECRET_LEN`]
/// bytes, never printed.
#[derive(Clone)]
pub struct ScopeSecret(Arc<[u8]>);

impl ScopeSecret {
    /// A secret from its bytes; surrounding ASCII whitespace (a file's final newline) is
    /// ignored.
    pub fn new(bytes: &[u8]) -> Result<Self, ScopeSecretTooShort> {
        let bytes = bytes.trim_ascii();
        if bytes.len() < MIN_SCOPE_SECRET_LEN {
            return Err(ScopeSecretTooShort);
        }
        Ok(Self(bytes.into()))
    }
}

impl fmt::Debug for ScopeSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScopeSecret(..)")
    }
}

/// A scope secret shorter than [`MIN_SCOPE_SECRET_LEN`] bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a scope secret must be at least {MIN_SCOPE_SECRET_LEN} bytes; use a long random string \
     (openssl rand -hex 32)"
)]
pub struct ScopeSecretTooShort;

/// RFC 9110 §11.1: an authentication scheme is case-insensitive, so `bearer X` is the
/// credential `Bearer X`. In `Authorization` and `Proxy-Authorization` the scheme is written
/// the way the IANA registry spells it (or in lower case if unregistered) and separated from
/// the rest by one space; other headers are opaque. A value with no space is a scheme alone
/// only if it is a registered one: otherwise it is a bare credential (some APIs take a raw key
/// in `Authorization`), case-sensitive like any credential. A credential already spelled that
/// way is hashed as it was before this rule existed.
fn canonical_credential<'v>(name: &HeaderName, value: &'v HeaderValue) -> Cow<'v, [u8]> {
    const SCHEMES: &[&str] = &[
        "Basic",
        "Bearer",
        "Concealed",
        "Digest",
        "DPoP",
        "GNAP",
        "HOBA",
        "Mutual",
        "Negotiate",
        "OAuth",
        "PrivateToken",
        "SCRAM-SHA-1",
        "SCRAM-SHA-256",
        "vapid",
    ];
    let bytes = value.as_bytes();
    if name != header::AUTHORIZATION && name != header::PROXY_AUTHORIZATION {
        return Cow::Borrowed(bytes);
    }
    let (scheme, rest) = match bytes.iter().position(|&b| b == b' ') {
        Some(at) => (&bytes[..at], Some(bytes[at..].trim_ascii_start())),
        None => (bytes, None),
    };
    let registered = SCHEMES
        .iter()
        .find(|s| s.as_bytes().eq_ignore_ascii_case(scheme));
    let mut out = match (registered, rest) {
        (Some(s), _) => s.as_bytes().to_vec(),
        (None, Some(_)) => scheme.to_ascii_lowercase(),
        (None, None) => return Cow::Borrowed(bytes),
    };
    if let Some(rest) = rest {
        out.push(b' ');
        out.extend_from_slice(rest);
    }
    if out == bytes {
        Cow::Borrowed(bytes)
    } else {
        Cow::Owned(out)
    }
}

/// `cred-` and the first 128 bits of a SHA-256 over the credential, in hex. Every value of a
/// repeated header counts, so no caller shares a scope by adding a second line.
fn hashed<'v>(credential: impl Iterator<Item = Cow<'v, [u8]>>) -> Scope {
    let mut fp = Fingerprint::builder().part(b"idem-http scope");
    for value in credential {
        fp = fp.part(&value);
    }
    let hex = fp.finish().to_hex();
    Scope::new(format!("{CREDENTIAL_PREFIX}{}", &hex[..32])).expect("a valid scope")
}

/// `cred-` and the first 128 bits of an HMAC-SHA-256 under the secret over the credential's
/// values, each framed by its length, in hex.
fn keyed<'v>(secret: &ScopeSecret, credential: impl Iterator<Item = Cow<'v, [u8]>>) -> Scope {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&secret.0)
        .expect("HMAC takes a key of any length");
    mac.update(b"idem-http keyed scope");
    for value in credential {
        mac.update(&(value.len() as u64).to_be_bytes());
        mac.update(&value);
    }
    let tag = mac.finalize().into_bytes();
    let hex = idem_core::hex(&tag[..16]);
    Scope::new(format!("{CREDENTIAL_PREFIX}{hex}")).expect("a valid scope")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(auth: &[&str]) -> Parts {
        let mut b = Request::builder();
        for a in auth {
            b = b.header("authorization", *a);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn keyed_source(secret: &str) -> ScopeSource {
        ScopeSource::KeyedHeader(
            header::AUTHORIZATION,
            ScopeSecret::new(secret.as_bytes()).unwrap(),
        )
    }

    #[test]
    fn header_scopes_are_hashed_and_distinct() {
        let s = ScopeSource::default();
        let a = s.scope_of(&parts(&["Bearer alice-secret"]));
        let b = s.scope_of(&parts(&["Bearer bob-secret"]));
        assert_ne!(a, b);
        assert_eq!(a, s.scope_of(&parts(&["Bearer alice-secret"])));
        assert!(!a.as_str().contains("alice"));
        assert_eq!(s.scope_of(&parts(&[])).as_str(), ANONYMOUS);
        // a second credential line makes another scope, never the first line's
        let twice = parts(&["Bearer alice-secret", "Bearer bob"]);
        assert_ne!(s.scope_of(&twice), a);
        // the plain hash of a credential spelled the usual way is what it always was, so
        // existing records keep their scope
        assert_eq!(a.as_str(), "cred-10d3d4ac0bd8c325a043bc590d50be9a");
    }

    #[test]
    fn the_auth_scheme_is_case_insensitive() {
        for s in [ScopeSource::default(), keyed_source(&"k".repeat(32))] {
            let a = s.scope_of(&parts(&["Bearer alice-secret"]));
            for spelling in [
                "bearer alice-secret",
                "BEARER alice-secret",
                "bEaReR  alice-secret",
            ] {
                assert_eq!(s.scope_of(&parts(&[spelling])), a, "{spelling}");
            }
            // the credential itself is case-sensitive
            assert_ne!(s.scope_of(&parts(&["Bearer ALICE-secret"])), a);
            // so is another header's value
            let other = ScopeSource::Header(HeaderName::from_static("x-api-key"));
            let key = |v: &str| {
                let mut p = parts(&[]);
                p.headers
                    .insert("x-api-key", HeaderValue::from_str(v).unwrap());
                other.scope_of(&p)
            };
            assert_ne!(key("Bearer x"), key("bearer x"));
        }
        let unregistered = ScopeSource::default();
        assert_eq!(
            unregistered.scope_of(&parts(&["Custom-Scheme t"])),
            unregistered.scope_of(&parts(&["custom-scheme t"]))
        );
        // A registered scheme alone is still a scheme.
        assert_eq!(
            unregistered.scope_of(&parts(&["negotiate"])),
            unregistered.scope_of(&parts(&["Negotiate"]))
        );
    }

    #[test]
    fn a_bare_credential_is_case_sensitive_and_keeps_its_scope() {
        for s in [ScopeSource::default(), keyed_source(&"k".repeat(32))] {
            // A raw API key in `Authorization`, no scheme: not a scheme to fold.
            assert_ne!(
                s.scope_of(&parts(&["sk_AbC123"])),
                s.scope_of(&parts(&["sk_abc123"]))
            );
        }
        // hashed as before the scheme rule existed, so existing records keep their scope
        let bare = ScopeSource::default().scope_of(&parts(&["sk_AbC123"]));
        assert_eq!(bare, hashed([Cow::Borrowed(&b"sk_AbC123"[..])].into_iter()));
    }

    #[test]
    fn keyed_scopes_depend_on_the_secret_and_may_be_logged() {
        let one = keyed_source(&"1".repeat(32));
        let two = keyed_source(&"2".repeat(32));
        let plain = ScopeSource::default();
        let alice = parts(&["Bearer alice-secret"]);
        let (a1, a2, ap) = (
            one.scope_of(&alice),
            two.scope_of(&alice),
            plain.scope_of(&alice),
        );
        assert_ne!(a1, a2);
        assert_ne!(a1, ap);
        assert!(a1.as_str().starts_with("cred-") && a1.as_str().len() == 37);
        assert_eq!(one.scope_of(&alice), a1);
        assert_ne!(one.scope_of(&parts(&["Bearer bob"])), a1);
        assert_eq!(one.log_form(&a1), a1.as_str());
        assert_eq!(plain.log_form(&ap), WITHHELD);
        let anonymous = plain.scope_of(&parts(&[]));
        assert_eq!(plain.log_form(&anonymous), ANONYMOUS);
        assert_eq!(one.scope_of(&parts(&[])).as_str(), ANONYMOUS);
    }

    #[test]
    fn blank_credentials_are_missing() {
        let s = ScopeSource::default();
        assert!(s.credential_missing(&parts(&[]).headers));
        assert!(s.credential_missing(&parts(&[""]).headers));
        assert!(s.credential_missing(&parts(&["", " "]).headers));
        assert!(!s.credential_missing(&parts(&["", "Bearer x"]).headers));
        assert_eq!(s.scope_of(&parts(&[""])).as_str(), ANONYMOUS);
        let fixed = ScopeSource::Fixed(Scope::new("tenant").unwrap());
        assert!(!fixed.credential_missing(&parts(&[]).headers));
        assert_eq!(fixed.log_form(&Scope::new("tenant").unwrap()), "tenant");
    }

    #[test]
    fn secrets_are_long_and_never_printed() {
        assert_eq!(
            ScopeSecret::new(b"short\n").unwrap_err(),
            ScopeSecretTooShort
        );
        let s = ScopeSecret::new(format!("{}\n", "s".repeat(32)).as_bytes()).unwrap();
        assert_eq!(format!("{s:?}"), "ScopeSecret(..)");
        assert!(!format!("{:?}", keyed_source(&"s".repeat(40))).contains("sss"));
    }
}
