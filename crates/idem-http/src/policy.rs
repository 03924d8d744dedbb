//! What a guarded route does: which methods, whether a key is required, what is stored.

use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
pub use idem_claim::InFlight;
use idem_core::Namespace;

/// Which rules to follow where the IETF draft and Stripe differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Preset {
    /// The IETF httpapi draft: a reused key with another request is 422; 5xx answers are not
    /// stored, so a retry runs the request again.
    #[default]
    Ietf,
    /// Stripe's behaviour: a reused key with another request is 400; 5xx answers are stored
    /// and replayed like any other.
    Stripe,
}

impl Preset {
    /// The status of a reused key with a different request.
    pub fn mismatch_status(self) -> StatusCode {
        match self {
            Self::Ietf => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Stripe => StatusCode::BAD_REQUEST,
        }
    }

    /// Whether a handler's answer with `status` is stored (and replayed) rather than releasing
    /// the key. 408, 425 and 429 say the request was not processed, so they are never stored.
    pub fn stores(self, status: StatusCode) -> bool {
        match status.as_u16() {
            408 | 425 | 429 => false,
            500..=599 => self == Self::Stripe,
            _ => true,
        }
    }
}

/// Whether a guarded route needs an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyRequirement {
    /// Without the header the request passes through unguarded.
    #[default]
    Optional,
    /// Without the header the request is refused with 400 `idempotency_key_missing`.
    Required,
}

/// What a record whose outcome is unknown (the request may or may not have taken effect:
/// an upstream that timed out after the request was sent) answers to a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnUnknown {
    /// Refuse retries with 409 `outcome_unknown` until the record expires or an operator
    /// reopens it. Never runs the request twice.
    #[default]
    Hold,
    /// Refuse retries with 409 `outcome_unknown` until the attempt's lease would have ended,
    /// then run the request again (at-least-once).
    ReleaseAfterLease,
}

/// Which response headers are stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReplayHeaders {
    /// Every header except hop-by-hop ones, `Date`, `Set-Cookie` and `Content-Length`.
    #[default]
    Default,
    /// Only these (hop-by-hop headers and `Content-Length` are never stored).
    Only(Vec<HeaderName>),
}

impl ReplayHeaders {
    /// Whether `name` is stored.
    pub fn keeps(&self, name: &HeaderName) -> bool {
        if is_hop_by_hop(name) || name == http::header::CONTENT_LENGTH {
            return false;
        }
        match self {
            Self::Default => name != http::header::DATE && name != http::header::SET_COOKIE,
            Self::Only(names) => names.contains(name),
        }
    }
}

/// RFC 9110 §7.6.1: removes the fields that describe one connection: the fixed hop-by-hop
/// ones and those the `Connection` field names.
pub fn remove_hop_by_hop(headers: &mut http::HeaderMap) {
    let nominated: Vec<HeaderName> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in nominated {
        headers.remove(name);
    }
    let fixed: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    for name in fixed {
        headers.remove(name);
    }
}

/// The fixed hop-by-hop fields of RFC 9110 §7.6.1 (and the old `Keep-Alive` and
/// `Proxy-Connection`); see [`remove_hop_by_hop`] for the ones `Connection` names.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    use http::header::{
        CONNECTION, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER, TRANSFER_ENCODING,
        UPGRADE,
    };
    [
        CONNECTION,
        PROXY_AUTHENTICATE,
        PROXY_AUTHORIZATION,
        TE,
        TRAILER,
        TRANSFER_ENCODING,
        UPGRADE,
    ]
    .contains(name)
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// The settings of one guarded route. Start from [`Policy::default`] and change what differs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Policy {
    /// The guarded methods (POST and PATCH by default); others pass through untouched.
    pub methods: Vec<Method>,
    /// Whether the key is required.
    pub key: KeyRequirement,
    /// IETF or Stripe rules.
    pub preset: Preset,
    /// The namespace of this route's keys: routes that share one share keys.
    pub namespace: Namespace,
    /// How long a stored answer is replayed (24 h by default).
    pub ttl: Duration,
    /// How long an attempt holds the key before another may take over (60 s by default). It
    /// must exceed the longest time the handler may run.
    pub lease: Duration,
    /// Reject or wait when the key is held.
    pub in_flight: InFlight,
    /// Request headers that are part of the fingerprint.
    pub fingerprint_headers: Vec<HeaderName>,
    /// If set, only these JSON Pointers of a JSON body are fingerprinted (with method, path and
    /// query), so fields such as timestamps may differ between retries.
    pub fingerprint_json_fields: Option<Vec<String>>,
    /// Which response headers are replayed.
    pub replay_headers: ReplayHeaders,
    /// The largest request body accepted on a guarded request (413 beyond); 1 MiB by default.
    pub max_body: usize,
    /// The largest response body stored; 1 MiB by default. A larger answer is delivered to
    /// the first caller and recorded as not replayable (retries get 409
    /// `response_not_replayable`), never run again.
    pub max_response: usize,
    /// What a retry gets when the first attempt's outcome is unknown.
    pub on_unknown: OnUnknown,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            key: KeyRequirement::Optional,
            preset: Preset::Ietf,
            namespace: Namespace::new("http").expect("a valid namespace"),
            ttl: idem_core::DEFAULT_TTL,
            lease: idem_core::DEFAULT_LEASE,
            in_flight: InFlight::Reject,
            fingerprint_headers: Vec::new(),
            fingerprint_json_fields: None,
            replay_headers: ReplayHeaders::Default,
            max_body: 1 << 20,
            max_response: 1 << 20,
            on_unknown: OnUnknown::Hold,
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        impl Policy {
            $(
                $(#[$doc])*
                #[must_use]
                pub fn $name(mut self, value: $ty) -> Self {
                    self.$name = value;
                    self
                }
            )*
        }
    };
}

setters! {
    /// Sets [`Policy::key`].
    key: KeyRequirement;
    /// Sets [`Policy::preset`].
    preset: Preset;
    /// Sets [`Policy::namespace`].
    namespace: Namespace;
    /// Sets [`Policy::ttl`].
    ttl: Duration;
    /// Sets [`Policy::lease`].
    lease: Duration;
    /// Sets [`Policy::in_flight`].
    in_flight: InFlight;
    /// Sets [`Policy::replay_headers`].
    replay_headers: ReplayHeaders;
    /// Sets [`Policy::max_body`].
    max_body: usize;
    /// Sets [`Policy::max_response`].
    max_response: usize;
    /// Sets [`Policy::on_unknown`].
    on_unknown: OnUnknown;
}

impl Policy {
    /// Sets [`Policy::methods`].
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Sets [`Policy::fingerprint_headers`].
    #[must_use]
    pub fn fingerprint_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.fingerprint_headers = names.into_iter().collect();
        self
    }

    /// Sets [`Policy::fingerprint_json_fields`] (JSON Pointers such as `/amount`).
    #[must_use]
    pub fn fingerprint_json_fields<S: Into<String>>(
        mut self,
        pointers: impl IntoIterator<Item = S>,
    ) -> Self {
        self.fingerprint_json_fields = Some(pointers.into_iter().map(Into::into).collect());
        self
    }

    /// Whether requests with `method` are guarded.
    pub fn guards(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_differ_on_5xx_and_mismatch() {
        for p in [Preset::Ietf, Preset::Stripe] {
            assert!(p.stores(StatusCode::OK));
            assert!(p.stores(StatusCode::BAD_REQUEST));
            assert!(p.stores(StatusCode::CONFLICT));
            for s in [408, 425, 429] {
                assert!(!p.stores(StatusCode::from_u16(s).unwrap()));
            }
        }
        assert!(!Preset::Ietf.stores(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(Preset::Stripe.stores(StatusCode::INTERNAL_SERVER_ERROR));
        assert_eq!(
            Preset::Ietf.mismatch_status(),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(Preset::Stripe.mismatch_status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn replayed_headers() {
        let d = ReplayHeaders::Default;
        assert!(d.keeps(&http::header::CONTENT_TYPE));
        assert!(d.keeps(&HeaderName::from_static("x-request-id")));
        for h in [
            "date",
            "set-cookie",
            "connection",
            "keep-alive",
            "transfer-encoding",
            "content-length",
        ] {
            assert!(!d.keeps(&HeaderName::from_static(h)), "{h}");
        }
        let only = ReplayHeaders::Only(vec![http::header::LOCATION, http::header::CONNECTION]);
        assert!(only.keeps(&http::header::LOCATION));
        assert!(!only.keeps(&http::header::CONTENT_TYPE));
        assert!(!only.keeps(&http::header::CONNECTION));
    }
}
