//! Where a request's scope (its caller) comes from.
//!
//! Keys are scoped: the same `Idempotency-Key` from two callers names two records, so one
//! caller can never read another's stored response by guessing or reusing its key.

use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;
use idem_core::Scope;
use sha2::{Digest, Sha256};

/// The scope of requests that carry no credential under a [`ScopeSource::Header`] source.
pub const ANONYMOUS: &str = "anonymous";

/// How the layer tells callers apart.
#[derive(Clone)]
#[non_exhaustive]
pub enum ScopeSource {
    /// A credential header (`Authorization`, `X-Api-Key`); its value is hashed, never stored.
    /// Requests without it share the scope `anonymous`.
    Header(HeaderName),
    /// One scope for every request: only for services with a single caller.
    Fixed(Scope),
    /// A function of the request, such as the tenant an authentication layer has put in the
    /// request's extensions.
    Fn(Arc<dyn Fn(&Parts) -> Scope + Send + Sync>),
}

impl Default for ScopeSource {
    /// The hashed `Authorization` header.
    fn default() -> Self {
        Self::Header(http::header::AUTHORIZATION)
    }
}

impl fmt::Debug for ScopeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => f.debug_tuple("Header").field(name).finish(),
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
        match self {
            Self::Header(name) => match parts.headers.get(name) {
                Some(value) => hashed(value.as_bytes()),
                None => Scope::new(ANONYMOUS).expect("a valid scope"),
            },
            Self::Fixed(scope) => scope.clone(),
            Self::Fn(f) => f(parts),
        }
    }
}

/// `cred-` and the first 128 bits of the credential's SHA-256, in hex.
fn hashed(credential: &[u8]) -> Scope {
    let digest = Sha256::new()
        .chain_update(b"idem-http scope\0")
        .chain_update(credential)
        .finalize();
    let mut s = String::with_capacity(5 + 32);
    s.push_str("cred-");
    for b in &digest[..16] {
        s.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        s.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    Scope::new(s).expect("a valid scope")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(auth: Option<&str>) -> Parts {
        let mut b = Request::builder();
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn header_scopes_are_hashed_and_distinct() {
        let s = ScopeSource::default();
        let a = s.scope_of(&parts(Some("Bearer alice-secret")));
        let b = s.scope_of(&parts(Some("Bearer bob-secret")));
        assert_ne!(a, b);
        assert_eq!(a, s.scope_of(&parts(Some("Bearer alice-secret"))));
        assert!(!a.as_str().contains("alice"));
        assert_eq!(s.scope_of(&parts(None)).as_str(), ANONYMOUS);
    }
}
