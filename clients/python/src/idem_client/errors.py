"""Every problem `idem serve` answers with, as an exception.

Each error answer of the API is an RFC 9457 problem with a stable ``code``; each code is a
class here, a subclass of :class:`IdemError` (and of one of the groups below, so that a caller
can catch, say, every kind of bad input at once). A code this version does not know is an
:class:`IdemError` with that ``code``.
"""

from __future__ import annotations

from typing import Any


class IdemError(Exception):
    """An error answer of `idem serve` (or a failure to reach it: ``code`` ``unreachable``)."""

    code: str = "unknown_problem"

    def __init__(
        self,
        detail: str,
        *,
        code: str | None = None,
        status: int = 0,
        title: str = "",
        retry_after: float | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        if code is not None:
            self.code = code
        self.detail = detail
        self.status = status
        self.title = title
        #: Seconds to wait before trying again, when the server said.
        self.retry_after = retry_after
        #: The whole problem body, with any extension members.
        self.body = body or {}

    def __str__(self) -> str:
        return f"{self.code} ({self.status}): {self.detail}"


class BadInput(IdemError):
    """The request is not what the endpoint takes (a 4xx other than a conflict)."""


class Conflict(IdemError):
    """The request is well formed but conflicts with the state (409, 422)."""


class Unavailable(IdemError):
    """The server or its store cannot do it now; the same call may succeed later (503, 429)."""


class ServerFault(IdemError):
    """The server failed (500, 502, 504) or does not offer the feature (501)."""


class Unreachable(Unavailable):
    """idem serve could not be reached, or did not answer in time."""

    code = "unreachable"


class PreviousFailure(Exception):
    """A call whose first run failed with an error marked permanent: every retry of its key
    raises this, with the first run's error type and message, and never runs it again."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class LeaseLost(Exception):
    """The work outlived its lease and another attempt took the key over: its result was not
    kept (the other attempt's is). Raised by ``complete`` (and so by ``once``)."""


class InvalidRequest(BadInput):
    """400 ``invalid_request``: The request is not what the endpoint takes; the detail says what is wrong."""

    code = "invalid_request"


class NotFound(BadInput):
    """404 ``not_found``: There is no such endpoint, or no live record under the key asked about."""

    code = "not_found"


class MethodNotAllowed(BadInput):
    """405 ``method_not_allowed``: The endpoint does not take the method; the Allow header lists those it takes."""

    code = "method_not_allowed"


class Unauthorized(BadInput):
    """401 ``unauthorized``: The API key (or the gateway's admin token) is missing or not known."""

    code = "unauthorized"


class UnsupportedMediaType(BadInput):
    """415 ``unsupported_media_type``: The body is not sent as `Content-Type: application/json`."""

    code = "unsupported_media_type"


class MalformedJson(BadInput):
    """400 ``malformed_json``: The body is not valid JSON."""

    code = "malformed_json"


class BodyTooLarge(BadInput):
    """413 ``body_too_large``: The request body is larger than the limit of the endpoint or guarded route."""

    code = "body_too_large"


class BodyTimeout(BadInput):
    """408 ``body_timeout``: The request body did not arrive within the server's body timeout."""

    code = "body_timeout"


class InvalidPath(BadInput):
    """400 ``invalid_path``: A path segment does not decode: its percent-encoded bytes are not UTF-8."""

    code = "invalid_path"


class InternalError(ServerFault):
    """500 ``internal_error``: The server could not read the route's parameters."""

    code = "internal_error"


class Overloaded(Unavailable):
    """503 ``overloaded``: The server is at its connection limit (with Retry-After)."""

    code = "overloaded"


class StoreUnavailable(Unavailable):
    """503 ``store_unavailable``: The record store cannot be reached, so nothing was done; also /healthz when the store does not answer."""

    code = "store_unavailable"


class StoreError(Unavailable):
    """503 ``store_error``: The record store failed, so nothing was done; the server's log says why."""

    code = "store_error"


class StoreFull(Unavailable):
    """503 ``store_full``: The record store holds as many records as it may, so nothing was done (with Retry-After)."""

    code = "store_full"


class InvalidKey(BadInput):
    """400 ``invalid_key``: The namespace or key is empty, too long, or not visible ASCII."""

    code = "invalid_key"


class InvalidDuration(BadInput):
    """400 ``invalid_duration``: `lease_ms` or `ttl_ms` is out of its range."""

    code = "invalid_duration"


class InvalidLease(BadInput):
    """400 ``invalid_lease``: The lease is not a token `begin` returned, or a lock's `lease_ms` is out of its range."""

    code = "invalid_lease"


class InvalidFingerprint(BadInput):
    """400 ``invalid_fingerprint``: The fingerprint is empty or too long."""

    code = "invalid_fingerprint"


class InProgress(Conflict):
    """409 ``in_progress``: Another attempt with the key holds it (with Retry-After)."""

    code = "in_progress"


class FingerprintMismatch(Conflict):
    """422 ``fingerprint_mismatch``: The key was used before with a different request or fingerprint."""

    code = "fingerprint_mismatch"


class StaleLease(Conflict):
    """409 ``stale_lease``: The lease no longer holds the record (taken over, released, forgotten, or completed with another response); nothing was changed."""

    code = "stale_lease"


class InvalidStep(BadInput):
    """400 ``invalid_step``: A step name is empty, longer than 64 bytes, or has a character outside `A-Z a-z 0-9 . _ - :`."""

    code = "invalid_step"


class StepConflict(Conflict):
    """409 ``step_conflict``: A step of that name is recorded with another output or outcome; the first stays and nothing was changed."""

    code = "step_conflict"


class StepAfterUnknown(Conflict):
    """409 ``step_after_unknown``: The last recorded step's outcome is unknown: it must be run again and recorded as done before another step."""

    code = "step_after_unknown"


class StepsFull(Conflict):
    """409 ``steps_full``: The record holds as many steps as it may (64, or 1 MiB of names and outputs), or the output alone is larger."""

    code = "steps_full"


class IdempotencyKeyMissing(BadInput):
    """400 ``idempotency_key_missing``: The route requires an Idempotency-Key header and the request has none."""

    code = "idempotency_key_missing"


class IdempotencyKeyInvalid(BadInput):
    """400 ``idempotency_key_invalid``: The Idempotency-Key header is repeated, malformed, or too long."""

    code = "idempotency_key_invalid"


class IdempotencyKeyMismatch(Conflict):
    """422 ``idempotency_key_mismatch``: The key was used before with a different request (method, path, query, body or fingerprinted headers); 400 under the Stripe preset."""

    code = "idempotency_key_mismatch"


class RequestInProgress(Conflict):
    """409 ``request_in_progress``: A request with the key is still running (with Retry-After)."""

    code = "request_in_progress"


class OutcomeUnknown(Conflict):
    """409 ``outcome_unknown``: An earlier request with the key may or may not have taken effect; it is not run again until the outcome is resolved."""

    code = "outcome_unknown"


class ResponseNotReplayable(Conflict):
    """409 ``response_not_replayable``: The request with the key was processed but its response was too large to store; it is not run again."""

    code = "response_not_replayable"


class AnswerNotStored(Unavailable):
    """503 ``answer_not_stored``: The request ran, but the record store failed before its answer was stored, so the answer is not given (with Retry-After): a retry with the key is given the answer once it is stored, or runs again when the lease ends."""

    code = "answer_not_stored"


class ResponseFailed(ServerFault):
    """502 ``response_failed``: The handler's response broke off while it was read; the outcome is recorded as unknown."""

    code = "response_failed"


class HandlerFailed(ServerFault):
    """500 ``handler_failed``: The handler failed before answering; the key was released, so a retry runs again."""

    code = "handler_failed"


class RecordCorrupt(ServerFault):
    """500 ``record_corrupt``: The stored answer for the key could not be read."""

    code = "record_corrupt"


class RequestBodyUnreadable(BadInput):
    """400 ``request_body_unreadable``: The guarded request's body could not be read to its end."""

    code = "request_body_unreadable"


class AmbiguousPath(BadInput):
    """400 ``ambiguous_path``: The path is one that servers read differently (an encoded `/`, `\\` or dot segment, a `;`, a control character)."""

    code = "ambiguous_path"


class AmbiguousMethod(BadInput):
    """400 ``ambiguous_method``: The method is a standard one in other letter case (`post`): methods are case-sensitive, and some servers read it as the standard one."""

    code = "ambiguous_method"


class CredentialRequired(BadInput):
    """401 ``credential_required``: The route keeps callers apart by a header the request with an Idempotency-Key does not carry."""

    code = "credential_required"


class UpstreamUnreachable(ServerFault):
    """502 ``upstream_unreachable``: The upstream could not be reached; nothing was sent, so the key is released."""

    code = "upstream_unreachable"


class UpstreamFailed(ServerFault):
    """502 ``upstream_failed``: The connection to the upstream broke after the request was sent; the outcome is recorded as unknown."""

    code = "upstream_failed"


class UpstreamTimeout(ServerFault):
    """504 ``upstream_timeout``: The upstream did not answer in time; the outcome is recorded as unknown."""

    code = "upstream_timeout"


class AdminDisabled(BadInput):
    """403 ``admin_disabled``: The record tools were asked for, but the server has no admin token."""

    code = "admin_disabled"


class RecordNotFound(BadInput):
    """404 ``record_not_found``: There is no live record under the key asked about (for the gateway: the path, key and scope)."""

    code = "record_not_found"


class RecordToolsUnsupported(ServerFault):
    """501 ``record_tools_unsupported``: The server's store does not list, count or repair records."""

    code = "record_tools_unsupported"


class NotUnknown(Conflict):
    """409 ``not_unknown``: Only a record with an unknown outcome is reopened; this one holds something else."""

    code = "not_unknown"


class ForceRequired(Conflict):
    """409 ``force_required``: The repair names attempts in progress, which may still be working; it is refused unless it says `"force": true`."""

    code = "force_required"


class InternalRecord(BadInput):
    """403 ``internal_record``: The repair names one of idem's own records (scope `idem.…`, such as a server's Snowflake worker lease), which no repair touches."""

    code = "internal_record"


class TokenMissing(BadInput):
    """400 ``token_missing``: The route needs a one-time token and the request has none."""

    code = "token_missing"


class AlreadyUsed(Conflict):
    """409 ``already_used``: The one-time token was already used."""

    code = "already_used"


class ExpiredProblem(Conflict):
    """409 ``expired``: The one-time token expired."""

    code = "expired"


class WrongPurpose(Conflict):
    """409 ``wrong_purpose``: The one-time token was issued for another purpose."""

    code = "wrong_purpose"


class UnknownProblem(Conflict):
    """409 ``unknown``: There is no such token (or it is another caller's)."""

    code = "unknown"


class LocksUnsupported(ServerFault):
    """501 ``locks_unsupported``: The server's store does not keep locks."""

    code = "locks_unsupported"


class InvalidLockName(BadInput):
    """400 ``invalid_lock_name``: A lock name is not 1 to 128 visible ASCII characters."""

    code = "invalid_lock_name"


class InvalidLock(BadInput):
    """400 ``invalid_lock``: `lock` is not a handle an acquire returned."""

    code = "invalid_lock"


class InvalidOwner(BadInput):
    """400 ``invalid_owner``: The owner id is not a valid one."""

    code = "invalid_owner"


class InvalidWait(BadInput):
    """400 ``invalid_wait``: `wait_ms` is over one minute."""

    code = "invalid_wait"


class LockHeld(Conflict):
    """409 ``lock_held``: Another owner holds the lock, or held it for as long as the request waited."""

    code = "lock_held"


class NotOwner(Conflict):
    """409 ``not_owner``: The handle does not hold the lock: released, run out, or taken by another owner since."""

    code = "not_owner"


class LockError(ServerFault):
    """500 ``lock_error``: The lock operation failed otherwise."""

    code = "lock_error"


class InvalidCount(BadInput):
    """400 ``invalid_count``: `count` is not a whole number in its range."""

    code = "invalid_count"


class InvalidTag(BadInput):
    """400 ``invalid_tag``: The segment tag is not a valid one."""

    code = "invalid_tag"


class TagQuotaExceeded(Unavailable):
    """429 ``tag_quota_exceeded``: The caller holds as many segment tags as it may, each used recently."""

    code = "tag_quota_exceeded"


class TooManyTags(Unavailable):
    """503 ``too_many_tags``: The server serves as many segment tags as it may, and all are in use."""

    code = "too_many_tags"


class NoWorkerId(Unavailable):
    """503 ``no_worker_id``: The server holds no Snowflake worker id: started without a pool, or claiming one now."""

    code = "no_worker_id"


class WorkerLeaseExpired(Unavailable):
    """503 ``worker_lease_expired``: The worker id's lease could not be renewed in time (with Retry-After)."""

    code = "worker_lease_expired"


class WorkerLost(Unavailable):
    """503 ``worker_lost``: The server's worker id was lost; it issues no more Snowflake ids."""

    code = "worker_lost"


class IdsUnavailable(Unavailable):
    """503 ``ids_unavailable``: No ids could be issued for another reason; the detail says which."""

    code = "ids_unavailable"


class IdsBusy(Unavailable):
    """503 ``ids_busy``: Ids are asked for faster than the server can issue them (with Retry-After)."""

    code = "ids_busy"


#: Every code of the catalogue, with its class.
BY_CODE: dict[str, type[IdemError]] = {
    cls.code: cls
    for cls in [
        InvalidRequest,
        NotFound,
        MethodNotAllowed,
        Unauthorized,
        UnsupportedMediaType,
        MalformedJson,
        BodyTooLarge,
        BodyTimeout,
        InvalidPath,
        InternalError,
        Overloaded,
        StoreUnavailable,
        StoreError,
        StoreFull,
        InvalidKey,
        InvalidDuration,
        InvalidLease,
        InvalidFingerprint,
        InProgress,
        FingerprintMismatch,
        StaleLease,
        InvalidStep,
        StepConflict,
        StepAfterUnknown,
        StepsFull,
        IdempotencyKeyMissing,
        IdempotencyKeyInvalid,
        IdempotencyKeyMismatch,
        RequestInProgress,
        OutcomeUnknown,
        ResponseNotReplayable,
        AnswerNotStored,
        ResponseFailed,
        HandlerFailed,
        RecordCorrupt,
        RequestBodyUnreadable,
        AmbiguousPath,
        AmbiguousMethod,
        CredentialRequired,
        UpstreamUnreachable,
        UpstreamFailed,
        UpstreamTimeout,
        AdminDisabled,
        RecordNotFound,
        RecordToolsUnsupported,
        NotUnknown,
        ForceRequired,
        InternalRecord,
        TokenMissing,
        AlreadyUsed,
        ExpiredProblem,
        WrongPurpose,
        UnknownProblem,
        LocksUnsupported,
        InvalidLockName,
        InvalidLock,
        InvalidOwner,
        InvalidWait,
        LockHeld,
        NotOwner,
        LockError,
        InvalidCount,
        InvalidTag,
        TagQuotaExceeded,
        TooManyTags,
        NoWorkerId,
        WorkerLeaseExpired,
        WorkerLost,
        IdsUnavailable,
        IdsBusy,
    ]
}


def from_problem(status: int, body: dict[str, Any], retry_after: float | None) -> IdemError:
    """The exception for a problem answer."""
    code = str(body.get("code", "unknown_problem"))
    cls = BY_CODE.get(code, IdemError)
    err = cls(
        str(body.get("detail", "")),
        code=code,
        status=status,
        title=str(body.get("title", "")),
        retry_after=retry_after,
        body=body,
    )
    return err
