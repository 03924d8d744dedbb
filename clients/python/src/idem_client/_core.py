"""What the sync and async clients share: request bodies, answers, retry pacing, and how a
call's result is kept. No I/O here."""

from __future__ import annotations

import json
import random
from urllib.parse import quote
from dataclasses import dataclass, field
from typing import Any

from ._http import Answer
from .errors import IdemError, PreviousFailure, from_problem

#: Calls of idem's own API are tried this many times in all when the server or its store is
#: unavailable or cannot be reached.
DEFAULT_ATTEMPTS = 5
#: The first pause between attempts, doubled each time up to ``MAX_PAUSE``, in seconds.
FIRST_PAUSE = 0.05
MAX_PAUSE = 2.0
#: Codes worth trying again as they are (the store, the server or the network was down).
#: ``unreachable`` only for calls that are safe to repeat (see ``Idem._call``).
RETRYABLE = frozenset({"store_unavailable", "overloaded", "unreachable", "ids_busy"})


@dataclass(frozen=True)
class Lease:
    """The attempt's hold on a key: its token (``id``), fence, and end."""

    id: str
    fence: int
    expires_at: str


@dataclass(frozen=True)
class Step:
    """A step an earlier attempt recorded: ``done`` with its ``output``, or not (its outcome
    is unknown: it sent a request and got no answer, so it runs again under its step key)."""

    name: str
    done: bool
    output: Any
    step_key: str


@dataclass(frozen=True)
class Acquired:
    """The key is the caller's: do the work, then complete (or release)."""

    lease: Lease
    steps: list[Step] = field(default_factory=list)
    step_keys: dict[str, str] = field(default_factory=dict)


def interrupted(error: BaseException | None) -> bool:
    """Whether a run was stopped by what is not a failure of its work: a cancellation, an
    interrupt, an exit (a ``BaseException`` that is not an ``Exception``). Its work may have
    had its effects, so its key is never released for a retry to run it again: it is kept
    until its lease ends."""
    return error is not None and not isinstance(error, Exception)


class Attempt:
    """What a run of either client does with its key: holds it until settled, and at its end
    releases it, or keeps it."""

    key: str
    lease: Lease | None
    _settled: bool

    def _held(self) -> Lease:
        if self.lease is None or self._settled:
            raise RuntimeError("this run holds no lease (it was replayed or is settled)")
        return self.lease

    def _gives_back(self, exc: BaseException | None) -> bool:
        """Whether the run, ending with ``exc`` (``None``: it ended without ``complete``),
        releases its key: not once settled, nor once :func:`interrupted` (the key is then
        kept, renewed no more, until the lease ends)."""
        if self.lease is None or self._settled:
            return False
        if interrupted(exc):
            self._settled = True
            return False
        return True


@dataclass(frozen=True)
class Replay:
    """The work was done: its stored response."""

    response: Any
    fence: int


def begin_body(
    namespace: str,
    key: str,
    request: Any,
    fingerprint: str | None,
    lease: float | None,
    ttl: float | None,
    step_keys: list[str] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"namespace": namespace, "key": key}
    if fingerprint is not None:
        body["fingerprint"] = fingerprint
    else:
        body["request"] = request
    if lease is not None:
        body["lease_ms"] = ms(lease)
    if ttl is not None:
        body["ttl_ms"] = ms(ttl)
    if step_keys:
        body["step_keys"] = step_keys
    return body


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))


def parse_begin(answer: dict[str, Any]) -> Acquired | Replay:
    if answer.get("outcome") == "replay":
        return Replay(response=answer.get("response"), fence=int(answer.get("fence", 0)))
    return Acquired(
        lease=parse_lease(answer["lease"]),
        steps=[
            Step(
                name=s["step"],
                done=s["outcome"] == "done",
                output=s.get("output"),
                step_key=s["step_key"],
            )
            for s in answer.get("steps", [])
        ],
        step_keys=dict(answer.get("step_keys") or {}),
    )


def parse_lease(lease: dict[str, Any]) -> Lease:
    return Lease(id=lease["id"], fence=int(lease["fence"]), expires_at=lease["expires_at"])


def error_of(answer: Answer) -> IdemError:
    """The exception for an answer that is not a success."""
    try:
        body = json.loads(answer.content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {
            "code": "unexpected_answer",
            "detail": f"idem answered {answer.status} without a problem body",
        }
    return from_problem(answer.status, body, retry_after(answer, body))


def retry_after(answer: Answer, body: dict[str, Any]) -> float | None:
    """The server's advice on when to try again, in seconds: ``retry_after_ms``, else the
    ``Retry-After`` header."""
    ms_value = body.get("retry_after_ms")
    if isinstance(ms_value, (int, float)):
        return float(ms_value) / 1000
    if answer.retry_after is not None:
        try:
            return float(answer.retry_after)
        except ValueError:
            return None
    return None


#: The largest request body sent: `idem serve`'s own limit by default (its ``--max-body``).
DEFAULT_MAX_BODY = 1 << 20


def too_large(content: bytes | None, max_body: int) -> IdemError | None:
    """The refusal of a request body larger than ``max_body``, made here: the server would
    refuse it, and may close the connection before its refusal can be read."""
    if content is None or len(content) <= max_body:
        return None
    detail = f"The request body ({len(content)} bytes) exceeds the limit of {max_body} bytes."
    return from_problem(413, {"code": "body_too_large", "detail": detail}, None)


def encode(body: dict[str, Any] | None) -> bytes | None:
    """A request body as JSON bytes. Raises ``TypeError`` for a value JSON cannot hold (an
    object of another type, a float such as NaN that JSON has no number for), before anything
    is sent."""
    if body is None:
        return None
    try:
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as e:
        raise TypeError(str(e)) from e


def pause(attempt: int, advice: float | None) -> float:
    """How long to wait before attempt ``attempt + 1``: the server's advice when it gave one
    (capped at ``MAX_PAUSE``), else exponential backoff with jitter."""
    if advice is not None:
        return min(max(advice, 0.0), MAX_PAUSE)
    base = min(FIRST_PAUSE * (1 << min(attempt, 30)), MAX_PAUSE)
    return base * (0.5 + random.random() / 2)


def as_json(value: Any) -> Any:
    """``value`` as JSON carries it, which is what a retry is given back: keys as strings,
    tuples as lists, subclasses as their plain types. A value JSON cannot carry is refused
    with ``TypeError``: an object of another type, NaN or an infinity, two keys that become
    one (``{1: …, "1": …}``), a string that is not Unicode text (a lone surrogate)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode()  # a lone surrogate has no UTF-8, and the server takes none
        return json.loads(text, object_pairs_hook=_members)
    except ValueError as e:  # UnicodeError is one
        raise TypeError(f"not JSON: {e}") from e


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for key, value in pairs:
        if key in members:
            raise ValueError(f"two keys become the one member {key!r}")
        members[key] = value
    return members


def default_payload(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a guarded call is fingerprinted by when no ``payload`` is given: its arguments, as
    JSON. Arguments JSON cannot carry are refused (a ``repr`` would differ from call to call,
    so a retry would not be recognised): give ``payload=`` a function of the arguments."""
    try:
        return as_json({"args": list(args), "kwargs": kwargs})
    except TypeError as e:
        raise TypeError(
            f"the call cannot be fingerprinted by its arguments ({e}): give once() a payload= "
            "function"
        ) from e


# How `once` keeps a call's result in the record's response: {"value": v} for a return value,
# {"error": {"type", "message"}} for a failure marked permanent. Other programs may read the
# record, so it is plain JSON.
def kept_value(value: Any) -> dict[str, Any]:
    return {"value": value}


def kept_failure(error: BaseException) -> dict[str, Any]:
    return {"error": {"type": type(error).__name__, "message": str(error)}}


#: The kept failure of a call whose result idem refused to store (too large, or not JSON): it
#: ran once, so it is never run again; every retry raises ``PreviousFailure`` with this type.
NOT_KEPT = "ResultNotKept"


def not_kept(error: BaseException, what: str = "the result") -> dict[str, Any]:
    return {"error": {"type": NOT_KEPT, "message": f"{what} could not be stored: {error}"}}


def record_path(namespace: str, key: str) -> str:
    """The path of a record; a name that a URL would read as a step of its path (``.`` or
    ``..``) cannot be asked for by it."""
    for part in (namespace, key):
        if part in (".", ".."):
            raise ValueError(f"a record named {part!r} cannot be read by URL")
    return f"/v1/records/{segment(namespace)}/{segment(key)}"


def segment(text: str) -> str:
    """``text`` as one path segment."""
    return quote(text, safe="")



def default_payload_fn(*args: Any, **kwargs: Any) -> Any:
    return default_payload(args, kwargs)


def result_of(response: Any) -> Any:
    """A kept result as the guarded call returns it: its value, or :class:`PreviousFailure`
    raised for a kept failure. A response another program stored is returned as it is."""
    if isinstance(response, dict) and set(response) == {"value"}:
        return response["value"]
    if isinstance(response, dict) and set(response) == {"error"}:
        error = response["error"]
        if isinstance(error, dict):
            raise PreviousFailure(str(error.get("type", "")), str(error.get("message", "")))
    return response


def in_flight_pause(attempt: int, advice: float | None, left: float) -> float:
    """How long to wait before asking again for a key another attempt holds: 50 ms, doubling
    to 1 s (the attempt may finish any moment; the server's ``Retry-After`` is when its lease
    would end, the latest it can), never past the caller's ``wait``."""
    poll = min(0.05 * (1 << min(attempt, 30)), 1.0)
    return max(0.0, min(poll, advice if advice is not None else poll, left))


def token(lease: Lease | str) -> str:
    """The lease token the API takes back."""
    return lease.id if isinstance(lease, Lease) else lease


def lease_body(namespace: str, key: str, lease: Lease | str, **more: Any) -> dict[str, Any]:
    """The body of ``step``, ``renew``, ``complete`` and ``release``."""
    return {"namespace": namespace, "key": key, "lease": token(lease), **more}


def step_body(
    namespace: str, key: str, lease: Lease | str, name: str, output: Any, unknown: bool
) -> dict[str, Any]:
    if unknown:
        return lease_body(namespace, key, lease, step=name, unknown=True)
    return lease_body(namespace, key, lease, step=name, output=output)


def renew_body(namespace: str, key: str, lease: Lease | str, length: float | None) -> dict[str, Any]:
    if length is None:
        return lease_body(namespace, key, lease)
    return lease_body(namespace, key, lease, lease_ms=ms(length))
