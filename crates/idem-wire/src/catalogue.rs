//! The catalogue of problem codes: every `code` an idem HTTP answer (the layer, `idem serve`
//! and `idem gateway`) carries, with its status, title, and when it happens.
//!
//! A code is a promise to clients: they branch on it, so it never changes meaning. The
//! user guide lists the same table (a test keeps the two equal). `idem_http::Problem` builds
//! an answer from a code; clients and relays read answers by the same codes ([`crate::read`]).

use http::StatusCode;

/// Declares the catalogue once: each row gives the variant, status, code, title, and when it
/// happens (which is also the variant's documentation).
macro_rules! catalogue {
    ($($variant:ident = ($status:ident, $code:literal, $title:literal, $meaning:literal);)*) => {
        /// A stable problem code, with its HTTP status, title and meaning.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ProblemCode {
            $(#[doc = $meaning] $variant,)*
        }

        impl ProblemCode {
            /// Every code, in the catalogue's order.
            pub const ALL: &'static [ProblemCode] = &[$(Self::$variant,)*];

            /// The code as clients see it (`code`, and the end of `type`).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $code,)*
                }
            }

            /// The status the code is answered with.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(Self::$variant => StatusCode::$status,)*
                }
            }

            /// The short title, the same for every answer with the code.
            pub const fn title(self) -> &'static str {
                match self {
                    $(Self::$variant => $title,)*
                }
            }

            /// When the code is answered, in a sentence.
            pub const fn meaning(self) -> &'static str {
                match self {
                    $(Self::$variant => $meaning,)*
                }
            }
        }
    };
}

catalogue! {
    // Any endpoint.
    InvalidRequest = (BAD_REQUEST, "invalid_request", "Invalid request",
        "The request is not what the endpoint takes; the detail says what is wrong.");
    NotFound = (NOT_FOUND, "not_found", "Not found",
        "There is no such endpoint, or no live record under the key asked about.");
    MethodNotAllowed = (METHOD_NOT_ALLOWED, "method_not_allowed", "Method not allowed",
        "The endpoint does not take the method; the Allow header lists those it takes.");
    Unauthorized = (UNAUTHORIZED, "unauthorized", "Unauthorized",
        "The API key (or the gateway's admin token) is missing or not known.");
    UnsupportedMediaType = (UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", "Unsupported media type",
        "The body is not sent as `Content-Type: application/json`.");
    MalformedJson = (BAD_REQUEST, "malformed_json", "Malformed JSON",
        "The body is not valid JSON.");
    BodyTooLarge = (PAYLOAD_TOO_LARGE, "body_too_large", "Request body too large",
        "The request body is larger than the limit of the endpoint or guarded route.");
    BodyTimeout = (REQUEST_TIMEOUT, "body_timeout", "Body too slow",
        "The request body did not arrive within the server's body timeout.");
    InvalidPath = (BAD_REQUEST, "invalid_path", "Invalid path",
        "A path segment does not decode: its percent-encoded bytes are not UTF-8.");
    InternalError = (INTERNAL_SERVER_ERROR, "internal_error", "Internal error",
        "The server could not read the route's parameters.");
    Overloaded = (SERVICE_UNAVAILABLE, "overloaded", "Overloaded",
        "The server is at its connection limit (with Retry-After).");
    // The record store.
    StoreUnavailable = (SERVICE_UNAVAILABLE, "store_unavailable", "Store unavailable",
        "The record store cannot be reached, so nothing was done; also /healthz when the store does not answer.");
    StoreError = (SERVICE_UNAVAILABLE, "store_error", "Store error",
        "The record store failed, so nothing was done; the server's log says why.");
    StoreFull = (SERVICE_UNAVAILABLE, "store_full", "Store full",
        "The record store holds as many records as it may, so nothing was done (with Retry-After).");
    // The record API of `idem serve`.
    InvalidKey = (BAD_REQUEST, "invalid_key", "Invalid key",
        "The namespace or key is empty, too long, or not visible ASCII.");
    InvalidDuration = (BAD_REQUEST, "invalid_duration", "Invalid duration",
        "`lease_ms` or `ttl_ms` is out of its range.");
    InvalidLease = (BAD_REQUEST, "invalid_lease", "Invalid lease",
        "The lease is not a token `begin` returned, or a lock's `lease_ms` is out of its range.");
    InvalidFingerprint = (BAD_REQUEST, "invalid_fingerprint", "Invalid fingerprint",
        "The fingerprint is empty or too long.");
    InProgress = (CONFLICT, "in_progress", "Request in progress",
        "Another attempt with the key holds it (with Retry-After).");
    FingerprintMismatch = (UNPROCESSABLE_ENTITY, "fingerprint_mismatch", "Key reused with a different request",
        "The key was used before with a different request or fingerprint.");
    StaleLease = (CONFLICT, "stale_lease", "Stale lease",
        "The lease no longer holds the record (taken over, released, forgotten, or completed with another response); nothing was changed.");
    InvalidStep = (BAD_REQUEST, "invalid_step", "Invalid step",
        "A step name is empty, longer than 64 bytes, or has a character outside `A-Z a-z 0-9 . _ - :`.");
    StepConflict = (CONFLICT, "step_conflict", "Step recorded otherwise",
        "A step of that name is recorded with another output or outcome; the first stays and nothing was changed.");
    StepAfterUnknown = (CONFLICT, "step_after_unknown", "Step outcome unknown",
        "The last recorded step's outcome is unknown: it must be run again and recorded as done before another step.");
    StepsFull = (CONFLICT, "steps_full", "Steps full",
        "The record holds as many steps as it may (64, or 1 MiB of names and outputs), or the output alone is larger.");
    // Guarded routes: the `idem-http` layer and `idem gateway`.
    IdempotencyKeyMissing = (BAD_REQUEST, "idempotency_key_missing", "Idempotency-Key required",
        "The route requires an Idempotency-Key header and the request has none.");
    IdempotencyKeyInvalid = (BAD_REQUEST, "idempotency_key_invalid", "Invalid Idempotency-Key",
        "The Idempotency-Key header is repeated, malformed, or too long.");
    IdempotencyKeyMismatch = (UNPROCESSABLE_ENTITY, "idempotency_key_mismatch", "Idempotency-Key reused",
        "The key was used before with a different request (method, path, query, body or fingerprinted headers); 400 under the Stripe preset.");
    RequestInProgress = (CONFLICT, "request_in_progress", "Request in progress",
        "A request with the key is still running (with Retry-After).");
    OutcomeUnknown = (CONFLICT, "outcome_unknown", "Outcome unknown",
        "An earlier request with the key may or may not have taken effect; it is not run again until the outcome is resolved.");
    ResponseNotReplayable = (CONFLICT, "response_not_replayable", "Response not replayable",
        "The request with the key was processed but its response was too large to store; it is not run again.");
    AnswerNotStored = (SERVICE_UNAVAILABLE, "answer_not_stored", "Answer not stored",
        "The request ran, but the record store failed before its answer was stored, so the answer is not given (with Retry-After): a retry with the key is given the answer once it is stored, or runs again when the lease ends.");
    ResponseFailed = (BAD_GATEWAY, "response_failed", "Response failed",
        "The handler's response broke off while it was read; the outcome is recorded as unknown.");
    HandlerFailed = (INTERNAL_SERVER_ERROR, "handler_failed", "Handler failed",
        "The handler failed before answering; the key was released, so a retry runs again.");
    RecordCorrupt = (INTERNAL_SERVER_ERROR, "record_corrupt", "Stored record unreadable",
        "The stored answer for the key could not be read.");
    RequestBodyUnreadable = (BAD_REQUEST, "request_body_unreadable", "Invalid request",
        "The guarded request's body could not be read to its end.");
    // `idem gateway`.
    AmbiguousPath = (BAD_REQUEST, "ambiguous_path", "Ambiguous path",
        "The path is one that servers read differently (an encoded `/`, `\\` or dot segment, a `;`, a control character).");
    AmbiguousMethod = (BAD_REQUEST, "ambiguous_method", "Ambiguous method",
        "The method is a standard one in other letter case (`post`): methods are case-sensitive, and some servers read it as the standard one.");
    CredentialRequired = (UNAUTHORIZED, "credential_required", "Credential required",
        "The route keeps callers apart by a header the request with an Idempotency-Key does not carry.");
    UpstreamUnreachable = (BAD_GATEWAY, "upstream_unreachable", "Upstream unreachable",
        "The upstream could not be reached; nothing was sent, so the key is released.");
    UpstreamFailed = (BAD_GATEWAY, "upstream_failed", "Upstream failed",
        "The connection to the upstream broke after the request was sent; the outcome is recorded as unknown.");
    UpstreamTimeout = (GATEWAY_TIMEOUT, "upstream_timeout", "Upstream timed out",
        "The upstream did not answer in time; the outcome is recorded as unknown.");
    AdminDisabled = (FORBIDDEN, "admin_disabled", "Admin endpoints disabled",
        "The record tools were asked for, but the server has no admin token.");
    RecordNotFound = (NOT_FOUND, "record_not_found", "No such record",
        "There is no live record under the key asked about (for the gateway: the path, key and scope).");
    RecordToolsUnsupported = (NOT_IMPLEMENTED, "record_tools_unsupported", "Record tools unsupported",
        "The server's store does not list, count or repair records.");
    NotUnknown = (CONFLICT, "not_unknown", "Outcome not unknown",
        "Only a record with an unknown outcome is reopened; this one holds something else.");
    ForceRequired = (CONFLICT, "force_required", "Force required",
        "The repair names attempts in progress, which may still be working; it is refused unless it says `\"force\": true`.");
    InternalRecord = (FORBIDDEN, "internal_record", "idem's own record",
        "The repair names one of idem's own records (scope `idem.…`, such as a server's Snowflake worker lease), which no repair touches.");
    // One-time tokens.
    TokenMissing = (BAD_REQUEST, "token_missing", "Token missing",
        "The route needs a one-time token and the request has none.");
    TokenAlreadyUsed = (CONFLICT, "already_used", "Token refused",
        "The one-time token was already used.");
    TokenExpired = (CONFLICT, "expired", "Token refused",
        "The one-time token expired.");
    TokenWrongPurpose = (CONFLICT, "wrong_purpose", "Token refused",
        "The one-time token was issued for another purpose.");
    TokenUnknown = (CONFLICT, "unknown", "Token refused",
        "There is no such token (or it is another caller's).");
    // Locks.
    LocksUnsupported = (NOT_IMPLEMENTED, "locks_unsupported", "Locks unsupported",
        "The server's store does not keep locks.");
    InvalidLockName = (BAD_REQUEST, "invalid_lock_name", "Invalid lock name",
        "A lock name is not 1 to 128 visible ASCII characters.");
    InvalidLock = (BAD_REQUEST, "invalid_lock", "Invalid lock",
        "`lock` is not a handle an acquire returned.");
    InvalidOwner = (BAD_REQUEST, "invalid_owner", "Invalid owner",
        "The owner id is not a valid one.");
    InvalidWait = (BAD_REQUEST, "invalid_wait", "Invalid wait",
        "`wait_ms` is over one minute.");
    LockHeld = (CONFLICT, "lock_held", "Lock held",
        "Another owner holds the lock, or held it for as long as the request waited.");
    NotOwner = (CONFLICT, "not_owner", "Not the owner",
        "The handle does not hold the lock: released, run out, or taken by another owner since.");
    LockError = (INTERNAL_SERVER_ERROR, "lock_error", "Lock error",
        "The lock operation failed otherwise.");
    // Ids.
    InvalidCount = (BAD_REQUEST, "invalid_count", "Invalid count",
        "`count` is not a whole number in its range.");
    InvalidTag = (BAD_REQUEST, "invalid_tag", "Invalid tag",
        "The segment tag is not a valid one.");
    TagQuotaExceeded = (TOO_MANY_REQUESTS, "tag_quota_exceeded", "Tag quota exceeded",
        "The caller holds as many segment tags as it may, each used recently.");
    TooManyTags = (SERVICE_UNAVAILABLE, "too_many_tags", "Ids unavailable",
        "The server serves as many segment tags as it may, and all are in use.");
    NoWorkerId = (SERVICE_UNAVAILABLE, "no_worker_id", "Ids unavailable",
        "The server holds no Snowflake worker id: started without a pool, or claiming one now.");
    WorkerLeaseExpired = (SERVICE_UNAVAILABLE, "worker_lease_expired", "Ids unavailable",
        "The worker id's lease could not be renewed in time (with Retry-After).");
    WorkerLost = (SERVICE_UNAVAILABLE, "worker_lost", "Ids unavailable",
        "The server's worker id was lost; it issues no more Snowflake ids.");
    IdsUnavailable = (SERVICE_UNAVAILABLE, "ids_unavailable", "Ids unavailable",
        "No ids could be issued for another reason; the detail says which.");
    IdsBusy = (SERVICE_UNAVAILABLE, "ids_busy", "Ids unavailable",
        "Ids are asked for faster than the server can issue them (with Retry-After).");
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn each_code_is_listed_once_and_reads_back() {
        let mut seen = HashSet::new();
        for &c in ProblemCode::ALL {
            assert!(seen.insert(c.as_str()), "{} is listed twice", c.as_str());
            assert!(
                !c.meaning().contains('|'),
                "{} would break the README table",
                c.as_str()
            );
        }
    }
}
