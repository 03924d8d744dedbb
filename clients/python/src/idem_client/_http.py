"""How the blocking client talks HTTP: a pool of keep-alive HTTP/1.1 connections of its own
by default, or an ``httpx.Client`` the caller gives.

Written by hand, on sockets, because every Python HTTP client costs more than the server's
answer does: a call of idem's API is one short JSON request and one short JSON answer, and on
one caller ``httpx.Client`` spends about 1 ms on it, ``http.client`` about 0.1 ms building the
request and parsing the answer's head (through the ``email`` package) of a call whose whole
round trip is 0.3 to 0.5 ms (see BENCHMARKS.md, "Python client"). This speaks only what such
calls need: requests with a length, answers with a length, chunked or ended by the close,
informational answers skipped, keep-alive, TLS through ``ssl``. The asyncio client stays on
``httpx.AsyncClient``.
"""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import threading
import time
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
    read: the request may or may not have been acted on. ``lasting``: trying again cannot
    help (a certificate that does not verify)."""

    lasting = False


class _ClosedUnanswered(TransportFailure):
    """The connection was closed or reset before the whole answer came. ``unsent``: the
    request was not all written and nothing came back, so the server cannot have acted on it."""

    def __init__(self, message: str, unsent: bool) -> None:
        super().__init__(message)
        self.unsent = unsent


class Transport(Protocol):
    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        repeatable: bool = True,
        timeout: float | None = None,
    ) -> Answer: ...

    def close(self) -> None: ...


def _query(path: str, params: dict[str, Any] | None) -> str:
    return f"{path}?{urlencode(params)}" if params else path


class _Pool:
    """Idle connections of one process, with their lock."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.idle: list[_Connection] = []
        self.lock = threading.Lock()


class StdlibTransport:
    """Keep-alive connections to one ``http``/``https`` origin; safe to share between threads
    (each call takes a connection of its own from the pool). HTTPS is verified against the
    system's trusted certificates (``SSL_CERT_FILE`` adds others); proxies are not used (give
    an ``httpx.Client`` for them)."""

    def __init__(self, url: str, timeout: float, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"idem's URL must be http:// or https:// with a host, not {url!r}")
        if parts.username is not None or parts.query or parts.fragment:
            raise ValueError(
                "idem's URL takes no user, query or fragment (give the API key as api_key)"
            )
        if not _visible(parts.path):
            raise ValueError(f"idem's URL has a path that is not visible ASCII: {parts.path!r}")
        for value in headers.values():
            if not value.isascii() or not value.isprintable():
                raise ValueError("the API key must be printable ASCII")
        https = parts.scheme == "https"
        default_port = 443 if https else 80
        try:
            self._host = parts.hostname.encode("idna").decode("ascii")
        except UnicodeError as e:
            raise ValueError(f"idem's URL has a host IDNA cannot write: {e}") from None
        port = parts.port  # raises ValueError for a port out of range
        self._port = default_port if port is None else port
        self._base = parts.path.rstrip("/")
        self._timeout = timeout
        host = f"[{self._host}]" if ":" in self._host else self._host
        fields = {
            "host": host if self._port == default_port else f"{host}:{self._port}",
            "accept": "application/json",
            "user-agent": "idem-client-python",
            **headers,
        }
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        self._tls = ssl.create_default_context() if https else None
        self._closed = False
        self._pool_of_pid = _Pool()

    @property
    def _pool(self) -> _Pool:
        # In a child process after fork, its parent's connections (and a lock another thread
        # may have held at the fork) are not the child's: it starts a pool of its own, swapped
        # in whole.
        pool = self._pool_of_pid
        if pool.pid != os.getpid():
            pool = self._pool_of_pid = _Pool()
        return pool

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        repeatable: bool = True,
        timeout: float | None = None,
    ) -> Answer:
        timeout = self._timeout if timeout is None else timeout
        head = f"{method} {self._base}{_query(path, params)} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        message = (head + "\r\n").encode("ascii") + (body or b"")
        conn, reused = self._take()
        try:
            return self._exchange(conn, message, timeout)
        except _ClosedUnanswered as e:
            # An idle connection the server closed as this request went out (its close
            # arrived after the check in `_take`): the request goes again, at once, on a new
            # connection, if it is safe to send twice or provably never arrived whole.
            if not (reused and (repeatable or e.unsent)):
                raise
        return self._exchange(self._connect(), message, timeout)

    def _exchange(self, conn: _Connection, message: bytes, timeout: float) -> Answer:
        try:
            answer, keep = conn.exchange(message, timeout)
        except BaseException:
            conn.close()
            raise
        if keep:
            self._give_back(conn)
        else:
            conn.close()
        return answer

    def _take(self) -> tuple[_Connection, bool]:
        """A connection: an idle one still usable (and ``True``), else a new one."""
        if self._closed:
            raise RuntimeError("this idem client is closed")
        pool = self._pool
        with pool.lock:
            while pool.idle:
                conn = pool.idle.pop()
                if conn.usable():
                    return conn, True
                conn.close()
        return self._connect(), False

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self._host, self._port), self._timeout)
        except OSError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except OSError as e:
            sock.close()
            failure = TransportFailure(f"{type(e).__name__}: {e}")
            failure.lasting = isinstance(e, ssl.SSLCertVerificationError)
            raise failure from e
        return _Connection(sock)

    def _give_back(self, conn: _Connection) -> None:
        pool = self._pool
        with pool.lock:
            if not self._closed and len(pool.idle) < POOL_SIZE:
                pool.idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        self._closed = True
        pool = self._pool
        with pool.lock:
            idle, pool.idle = pool.idle, []
        for conn in idle:
            conn.close()


def _visible(text: str) -> bool:
    return all("!" <= c <= "~" for c in text)


#: The longest answer head read, and the largest answer body.
MAX_HEAD = 64 << 10
MAX_BODY = 64 << 20
#: The most informational answers, and trailer lines, read before an answer.
MAX_INTERIM = 8

_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: |$)")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_LENGTH = re.compile(rb"[0-9]{1,18}")
_CHUNK = re.compile(rb"[0-9A-Fa-f]{1,15}")


class _Malformed(TransportFailure):
    """The answer is not HTTP/1.1 as this client reads it."""


class _Connection:
    """One HTTP/1.1 connection: a request out, its answer in, read whole before a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()  # read past the last answer: nothing, on a healthy connection
        self.deadline = 0.0
        self.received = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def usable(self) -> bool:
        """Whether the idle connection can carry another request: nothing to read on it (a
        readable idle socket is one the server closed, or sent something unasked)."""
        if self.buf:
            return False
        try:
            if hasattr(select, "poll"):  # any descriptor number, unlike select()
                poll = select.poll()
                poll.register(self.sock, select.POLLIN)
                return not poll.poll(0)
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def exchange(self, message: bytes, timeout: float) -> tuple[Answer, bool]:
        """Sends ``message`` and reads its answer, all within ``timeout`` seconds: the answer,
        and whether the connection may carry another request."""
        self.deadline = time.monotonic() + timeout
        self.received = False
        try:
            self._wait()
            self.sock.sendall(message)
            broken = False
        except _CLOSED:
            # A server that refuses a request (one too large, say) may answer and close
            # before reading all of it: its answer is still there to read.
            broken = True
        except OSError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        try:
            answer, keep = self._answer()
        except _CLOSED as e:
            unsent = broken and not self.received
            raise _ClosedUnanswered(f"{type(e).__name__}: {e}", unsent) from e
        except OSError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        return answer, keep and not broken

    def _answer(self) -> tuple[Answer, bool]:
        for _ in range(MAX_INTERIM + 1):
            head = self._head()
            lines = head.split(b"\r\n")
            status_line = _STATUS.match(lines[0])
            if status_line is None:
                raise _Malformed(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
            status = int(status_line[2])
            fields: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, colon, value = line.partition(b":")
                if not colon or _TOKEN.fullmatch(name) is None:
                    raise _Malformed("a header line without a name")
                name, value = name.lower(), value.strip()
                if name in fields:
                    if name == b"content-length":
                        if fields[name] != value:
                            raise _Malformed("two lengths")
                        continue
                    value = fields[name] + b", " + value  # lines of one field, as one
                fields[name] = value
            if not (100 <= status < 200) or status == 101:
                break
            # informational: the final answer follows
        else:
            raise _Malformed("informational answers without end")
        if status == 101:
            raise _Malformed("the server switched protocols")
        http11 = status_line[1] == b"1"
        tokens = {t.strip() for t in fields.get(b"connection", b"").lower().split(b",")}
        keep = b"close" not in tokens if http11 else b"keep-alive" in tokens
        codings = [t.strip() for t in fields.get(b"transfer-encoding", b"").lower().split(b",")]
        if status in (204, 304):
            body = b""
        elif b"transfer-encoding" in fields:
            # RFC 9112 6.1: a length beside a coding is not to be trusted, nor the connection.
            if b"content-length" in fields or not http11:
                keep = False
            if codings[-1] == b"chunked":
                body = self._chunked()
            else:
                body, keep = self._to_the_end(), False
        elif b"content-length" in fields:
            length = fields[b"content-length"]
            if _LENGTH.fullmatch(length) is None or int(length) > MAX_BODY:
                raise _Malformed(f"an answer of length {length[:20]!r}")
            body = self._exactly(int(length))
        else:
            body, keep = self._to_the_end(), False
        retry_after = fields.get(b"retry-after")
        text = retry_after.decode("latin-1") if retry_after is not None else None
        return Answer(status, body, text), keep

    def _wait(self) -> None:
        """Sets the socket's timeout to what is left before the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no whole answer within the timeout")
        self.sock.settimeout(left)

    def _recv(self) -> bytes:
        self._wait()
        data = self.sock.recv(65536)
        self.received = self.received or bool(data)
        return data

    def _fill(self) -> None:
        data = self._recv()
        if not data:
            raise ConnectionResetError("the server closed the connection")
        self.buf += data

    def _until(self, mark: bytes, limit: int, what: str) -> bytes:
        """The buffer up to ``mark`` (taken off, with it), at most ``limit`` bytes."""
        start = 0
        while (end := self.buf.find(mark, start, limit + len(mark))) < 0:
            if len(self.buf) > limit:
                raise _Malformed(f"{what} too long")
            start = max(0, len(self.buf) - len(mark) + 1)
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + len(mark)]
        return line

    def _head(self) -> bytes:
        return self._until(b"\r\n\r\n", MAX_HEAD, "an answer head")

    def _line(self) -> bytes:
        return self._until(b"\r\n", MAX_HEAD, "a chunk line")

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            line = self._line()
            size = line.partition(b";")[0].strip()
            if _CHUNK.fullmatch(size) is None:
                raise _Malformed(f"a chunk size {size[:20]!r}")
            n = int(size, 16)
            if len(body) + n > MAX_BODY:
                raise _Malformed("an answer too large")
            if n == 0:
                for _ in range(MAX_INTERIM + 1):  # trailers, to the empty line
                    if not self._line():
                        return bytes(body)
                raise _Malformed("trailers without end")
            while len(self.buf) < n + 2:
                self._fill()
            if self.buf[n : n + 2] != b"\r\n":
                raise _Malformed("a chunk without its line end")
            body += self.buf[:n]
            del self.buf[: n + 2]

    def _to_the_end(self) -> bytes:
        while True:
            if len(self.buf) > MAX_BODY:
                raise _Malformed("an answer too large")
            data = self._recv()
            if not data:
                body = bytes(self.buf)
                self.buf.clear()
                return body
            self.buf += data


#: A connection closed or reset before the whole answer came (over TLS, an EOF the protocol
#: did not announce).
_CLOSED = (
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
)


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
        timeout: float | None = None,
    ) -> Answer:
        headers = {"content-type": "application/json"} if body is not None else None
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            response = self._client.request(
                method, path, content=body, params=params, headers=headers, **extra
            )
        except httpx.TransportError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        return of_httpx(response)

    def close(self) -> None:
        pass


def of_httpx(response: httpx.Response) -> Answer:
    return Answer(response.status_code, response.content, response.headers.get("retry-after"))
