"""The client of `idem serve` for asyncio (on ``httpx.AsyncClient``): the same API as
:class:`idem_client.Idem`, every call awaited, the lease renewed by a task."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from types import TracebackType
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

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
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class AsyncIdem:
    """A client of `idem serve` for asyncio; see :class:`idem_client.Idem`."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:7070",
        api_key: str | None = None,
        *,
        timeout: float = 10.0,
        attempts: int = _core.DEFAULT_ATTEMPTS,
        client: httpx.AsyncClient | None = None,
        max_body: int = _core.DEFAULT_MAX_BODY,
    ) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # A client given is used as it is (its base URL, headers and timeouts) and left open.
        self._owned = client is None
        self._http = client or httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers)
        self._attempts = max(1, attempts)
        self._timeout = timeout
        self._max_body = max_body
        # Work whose caller may be gone: held here, since the loop keeps only weak references.
        self._working: set[asyncio.Task[Any]] = set()

    async def aclose(self) -> None:
        """Waits for work still running whose caller was cancelled (so that its result is
        stored), then closes the connections."""
        while self._working:
            await asyncio.wait(set(self._working))
        if self._owned:
            await self._http.aclose()

    def _detach(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """``work`` in a task of its own, which runs to its end whether or not anyone waits."""
        task = asyncio.ensure_future(work)
        self._working.add(task)
        task.add_done_callback(self._working.discard)
        return task

    async def __aenter__(self) -> AsyncIdem:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
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
        """See :meth:`idem_client.Idem._call`."""
        attempts = attempts or self._attempts
        content = _core.encode(body)
        if (refused := _core.too_large(content, self._max_body)) is not None:
            raise refused
        headers = {"content-type": "application/json"} if content is not None else None
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        for attempt in range(attempts):
            try:
                response = await self._http.request(
                    method, path, content=content, params=params, headers=headers, **extra
                )
            except httpx.TransportError as e:
                err: IdemError = Unreachable(f"idem serve did not answer: {e}")
            else:
                if response.is_success:
                    return response.json()
                err = _core.error_of(_http.of_httpx(response))
            retryable = err.code in _core.RETRYABLE and (repeatable or err.code != "unreachable")
            if not retryable or attempt + 1 == attempts:
                raise err
            await asyncio.sleep(_core.pause(attempt, err.retry_after))
        raise AssertionError("unreachable")

    async def begin(
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
        """See :meth:`idem_client.Idem.begin`."""
        body = _core.begin_body(namespace, key, request, fingerprint, lease, ttl, step_keys)
        return _core.parse_begin(await self._call("POST", "/v1/records/begin", body))

    async def step(
        self,
        namespace: str,
        key: str,
        lease: Lease | str,
        name: str,
        output: Any = None,
        *,
        unknown: bool = False,
    ) -> None:
        """See :meth:`idem_client.Idem.step`."""
        body = _core.step_body(namespace, key, lease, name, output, unknown)
        await self._call("POST", "/v1/records/step", body)

    async def renew(
        self, namespace: str, key: str, lease: Lease | str, length: float | None = None
    ) -> Lease:
        """See :meth:`idem_client.Idem.renew`."""
        body = _core.renew_body(namespace, key, lease, length)
        return _core.parse_lease((await self._call("POST", "/v1/records/renew", body))["lease"])

    async def complete(self, namespace: str, key: str, lease: Lease | str, response: Any) -> None:
        """See :meth:`idem_client.Idem.complete`."""
        body = _core.lease_body(namespace, key, lease, response=response)
        await self._call("POST", "/v1/records/complete", body)

    async def release(self, namespace: str, key: str, lease: Lease | str) -> None:
        """See :meth:`idem_client.Idem.release`."""
        body = _core.lease_body(namespace, key, lease)
        await self._call("POST", "/v1/records/release", body)

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
    ) -> AsyncRun:
        """See :meth:`idem_client.Idem.run`; used with ``async with``. A block cancelled (a
        timeout, a client's hang-up) is interrupted, not failed: its key is kept until the
        lease ends, and a step it was in runs to its end and is recorded first."""
        return AsyncRun(
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
        """See :meth:`idem_client.Idem.once`; decorates a coroutine function.

        Once the key is had, the function runs in a task of its own: a caller cancelled
        meanwhile (a timeout, a client's hang-up) stops waiting, but the function runs to its
        end and its result is kept, and a retry is given it."""

        def decorate(fn: F) -> F:
            async def settle(run: AsyncRun, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                try:
                    value = await fn(*args, **kwargs)
                except permanent as e:
                    await run.complete(_core.kept_failure(e))
                    raise
                except Exception:
                    # Released here, not by the caller's exit: the caller may be gone.
                    with contextlib.suppress(IdemError):
                        await run.release()
                    raise
                try:
                    kept = await run.complete(_core.kept_value(value))
                except (BadInput, TypeError) as e:
                    await run.complete(_core.not_kept(e), again=True)
                    raise PreviousFailure(_core.NOT_KEPT, str(e)) from e
                return kept["value"]

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                request = (payload or _core.default_payload_fn)(*args, **kwargs)
                async with self.run(
                    namespace, key(*args, **kwargs), request=request, lease=lease, ttl=ttl, wait=wait
                ) as run:
                    if run.replayed:
                        return _core.result_of(run.response)
                    return await run._shielded(settle(run, args, kwargs))

            return wrapper  # type: ignore[return-value]

        return decorate

    async def uuid7(self, count: int = 1) -> list[str]:
        return list((await self._call("GET", "/v1/ids/uuid7", params={"count": count}))["ids"])

    async def snowflake(self, count: int = 1) -> list[int]:
        answer = await self._call("GET", "/v1/ids/snowflake", params={"count": count})
        return list(answer["ids"])

    async def segment(self, tag: str, count: int = 1) -> list[int]:
        path = f"/v1/ids/segment/{_core.segment(tag)}"
        return list((await self._call("GET", path, params={"count": count}))["ids"])

    async def issue_token(self, purpose: str, ttl: float | None = None) -> str:
        body: dict[str, Any] = {"purpose": purpose}
        if ttl is not None:
            body["ttl_ms"] = _core.ms(ttl)
        return str((await self._call("POST", "/v1/tokens", body))["token"])

    async def consume_token(self, token: str, purpose: str) -> None:
        body = {"token": token, "purpose": purpose}
        await self._call("POST", "/v1/tokens/consume", body, repeatable=False)

    async def record(self, namespace: str, key: str) -> dict[str, Any] | None:
        """See :meth:`idem_client.Idem.record`."""
        path = _core.record_path(namespace, key)
        try:
            answer: dict[str, Any] = await self._call("GET", path)
        except IdemError as e:
            if e.code == "not_found":
                return None
            raise
        return answer

    def lock(
        self, name: str, *, lease: float = 30.0, wait: float = 0.0, owner: str | None = None
    ) -> AsyncLock:
        """See :meth:`idem_client.Idem.lock`; used with ``async with``."""
        return AsyncLock(self, name, lease, wait, owner)


class AsyncRun(Attempt):
    """One attempt at the work under a key (see :meth:`AsyncIdem.run`)."""

    def __init__(
        self,
        idem: AsyncIdem,
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
        self.replayed = False
        self.response: Any = None
        self.lease: Lease | None = None
        self.steps: dict[str, Step] = {}
        self.step_keys: dict[str, str] = {}
        self._settled = False
        self._lost = False
        self._keeper: asyncio.Task[None] | None = None
        # Work of this run in tasks of their own (a guarded function, steps), still running.
        self._working: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> AsyncRun:
        deadline = time.monotonic() + self._wait
        attempt = 0
        while True:
            try:
                answer = await self._idem._call("POST", "/v1/records/begin", self._begin)
                outcome = _core.parse_begin(answer)
                break
            except InProgress as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(_core.in_flight_pause(attempt, e.retry_after, left))
                attempt += 1
        if isinstance(outcome, Replay):
            self.replayed = True
            self.response = outcome.response
            return self
        self.lease = outcome.lease
        self.steps = {s.name: s for s in outcome.steps}
        self.step_keys = dict(outcome.step_keys)
        if self._keep_alive:
            self._keeper = asyncio.create_task(self._keep())
        return self

    async def _keep(self) -> None:
        assert self.lease is not None
        while True:
            await asyncio.sleep(self._length / 3)
            if self._settled:
                return  # completed or released: nothing left to hold
            body = _core.renew_body(self.namespace, self.key, self.lease, self._length)
            try:
                await self._idem._call("POST", "/v1/records/renew", body, attempts=1)
            except StaleLease:
                self._lost = True
                return
            except Exception:  # noqa: BLE001 - tried again at the next beat
                continue

    @property
    def lost(self) -> bool:
        """See :attr:`idem_client.Run.lost`."""
        return self._lost

    async def _shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """Runs ``work`` in a task of its own and waits for it. A cancelled caller stops
        waiting, but the work runs to its end and is recorded, its lease renewed meanwhile:
        what it did must be what a retry is given, and a cut between an effect and its
        record would have the retry do it again."""
        task = self._idem._detach(work)
        self._working.add(task)
        task.add_done_callback(self._working.discard)
        return await asyncio.shield(task)

    async def step(
        self, name: str, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """See :meth:`idem_client.Run.step`; ``fn`` is a coroutine function. The step runs in
        a task of its own: a caller cancelled meanwhile stops waiting, but the step runs to
        its end and is recorded."""
        done = self.steps.get(name)
        if done is not None and done.done:
            return done.output  # type: ignore[no-any-return]
        return await self._shielded(self._step(name, fn(*args, **kwargs)))

    async def _step(self, name: str, work: Awaitable[T]) -> T:
        output = await work
        try:
            kept = _core.as_json(output)
            await self._idem.step(self.namespace, self.key, self._held(), name, kept)
        except (BadInput, TypeError) as e:
            # The step ran and its output cannot be recorded (too large, not JSON): the run
            # ends here, its failure kept, so that no retry runs the step again.
            await self.complete(_core.not_kept(e, f"the output of step {name!r}"))
            raise PreviousFailure(_core.NOT_KEPT, str(e)) from e
        done = self.steps.get(name)
        self.steps[name] = Step(name, True, kept, done.step_key if done else "")
        return kept  # type: ignore[no-any-return]

    async def complete(self, response: Any, *, again: bool = False) -> Any:
        """See :meth:`idem_client.Run.complete`."""
        if self.lease is None or (self._settled and not again):
            raise RuntimeError("this run holds no lease (it was replayed or is settled)")
        self._settled = True
        kept = _core.as_json(response)
        try:
            await self._idem.complete(self.namespace, self.key, self.lease, kept)
        except StaleLease as e:
            raise LeaseLost(f"the lease on {self.key!r} was taken over") from e
        return kept

    async def release(self) -> None:
        """See :meth:`idem_client.Run.release`."""
        lease = self._held()
        self._settled = True
        try:
            await self._idem.release(self.namespace, self.key, lease)
        except StaleLease:
            pass

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._working and _core.interrupted(exc):
            # The caller is gone and work it started goes on: the run ends when that ends.
            self._idem._detach(self._end(exc))
            return
        await self._end(exc)

    async def _end(self, exc: BaseException | None) -> None:
        """Ends the run once its work in tasks of its own has ended: stops renewing the lease,
        and releases the key unless the run is settled or was interrupted (see
        :meth:`idem_client.Idem.run`)."""
        if self._working:
            await asyncio.wait(set(self._working))
        if self._keeper is not None:
            self._keeper.cancel()
            # Waits for it to end without taking its outcome (a cancellation of the caller's
            # own still reaches the caller).
            await asyncio.wait([self._keeper])
        if not self._gives_back(exc):
            return
        try:
            await self.release()
        except IdemError:
            if exc is None:
                raise


class AsyncLock:
    """A held lock (see :meth:`AsyncIdem.lock`): its ``fence`` and its handle."""

    def __init__(
        self, idem: AsyncIdem, name: str, lease: float, wait: float, owner: str | None
    ) -> None:
        self._idem = idem
        self._path = f"/v1/locks/{_core.segment(name)}"
        self._lease = lease
        self._body: dict[str, Any] = {"lease_ms": _core.ms(lease), "wait_ms": round(wait * 1000)}
        if owner is not None:
            self._body["owner"] = owner
        self.handle = ""
        self.fence = 0
        self.expires_at = ""

    async def __aenter__(self) -> AsyncLock:
        repeatable = "owner" in self._body
        wait = self._body["wait_ms"] / 1000
        held = await self._idem._call(
            "POST",
            f"{self._path}/acquire",
            self._body,
            repeatable=repeatable,
            timeout=self._idem._timeout + max(wait, 0.0),
        )
        self.handle, self.fence, self.expires_at = held["lock"], held["fence"], held["expires_at"]
        return self

    async def renew(self, lease: float | None = None) -> None:
        """Holds the lock ``lease`` seconds more from now; raises :class:`NotOwner` if lost."""
        body = {"lock": self.handle, "lease_ms": _core.ms(lease or self._lease)}
        self.expires_at = (await self._idem._call("POST", f"{self._path}/renew", body))[
            "expires_at"
        ]

    async def __aexit__(self, *exc: object) -> None:
        await self._idem._call("POST", f"{self._path}/release", {"lock": self.handle})
