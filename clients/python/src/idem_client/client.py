"""The client of `idem serve`, blocking (on HTTP/1.1 connections of its own, or an
``httpx.Client`` given)."""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import os
import threading
import time
from types import TracebackType
from typing import Any, Callable, TypeVar

import httpx

from . import _core, _http
from ._core import Acquired, Attempt, Lease, Replay, Step
from .errors import (
    BadInput,
    IdemError,
    InProgress,
    LeaseLost,
    PreviousFailure,
    StaleLease,
    Unreachable,
)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class Idem:
    """A client of `idem serve` at ``url``, as the caller whose API key is ``api_key`` (keys
    are scoped to the caller).

    Its own calls are retried, with backoff and the server's ``Retry-After``, when the server
    or its store is unavailable or cannot be reached (``attempts`` tries in all).

    It keeps a pool of keep-alive HTTP/1.1 connections and may be shared by threads.
    ``client``: an ``httpx.Client`` to call through instead (its base URL, headers, timeouts,
    proxies and TLS settings are used as they are, and it is left open on close).
    ``max_body``: the largest request body sent (the server's ``--max-body``); a larger one
    is refused here with :class:`BodyTooLarge`.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:7070",
        api_key: str | None = None,
        *,
        timeout: float = 10.0,
        attempts: int = _core.DEFAULT_ATTEMPTS,
        client: httpx.Client | None = None,
        max_body: int = _core.DEFAULT_MAX_BODY,
    ) -> None:
        self._http: _http.Transport
        if client is not None:
            self._http = _http.HttpxTransport(client)
        else:
            headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
            self._http = _http.StdlibTransport(url, timeout, headers)
        self._attempts = max(1, attempts)
        self._timeout = timeout
        self._max_body = max_body
        self._keeper = _Keeper(self)
        self._closed = False

    def close(self) -> None:
        """Closes the connections and stops renewing leases; the client cannot be used after."""
        self._closed = True
        self._keeper.stop()
        self._http.close()

    def __enter__(self) -> Idem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        *,
        attempts: int | None = None,
        repeatable: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """One call, tried again while the server or its store is unavailable; also when the
        server could not be reached or did not answer, if the call is ``repeatable`` (safe to
        send twice: not a token's consume, not a lock's acquire without an owner id).
        ``timeout``: this call's, when it may wait at the server (a lock's acquire)."""
        if self._closed:
            raise RuntimeError("this idem client is closed")
        attempts = attempts or self._attempts
        content = _core.encode(body)
        if (refused := _core.too_large(content, self._max_body)) is not None:
            raise refused
        for attempt in range(attempts):
            try:
                answer = self._http.request(method, path, content, params, repeatable, timeout)
            except _http.TransportFailure as e:
                err: IdemError = Unreachable(f"idem serve did not answer: {e}")
                if e.lasting:
                    raise err from e
            else:
                if answer.ok:
                    return json.loads(answer.content)
                err = _core.error_of(answer)
            retryable = err.code in _core.RETRYABLE and (repeatable or err.code != "unreachable")
            if not retryable or attempt + 1 == attempts:
                raise err
            time.sleep(_core.pause(attempt, err.retry_after))
        raise AssertionError("unreachable")

    # The record API.

    def begin(
        self,
        namespace: str,
        key: str,
        *,
        request: Any = None,
        fingerprint: str | None = None,
        lease: float | None = None,
        ttl: float | None = None,
        step_keys: list[str] | None = None,
    ) -> Acquired | Replay:
        """Claims ``key``: :class:`Acquired` (do the work, then complete or release) or
        :class:`Replay` (the stored response). Raises :class:`InProgress` while another
        attempt holds it, :class:`FingerprintMismatch` for another request under the key.
        ``lease`` and ``ttl`` are in seconds."""
        body = _core.begin_body(namespace, key, request, fingerprint, lease, ttl, step_keys)
        return _core.parse_begin(self._call("POST", "/v1/records/begin", body))

    def step(
        self,
        namespace: str,
        key: str,
        lease: Lease | str,
        name: str,
        output: Any = None,
        *,
        unknown: bool = False,
    ) -> None:
        """Records step ``name`` under the lease: done with ``output``, or ``unknown``."""
        body = _core.step_body(namespace, key, lease, name, output, unknown)
        self._call("POST", "/v1/records/step", body)

    def renew(
        self, namespace: str, key: str, lease: Lease | str, length: float | None = None
    ) -> Lease:
        """Extends the lease to ``length`` seconds from now (the server's default lease without
        it). Raises :class:`StaleLease` once another attempt took the key over."""
        body = _core.renew_body(namespace, key, lease, length)
        return _core.parse_lease(self._call("POST", "/v1/records/renew", body)["lease"])

    def complete(self, namespace: str, key: str, lease: Lease | str, response: Any) -> None:
        """Stores ``response`` (any JSON) under the lease; every retry's begin is given it."""
        body = _core.lease_body(namespace, key, lease, response=response)
        self._call("POST", "/v1/records/complete", body)

    def release(self, namespace: str, key: str, lease: Lease | str) -> None:
        """Gives the key back after a failure that is safe to retry."""
        body = _core.lease_body(namespace, key, lease)
        self._call("POST", "/v1/records/release", body)

    def record(self, namespace: str, key: str) -> dict[str, Any] | None:
        """The caller's record under ``key``, or ``None``."""
        path = _core.record_path(namespace, key)
        try:
            answer: dict[str, Any] = self._call("GET", path)
        except IdemError as e:
            if e.code == "not_found":
                return None
            raise
        return answer

    # Running work once per key.

    def run(
        self,
        namespace: str,
        key: str,
        *,
        request: Any = None,
        fingerprint: str | None = None,
        lease: float = 60.0,
        ttl: float | None = None,
        wait: float = 30.0,
        keep_alive: bool = True,
        step_keys: list[str] | None = None,
    ) -> Run:
        """A run of the work under ``key``, as a context manager::

            with idem.run("transfers", key, request=order) as run:
                if run.replayed:
                    return run.response
                hold = run.step("debit", debit, order)
                run.complete(send(hold))

        It waits up to ``wait`` seconds for an attempt in flight (then raises
        :class:`InProgress`), renews the lease in the background while the block runs
        (``keep_alive``), and releases the key if the block raises an ``Exception`` or ends
        without ``complete``, so that a retry runs it again. A block stopped by what is not a
        failure of the work (``KeyboardInterrupt``, ``SystemExit``: any ``BaseException``
        that is not an ``Exception``) may have had its effects, so its key is kept, renewed
        no more, until the lease ends; an attempt then takes over, skipping recorded steps."""
        return Run(
            self,
            namespace,
            key,
            _core.begin_body(namespace, key, request, fingerprint, lease, ttl, step_keys),
            lease=lease,
            wait=wait,
            keep_alive=keep_alive,
        )

    def once(
        self,
        namespace: str,
        *,
        key: Callable[..., str],
        payload: Callable[..., Any] | None = None,
        lease: float = 60.0,
        ttl: float | None = None,
        wait: float = 30.0,
        permanent: tuple[type[BaseException], ...] = (),
    ) -> Callable[[F], F]:
        """Runs the decorated function once per key; every later call with the key is given
        the first call's result::

            @idem.once("orders", key=lambda order: order["id"])
            def charge(order): ...

        ``key`` and ``payload`` take the function's arguments: the key, and what the call is
        fingerprinted by (its arguments by default; another call under the key with another
        payload raises :class:`FingerprintMismatch`). An exception of a ``permanent`` type is
        kept: later calls raise :class:`PreviousFailure` without running. Any other exception
        releases the key, so a later call runs again; an interrupt or an exit keeps it until
        the lease ends (see :meth:`run`). The result must be JSON, and every call, the first
        too, is given it as JSON carries it (``{1: (2, 3)}`` as ``{"1": [2, 3]}``)."""

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                request = (payload or _core.default_payload_fn)(*args, **kwargs)
                with self.run(
                    namespace, key(*args, **kwargs), request=request, lease=lease, ttl=ttl, wait=wait
                ) as run:
                    if run.replayed:
                        return _core.result_of(run.response)
                    try:
                        value = fn(*args, **kwargs)
                    except permanent as e:
                        run.complete(_core.kept_failure(e))
                        raise
                    try:
                        kept = run.complete(_core.kept_value(value))
                    except (BadInput, TypeError) as e:
                        # It ran, so it must not run again: its failure to be kept is kept.
                        run.complete(_core.not_kept(e), again=True)
                        raise PreviousFailure(_core.NOT_KEPT, str(e)) from e
                    return kept["value"]

            return wrapper  # type: ignore[return-value]

        return decorate

    # Ids, one-time tokens and locks.

    def uuid7(self, count: int = 1) -> list[str]:
        """``count`` UUIDv7 ids."""
        return list(self._call("GET", "/v1/ids/uuid7", params={"count": count})["ids"])

    def snowflake(self, count: int = 1) -> list[int]:
        """``count`` Snowflake ids."""
        return list(self._call("GET", "/v1/ids/snowflake", params={"count": count})["ids"])

    def segment(self, tag: str, count: int = 1) -> list[int]:
        """The next ``count`` numbers of the caller's sequence ``tag`` (Leaf-style segments)."""
        path = f"/v1/ids/segment/{_core.segment(tag)}"
        return list(self._call("GET", path, params={"count": count})["ids"])

    def issue_token(self, purpose: str, ttl: float | None = None) -> str:
        """A one-time token for ``purpose`` (stored as a hash by the server)."""
        body: dict[str, Any] = {"purpose": purpose}
        if ttl is not None:
            body["ttl_ms"] = _core.ms(ttl)
        return str(self._call("POST", "/v1/tokens", body)["token"])

    def consume_token(self, token: str, purpose: str) -> None:
        """Uses the token up; raises :class:`AlreadyUsed`, :class:`ExpiredProblem`,
        :class:`WrongPurpose` or :class:`UnknownProblem` otherwise."""
        body = {"token": token, "purpose": purpose}
        # Not repeated when the answer is lost: a consumed token would then read as used.
        self._call("POST", "/v1/tokens/consume", body, repeatable=False)

    def lock(
        self, name: str, *, lease: float = 30.0, wait: float = 0.0, owner: str | None = None
    ) -> Lock:
        """The lock ``name``, held for the ``with`` block (renew it for longer work), with
        its fence to send with every write it protects::

            with idem.lock("payouts", lease=10) as lock:
                ledger.write(entry, fence=lock.fence)
        """
        return Lock(self, name, lease, wait, owner)


class Run(Attempt):
    """One attempt at the work under a key (see :meth:`Idem.run`)."""

    def __init__(
        self,
        idem: Idem,
        namespace: str,
        key: str,
        begin: dict[str, Any],
        *,
        lease: float,
        wait: float,
        keep_alive: bool,
    ) -> None:
        self._idem = idem
        self.namespace = namespace
        self.key = key
        self._begin = begin
        self._length = lease
        self._wait = wait
        self._keep_alive = keep_alive
        #: Whether the work was done before: :attr:`response` is its stored response.
        self.replayed = False
        self.response: Any = None
        self.lease: Lease | None = None
        #: The steps earlier attempts recorded, by name.
        self.steps: dict[str, Step] = {}
        #: The step keys asked for with ``step_keys``, by step name.
        self.step_keys: dict[str, str] = {}
        self._settled = False
        self._lost = threading.Event()
        self._keeper_id = -1

    def __enter__(self) -> Run:
        deadline = time.monotonic() + self._wait
        attempt = 0
        while True:
            try:
                outcome = _core.parse_begin(
                    self._idem._call("POST", "/v1/records/begin", self._begin)
                )
                break
            except InProgress as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(_core.in_flight_pause(attempt, e.retry_after, left))
                attempt += 1
        if isinstance(outcome, Replay):
            self.replayed = True
            self.response = outcome.response
            return self
        self.lease = outcome.lease
        self.steps = {s.name: s for s in outcome.steps}
        self.step_keys = dict(outcome.step_keys)
        if self._keep_alive:
            self._idem._keeper.watch(self)
        return self

    def _renew(self) -> bool:
        """One try at renewing the lease (the keeper's beat); whether to go on renewing."""
        assert self.lease is not None
        if self._settled:
            return False  # completed or released: nothing left to hold
        body = _core.renew_body(self.namespace, self.key, self.lease, self._length)
        try:
            # One try per beat, so that no run's renewal waits on another's retries.
            self._idem._call("POST", "/v1/records/renew", body, attempts=1)
        except StaleLease:
            self._lost.set()
            return False
        except IdemError:
            pass  # tried again at the next beat; the lease runs until then
        return True

    @property
    def lost(self) -> bool:
        """Whether another attempt took the key over while this one ran (seen by the lease's
        renewal): long work may check it and stop early, since its result will not be kept."""
        return self._lost.is_set()

    def step(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs step ``name`` (``fn(*args, **kwargs)``), records its output (JSON) and returns
        it as recorded (as JSON carries it), or, when an earlier attempt recorded it done,
        returns that output without running it."""
        done = self.steps.get(name)
        if done is not None and done.done:
            return done.output  # type: ignore[no-any-return]
        output = fn(*args, **kwargs)
        try:
            kept = _core.as_json(output)
            self._idem.step(self.namespace, self.key, self._held(), name, kept)
        except (BadInput, TypeError) as e:
            # The step ran and its output cannot be recorded (too large, not JSON): the run
            # ends here, its failure kept, so that no retry runs the step again.
            self.complete(_core.not_kept(e, f"the output of step {name!r}"))
            raise PreviousFailure(_core.NOT_KEPT, str(e)) from e
        self.steps[name] = Step(name, True, kept, done.step_key if done else "")
        return kept  # type: ignore[no-any-return]

    def complete(self, response: Any, *, again: bool = False) -> Any:
        """Stores ``response`` (any JSON) as the work's, and returns it as stored (as JSON
        carries it: what every retry's :attr:`response` is); raises :class:`LeaseLost` if
        another attempt took the key over meanwhile (its response is the one kept). Once
        tried, the key is never released by this run, whatever the store answered: the work
        ran, so a retry must not run it again at once (it takes over when the lease ends if
        nothing was stored). ``again``: a second try after the store refused the first
        response."""
        if self.lease is None or (self._settled and not again):
            raise RuntimeError("this run holds no lease (it was replayed or is settled)")
        self._settled = True
        kept = _core.as_json(response)
        try:
            self._idem.complete(self.namespace, self.key, self.lease, kept)
        except StaleLease as e:
            raise LeaseLost(f"the lease on {self.key!r} was taken over") from e
        return kept

    def release(self) -> None:
        """Gives the key back: a retry runs the work again."""
        lease = self._held()
        self._settled = True
        try:
            self._idem.release(self.namespace, self.key, lease)
        except StaleLease:
            pass  # another attempt holds it: nothing of ours to give back

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._idem._keeper.forget(self)
        if not self._gives_back(exc):
            return
        try:
            self.release()
        except IdemError:
            if exc is None:
                raise
            # The block's own error matters more; the key comes back when the lease ends.


#: How long the lease keeper's thread waits with no run to renew before it ends, in seconds
#: (counted from when the last run's next renewal would have come up).
_KEEPER_IDLE = 10.0


class _Keeper:
    """Renews the leases of a client's runs in flight, every third of each lease's length.

    One thread keeps the schedule for all of them (started by the first run that needs it,
    ended when idle): a thread per run would cost more than a short run's two calls. Each
    renewal that comes due is sent from a short-lived thread of its own, so a slow one holds up
    no other run's; a run has at most one renewal in flight. A renewal is one try per beat: a
    failed one is tried at the next beat, while the lease still runs."""

    def __init__(self, idem: Idem) -> None:
        self._idem = idem
        self._reset()

    def _reset(self) -> None:
        # Also in a child process after fork: the parent's thread and runs are not the child's.
        self._pid = os.getpid()
        self._runs: dict[int, Run] = {}
        # (when, run id): entries of ended runs stay until they come up, or until compacted.
        self._due: list[tuple[float, int]] = []
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, run: Run) -> None:
        if self._pid != os.getpid():
            self._reset()
        with self._wake:
            if self._stopped:
                raise RuntimeError("this idem client is closed")
            run._keeper_id = next(self._ids)
            self._runs[run._keeper_id] = run
            self._schedule(run)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="idem-leases", daemon=True)
                self._thread.start()

    def _schedule(self, run: Run) -> None:
        """Puts the run's next renewal on the schedule (the lock held)."""
        heapq.heappush(self._due, (time.monotonic() + run._length / 3, run._keeper_id))
        if self._due[0][1] == run._keeper_id:
            self._wake.notify()  # sooner than what the thread waits for

    def forget(self, run: Run) -> None:
        with self._wake:
            if self._runs.pop(run._keeper_id, None) is None:
                return
            if len(self._due) > 64 and len(self._due) > 4 * len(self._runs):
                self._due = [e for e in self._due if e[1] in self._runs]
                heapq.heapify(self._due)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._runs.clear()
            self._due.clear()
            self._wake.notify()

    def _next(self) -> Run | None:
        """The next run whose renewal is due, when it is; ``None`` once stopped or idle (the
        thread then ends)."""
        with self._wake:
            while not self._stopped:
                while self._due and self._due[0][1] not in self._runs:
                    heapq.heappop(self._due)
                if not self._due:
                    # A client left without close() must not keep a thread for ever: with no
                    # run to renew for a while, the thread ends (the next run starts another).
                    if not self._wake.wait(_KEEPER_IDLE) and not self._due:
                        break
                    continue
                delay = self._due[0][0] - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                    continue
                return self._runs[heapq.heappop(self._due)[1]]
            self._thread = None
            return None

    def _loop(self) -> None:
        try:
            while (run := self._next()) is not None:
                threading.Thread(target=self._renew, args=(run,), daemon=True).start()
        finally:
            with self._wake:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _renew(self, run: Run) -> None:
        try:
            going = run._renew()
        except Exception:  # an answer not understood (not JSON, say): tried at the next beat
            going = True
        with self._wake:
            if run._keeper_id not in self._runs:
                return
            if going:
                self._schedule(run)
            else:
                del self._runs[run._keeper_id]


class Lock:
    """A held lock (see :meth:`Idem.lock`): its ``fence`` and its handle."""

    def __init__(
        self, idem: Idem, name: str, lease: float, wait: float, owner: str | None
    ) -> None:
        self._idem = idem
        self.name = name
        self._lease = lease
        self._wait = wait
        self._owner = owner
        self.handle = ""
        self.fence = 0
        self.expires_at = ""

    def acquire(self) -> Lock:
        body: dict[str, Any] = {"lease_ms": _core.ms(self._lease), "wait_ms": _core.ms(self._wait)}
        if self._wait <= 0:
            body["wait_ms"] = 0
        if self._owner is not None:
            body["owner"] = self._owner
        # Repeated after a lost answer only with an owner id (the same holding comes back).
        path = f"/v1/locks/{_core.segment(self.name)}/acquire"
        held = self._idem._call(
            "POST",
            path,
            body,
            repeatable=self._owner is not None,
            timeout=self._idem._timeout + max(self._wait, 0.0),
        )
        self.handle, self.fence, self.expires_at = held["lock"], held["fence"], held["expires_at"]
        return self

    def renew(self, lease: float | None = None) -> None:
        """Holds the lock ``lease`` seconds more from now; raises :class:`NotOwner` if it was
        lost."""
        body = {"lock": self.handle, "lease_ms": _core.ms(lease or self._lease)}
        held = self._idem._call("POST", f"/v1/locks/{_core.segment(self.name)}/renew", body)
        self.expires_at = held["expires_at"]

    def release(self) -> None:
        self._idem._call(
            "POST", f"/v1/locks/{_core.segment(self.name)}/release", {"lock": self.handle}
        )

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["Idem", "Run", "Lock", "PreviousFailure"]
