"""How the blocking client talks HTTP: a pool of keep-alive connections on the standard
library's ``http.client`` by default, or an ``httpx.Client`` the caller gives.

Why not httpx by default: on one caller, a call of idem's API through ``httpx.Client`` costs
about three times what the same call costs on ``http.client`` (httpx's request and response
models and its transport stack, not the server: see BENCHMARKS.md, "Python client"), and every
guarded call makes one or two of them. ``http.client`` does no pooling and is not safe to share
between threads, so this module keeps idle connections in a small pool, one per call at a
time. The asyncio client stays on ``httpx.AsyncClient``.
"""

from __future__ import annotations

import http.client
import os
import select
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode, urlsplit

import httpx

#: Idle connections kept for reuse; more may be open at once while more threads call.
POOL_SIZE = 32


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, read whole: its status, body and ``Retry-After`` header."""

    status: int
    content: bytes
    retry_after: str | None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class TransportFailure(Exception):
    """The server could not be reached, or the connection failed before the whole answer was
    read: the request may or may not have been acted on."""


class _ClosedUnanswered(TransportFailure):
    """The connection was closed or reset before the whole answer came."""


class Transport(Protocol):
    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        repeatable: bool = True,
    ) -> Answer: ...

    def close(self) -> None: ...


def _query(path: str, params: dict[str, Any] | None) -> str:
    return f"{path}?{urlencode(params)}" if params else path


class StdlibTransport:
    """Keep-alive connections to one ``http``/``https`` origin, on ``http.client``; safe to
    share between threads (each call takes a connection of its own from the pool). HTTPS is
    verified against the system's trusted certificates (``SSL_CERT_FILE`` adds others);
    proxies are not used (give an ``httpx.Client`` for them)."""

    def __init__(self, url: str, timeout: float, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"idem's URL must be http:// or https:// with a host, not {url!r}")
        if parts.username is not None or parts.query or parts.fragment:
            raise ValueError(
                "idem's URL takes no user, query or fragment (give the API key as api_key)"
            )
        for value in headers.values():
            if not value.isascii() or not value.isprintable():
                raise ValueError("the API key must be printable ASCII")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self._timeout = timeout
        self._headers = {
            "accept": "application/json",
            "content-type": "application/json",
            "user-agent": "idem-client-python",
            **headers,
        }
        self._tls = ssl.create_default_context() if self._https else None
        self._closed = False
        self._forget_idle()

    def _forget_idle(self) -> None:
        # Also in a child process after fork: its parent's connections (and a lock another
        # thread may have held at the fork) are not the child's to use.
        self._pid = os.getpid()
        self._idle: list[_Http | _Https] = []
        self._lock = threading.Lock()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        repeatable: bool = True,
    ) -> Answer:
        target = self._base + _query(path, params)
        conn, reused = self._take()
        try:
            return self._exchange(conn, method, target, body)
        except _ClosedUnanswered:
            # An idle connection the server closed as this request went out (its close
            # arrived after the check in `_take`): a request safe to send twice goes again,
            # at once, on a new connection.
            if not (reused and repeatable):
                raise
        return self._exchange(self._connection(), method, target, body)

    def _exchange(self, conn: _Http | _Https, method: str, target: str, body: bytes | None) -> Answer:
        try:
            conn.request(method, target, body, self._headers)
            try:
                conn.flush()
                broken = False
            except (BrokenPipeError, ConnectionResetError):
                # A server that refuses a request (one too large, say) may answer and close
                # before reading all of it: its answer is still there to read.
                broken = True
            response = conn.getresponse()
            if response.status < 200:
                # http.client skips only 100 Continue; the final answer would be left unread.
                conn.close()
                raise TransportFailure(f"an informational answer ({response.status}) came alone")
            answer = Answer(response.status, response.read(), response.getheader("retry-after"))
        except _CLOSED as e:
            conn.close()
            raise _ClosedUnanswered(f"{type(e).__name__}: {e}") from e
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        if broken or response.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return answer

    def _take(self) -> tuple[_Http | _Https, bool]:
        """A connection: an idle one still usable (and ``True``), else a new one."""
        if self._closed:
            raise RuntimeError("this idem client is closed")
        if self._pid != os.getpid():
            self._forget_idle()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if _usable(conn):
                    return conn, True
                conn.close()
        return self._connection(), False

    def _connection(self) -> _Http | _Https:
        if self._tls is not None:
            return _Https(self._host, self._port, timeout=self._timeout, context=self._tls)
        return _Http(self._host, self._port, timeout=self._timeout)

    def _give_back(self, conn: _Http | _Https) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < POOL_SIZE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


#: A connection closed or reset before the whole answer came.
_CLOSED = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
)


def _usable(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection can carry another request: still open, and nothing to read
    on it (a readable idle socket is one the server closed, or sent something unasked)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):  # any descriptor number, unlike select()
            poll = select.poll()
            poll.register(sock, select.POLLIN)
            return not poll.poll(0)
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class _Whole:
    """Sends a request's head and body in one write. ``http.client`` writes them apart, and
    the server then reads the head, waits, and wakes again for the body: an extra round of
    scheduling on both sides for every call. Requests here are small and whole in memory."""

    _parts: list[bytes]

    def send(self, data: Any) -> None:
        assert isinstance(data, bytes), "requests are sent as bytes"
        self._parts.append(data)

    def flush(self) -> None:
        data, self._parts = b"".join(self._parts), []
        super().send(data)  # type: ignore[misc]


class _Http(_Whole, http.client.HTTPConnection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parts = []


class _Https(_Whole, http.client.HTTPSConnection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parts = []


class HttpxTransport:
    """An ``httpx.Client`` the caller gave (its base URL, headers, timeouts, proxies, TLS);
    left open on close."""

    def __init__(self, client: httpx.Client) -> None:
        self._client = client

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        repeatable: bool = True,
    ) -> Answer:
        headers = {"content-type": "application/json"} if body is not None else None
        try:
            response = self._client.request(
                method, path, content=body, params=params, headers=headers
            )
        except httpx.TransportError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        return of_httpx(response)

    def close(self) -> None:
        pass


def of_httpx(response: httpx.Response) -> Answer:
    return Answer(response.status_code, response.content, response.headers.get("retry-after"))
