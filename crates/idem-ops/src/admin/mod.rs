//! The operator's side of both servers, under the reserved prefix (`/_idem`): the admin token,
//! and the record tools over any store that offers [`idem_core::RecordAdmin`] (list, count,
//! show, repair).

pub mod answers;
pub mod http;
mod page;
pub mod records;
pub mod sampler;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use idem_core::Fingerprint;
use idem_http::{Problem, ProblemCode, ToProblem};

pub use http::{RecordTools, router};
pub use sampler::History;

/// The shortest admin token accepted.
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

/// The operator's credential, kept only as a hash.
#[derive(Clone)]
pub struct AdminToken([u8; 32]);

impl AdminToken {
    /// A token from its text (surrounding whitespace, such as a file's final newline, is
    /// ignored); at least [`MIN_ADMIN_TOKEN_LEN`] characters.
    pub fn new(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.len() < MIN_ADMIN_TOKEN_LEN || text.contains(char::is_whitespace) {
            return Err(format!(
                "the admin token must be one word of at least {MIN_ADMIN_TOKEN_LEN} characters; \
                 use a long random string"
            ));
        }
        Ok(Self(hash(text)))
    }

    /// Reads the token from a file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read admin token file {}: {e}", path.display()))?;
        Self::new(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Whether `presented` is this token. Compares hashes, in time independent of where
    /// they differ.
    fn matches(&self, presented: &str) -> bool {
        let other = hash(presented);
        self.0
            .iter()
            .zip(other.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

fn hash(text: &str) -> [u8; 32] {
    *Fingerprint::builder()
        .part(b"idem admin token")
        .part(text.as_bytes())
        .finish()
        .as_bytes()
}

/// Where an admin endpoint's state keeps the token (none: the tools are off).
pub trait AdminAccess {
    /// The token operators present.
    fn admin_token(&self) -> Option<&AdminToken>;
}

/// A request that presented the admin token.
pub struct Operator;

impl<S: AdminAccess + Send + Sync> FromRequestParts<S> for Operator {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, s: &S) -> Result<Self, Problem> {
        authorize(s, parts)
    }
}

/// The metrics text, behind the admin token when `require_token` says so.
pub fn metrics_response(
    access: &impl AdminAccess,
    require_token: bool,
    parts: &Parts,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if require_token && let Err(p) = authorize(access, parts) {
        return p.into_response();
    }
    crate::metrics::Registry::global().response()
}

/// Whether the request presented the admin token; the problem to answer if not.
pub fn authorize(s: &impl AdminAccess, parts: &Parts) -> Result<Operator, Problem> {
    let Some(token) = s.admin_token() else {
        return Err(ProblemCode::AdminDisabled.problem(
            "The record tools need an admin token: start the server with --admin-token-file \
             (admin_token_file in a gateway's config) and send it as \
             `Authorization: Bearer <token>`.",
        ));
    };
    match bearer(parts) {
        Some(p) if token.matches(p) => Ok(Operator),
        _ => Err(ProblemCode::Unauthorized
            .problem("Send the admin token as `Authorization: Bearer <token>`.")),
    }
}

/// The start of the scopes idem keeps its own records under (`idem.ids`, `idem.tokens`); no
/// API key may have one, and the record tools do not repair them.
pub const RESERVED_SCOPE_PREFIX: &str = "idem.";

/// The token of an `Authorization: Bearer <token>` header, if the request has one.
pub fn bearer(parts: &Parts) -> Option<&str> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    // RFC 9110 §11.1: the scheme name is case-insensitive.
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}
