//! Where a request's scope (its caller) comes from.
//!
//! Keys are scoped: the same `Idempotency-Key` from two callers names two records, so one
//! caller can never read another's stored response by guessing or reusing its key.

use std::fmt;
use std::sync::{Arc, LazyLock};

use http::HeaderName;
use http::request::Parts;
use idem_core::Fingerprint;
use idem_core::Scope;

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
        static ANONYMOUS_SCOPE: LazyLock<Scope> =
            LazyLock::new(|| Scope::new(ANONYMOUS).expect("a valid scope"));
        match self {
            Self::Header(name) => {
                let values = parts.headers.get_all(name);
                if values.iter().next().is_none() {
                    return ANONYMOUS_SCOPE.clone();
                }
                hashed(values)
            }
            Self::Fixed(scope) => scope.clone(),
            Self::Fn(f) => f(parts),
        }
    }
}

/// `cred-` and the first 128 bits of a SHA-256 over the credential, in hex. Every value of a
/// repeated header counts, so no caller shares a scope by adding a second line.
fn hashed(credential: http::header::GetAll<'_, http::HeaderValue>) -> Scope {
    let mut fp = Fingerprint::builder().part(b"idem-http scope");
    for value in credential {
        fp = fp.part(value.as_bytes());
    }
    let hex = fp.finish().to_hex();
    Scope::new(format!("cred-{}", &hex[..32])).expect("a valid scope")
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
        // a second credential line makes another scope, never the first line's
        let mut twice = parts(Some("Bearer alice-secret"));
        twice.headers.append(
            "authorization",
            http::HeaderValue::from_static("Bearer bob"),
        );
        assert_ne!(s.scope_of(&twice), a);
    }
}
