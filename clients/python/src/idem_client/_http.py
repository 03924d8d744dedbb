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
import select
import socket
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
        for value in headers.values():
            if not value.isascii() or not value.isprintable():
                raise ValueError("the API key must be printable ASCII")
        https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if https else 80)
        self._base = parts.path.rstrip("/")
        self._timeout = timeout
        default_port = self._port == (443 if https else 80)
        host = f"[{self._host}]" if ":" in self._host else self._host
        fields = {
            "host": host if default_port else f"{host}:{self._port}",
            "accept": "application/json",
            "user-agent": "idem-client-python",
            **headers,
        }
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        self._tls = ssl.create_default_context() if https else None
        self._closed = False
        self._forget_idle()

    def _forget_idle(self) -> None:
        # Also in a child process after fork: its parent's connections (and a lock another
        # thread may have held at the fork) are not the child's to use.
        self._pid = os.getpid()
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        repeatable: bool = True,
    ) -> Answer:
        head = f"{method} {self._base}{_query(path, params)} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        message = (head + "\r\n").encode("ascii") + (body or b"")
        conn, reused = self._take()
        try:
            return self._exchange(conn, message)
        except _ClosedUnanswered:
            # An idle connection the server closed as this request went out (its close
            # arrived after the check in `_take`): a request safe to send twice goes again,
            # at once, on a new connection.
            if not (reused and repeatable):
                raise
        return self._exchange(self._connect(), message)

    def _exchange(self, conn: _Connection, message: bytes) -> Answer:
        try:
            answer, keep = conn.exchange(message)
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
        if self._pid != os.getpid():
            self._forget_idle()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.usable():
                    return conn, True
                conn.close()
        return self._connect(), False

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self._host, self._port), self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except OSError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        return _Connection(sock)

    def _give_back(self, conn: _Connection) -> None:
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


#: The longest answer head read, and the largest answer body.
MAX_HEAD = 64 << 10
MAX_BODY = 64 << 20


class _Malformed(TransportFailure):
    """The answer is not HTTP/1.1 as this client reads it."""


class _Connection:
    """One HTTP/1.1 connection: a request out, its answer in, read whole."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()  # read past the last answer: nothing, on a healthy connection

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

    def exchange(self, message: bytes) -> tuple[Answer, bool]:
        """Sends ``message`` and reads its answer: the answer, and whether the connection
        may carry another request."""
        try:
            self.sock.sendall(message)
            broken = False
        except (BrokenPipeError, ConnectionResetError):
            # A server that refuses a request (one too large, say) may answer and close
            # before reading all of it: its answer is still there to read.
            broken = True
        except OSError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        try:
            answer, keep = self._answer()
        except _CLOSED as e:
            raise _ClosedUnanswered(f"{type(e).__name__}: {e}") from e
        except OSError as e:
            raise TransportFailure(f"{type(e).__name__}: {e}") from e
        return answer, keep and not broken

    def _answer(self) -> tuple[Answer, bool]:
        while True:
            head = self._head()
            lines = head.split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            code = rest[:3]
            if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
                raise _Malformed(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
            status = int(code)
            fields: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, colon, value = line.partition(b":")
                if not colon or not name or name != name.strip():
                    raise _Malformed("a header line without a name")
                name, value = name.lower(), value.strip()
                if name in fields and name in (b"content-length", b"transfer-encoding"):
                    if fields[name] != value:
                        raise _Malformed(f"two {name.decode()} headers")
                fields[name] = value
            if 100 <= status < 200 and status != 101:
                continue  # informational: the final answer follows
            break
        retry_after = fields.get(b"retry-after")
        connection = fields.get(b"connection", b"").lower()
        keep = b"close" not in connection if version == b"HTTP/1.1" else b"keep-alive" in connection
        if status == 101:
            raise _Malformed("the server switched protocols")
        if status in (204, 304):
            body = b""
        elif b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            body = self._chunked()
        elif b"content-length" in fields:
            length = fields[b"content-length"]
            if not length.isdigit() or int(length) > MAX_BODY:
                raise _Malformed(f"an answer of length {length[:20]!r}")
            body = self._exactly(int(length))
        else:
            body, keep = self._to_the_end(), False
        text = retry_after.decode("latin-1") if retry_after is not None else None
        return Answer(status, body, text), keep

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        self.buf += data

    def _head(self) -> bytes:
        while (end := self.buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)) < 0:
            if len(self.buf) > MAX_HEAD:
                raise _Malformed("an answer head too long")
            self._fill()
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", 0, MAX_HEAD + 2)) < 0:
            if len(self.buf) > MAX_HEAD:
                raise _Malformed("a chunk line too long")
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size = self._line().partition(b";")[0].strip()
            try:
                n = int(size, 16)
            except ValueError:
                raise _Malformed(f"a chunk size {size[:20]!r}") from None
            total += n
            if n < 0 or total > MAX_BODY:
                raise _Malformed("an answer too large")
            if n == 0:
                while self._line():  # trailers, to the empty line
                    pass
                return b"".join(parts)
            parts.append(self._exactly(n))
            if self._exactly(2) != b"\r\n":
                raise _Malformed("a chunk without its line end")

    def _to_the_end(self) -> bytes:
        while True:
            if len(self.buf) > MAX_BODY:
                raise _Malformed("an answer too large")
            data = self.sock.recv(65536)
            if not data:
                body = bytes(self.buf)
                self.buf.clear()
                return body
            self.buf += data


#: A connection closed or reset before the whole answer came.
_CLOSED = (
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
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
