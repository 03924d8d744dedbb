//! One-time tokens: issued for a purpose and a caller, consumed exactly once.
//!
//! The seeds' double-submit guard ("issue a token with the form; delete it on use") done so
//! that two submissions racing cannot both pass: consuming is one atomic step in the store
//! (`Store::release_completed` of the token's record by its fence: issued is completed, used is
//! released), so of any number of concurrent consumers exactly one wins. A second use, an expired token, another purpose and another
//! caller are refused, each with its own reason.
//!
//! Tokens are 128 random bits (32 hex digits). The store keeps only their SHA-256: a token is
//! looked up by its hash, so no secret is ever compared byte by byte, and a copy of the store
//! gives no usable token. An unused token is remembered for `grace` (default 1 h) past its
//! expiry, and a used one for its TTL plus `grace` past its use, so a late second use is still
//! told apart from a made-up token.

use std::sync::Arc;
use std::time::Duration;

use crate::{
    BeginOutcome, BeginRequest, Bytes, Clock, Fingerprint, Key, SharedStore, Status, Store,
    StoreError, Timestamp,
};
use serde::{Deserialize, Serialize};

/// Why a token was not consumed.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// It was consumed before.
    #[error("the token was already used")]
    AlreadyUsed,
    /// Its time ran out.
    #[error("the token expired")]
    Expired,
    /// It was issued for another purpose (it stays usable for that one).
    #[error("the token was issued for another purpose")]
    WrongPurpose,
    /// It was issued to another caller.
    #[error("the token was issued to another caller")]
    WrongScope,
    /// No such token (never issued, or forgotten long after it expired).
    #[error("no such token")]
    Unknown,
    /// A purpose (1 to 128 visible ASCII characters) or scope (1 to 255, as a
    /// [`Scope`](crate::Scope)) that cannot be used.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// The store failed; nothing was consumed, or it is not known whether it was.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What the store keeps beside a token's hash.
#[derive(Serialize, Deserialize)]
struct Issued {
    purpose: String,
    expires_at: u64,
}

/// A token just issued.
#[derive(Debug, Clone)]
pub struct IssuedToken {
    /// The token itself: give it to the client; it is not stored anywhere.
    pub token: String,
    /// When it stops being accepted.
    pub expires_at: Timestamp,
}

/// Issues and consumes one-time tokens in a store.
#[derive(Clone)]
pub struct Tokens {
    store: SharedStore,
    clock: Arc<dyn Clock>,
    grace: Duration,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

/// The longest purpose.
const MAX_PURPOSE: usize = 128;

/// Checks a purpose: 1 to [`MAX_PURPOSE`] visible ASCII characters.
fn purpose_ok(s: &str) -> Result<(), TokenError> {
    if s.is_empty() || s.len() > MAX_PURPOSE || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::Invalid("purpose"));
    }
    Ok(())
}

/// Stands for the caller a token was issued to. Kept as the record's fingerprint, which
/// (unlike the response) outlives consumption, so a used token is still told to be another
/// caller's rather than used.
fn owner(scope: &str) -> Fingerprint {
    Fingerprint::builder()
        .part(b"idem token owner")
        .part(scope.as_bytes())
        .finish()
}

/// The record of a token: under one fixed scope (so another caller's use is recognised as
/// such), named by the token's hash.
fn key_of(token: &str) -> Key {
    let hash = Fingerprint::builder()
        .part(b"idem one-time token")
        .part(token.as_bytes())
        .finish()
        .to_hex();
    Key::parse("idem.tokens", "token", &hash).expect("a hex digest is a valid key")
}

impl Tokens {
    /// Tokens in `store`, on `clock`.
    pub fn new(store: SharedStore, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            clock,
            grace: Duration::from_secs(3600),
        }
    }

    /// How long a used or expired token is remembered after it expires.
    #[must_use]
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Issues a token for `purpose` to the caller `scope`, accepted for `ttl`.
    pub async fn issue(
        &self,
        scope: &str,
        purpose: &str,
        ttl: Duration,
    ) -> Result<IssuedToken, TokenError> {
        // Any caller's scope, as a key's scope is checked (the HTTP API's are up to 255).
        crate::Scope::new(scope).map_err(|_| TokenError::Invalid("scope"))?;
        purpose_ok(purpose)?;
        let token = crate::random_hex128();
        let now = self.clock.now();
        let expires_at = now.saturating_add(ttl);
        let key = key_of(&token);
        let req = BeginRequest::new(key.clone(), owner(scope))
            .with_lease(Duration::from_secs(60))
            .with_ttl(ttl.saturating_add(self.grace));
        let BeginOutcome::Acquired(lease) = self.store.begin(&req, now).await? else {
            // 128 random bits do not collide; a store that says so is not to be trusted.
            return Err(TokenError::Store(StoreError::Corrupt(
                "a fresh token's record already exists".into(),
            )));
        };
        let issued = Issued {
            purpose: purpose.to_owned(),
            expires_at: expires_at.as_millis(),
        };
        let body = serde_json::to_vec(&issued).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.store
            .complete(&key, &lease, Bytes::from(body), now)
            .await
            .map_err(|e| match e {
                crate::LeaseError::Store(s) => s,
                other => StoreError::Corrupt(other.to_string()),
            })?;
        Ok(IssuedToken { token, expires_at })
    }

    /// Consumes `token` for `purpose` on behalf of the caller `scope`: exactly one consumer
    /// of a token ever gets `Ok`.
    ///
    /// Dropped before it answers, it leaves the token unused, or used as if it had answered
    /// `Ok` (its one writing step reached the store): never half used.
    pub async fn consume(&self, scope: &str, token: &str, purpose: &str) -> Result<(), TokenError> {
        // Not a token of ours: no need to ask the store.
        if token.len() != 32 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(TokenError::Unknown);
        }
        let key = key_of(&token.to_ascii_lowercase());
        let now = self.clock.now();
        let Some(record) = self.store.get(&key, now).await? else {
            return Err(TokenError::Unknown);
        };
        if record.fingerprint != owner(scope) {
            return Err(TokenError::WrongScope);
        }
        match record.status {
            Status::Released => return Err(TokenError::AlreadyUsed),
            Status::InProgress => return Err(TokenError::Unknown),
            Status::Completed => {}
        }
        let issued: Issued = record
            .response
            .as_deref()
            .and_then(|b| serde_json::from_slice(b).ok())
            .ok_or_else(|| StoreError::Corrupt("a token record is not readable".into()))?;
        if issued.purpose != purpose {
            return Err(TokenError::WrongPurpose);
        }
        if now.as_millis() >= issued.expires_at {
            return Err(TokenError::Expired);
        }
        // The one atomic step: only one release of this completion succeeds.
        if self
            .store
            .release_completed(&key, record.fence, now)
            .await?
        {
            Ok(())
        } else {
            Err(TokenError::AlreadyUsed)
        }
    }
}
