"""The blocking client's connections: kept alive and shared by threads, never reused once the
server closed them, and an ``httpx.Client`` taken instead when one is given."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from idem_client import Acquired, Idem
from idem_client.errors import BodyTooLarge, Unreachable


def within(seconds: float, check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Ids(BaseHTTPRequestHandler):
    """Answers each request with ``{"ids": [n]}`` (n counting the requests), noting its path,
    authorization and client port; after each answer, closes the connection without saying
    so (no ``Connection: close``) when ``closing``, as a server closing an idle keep-alive
    connection does."""

    protocol_version = "HTTP/1.1"
    closing = False
    seen: list[tuple[str, str | None]] = []
    ports: list[int] = []

    def answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.seen.append((self.path, self.headers.get("authorization")))
        self.ports.append(self.client_address[1])
        body = json.dumps({"ids": [len(self.seen)]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = self.closing

    do_GET = do_POST = answer

    def log_message(self, *args: object) -> None:
        pass


class OneAnswerPerConnection(Ids):
    closing = True


class KeepAlive(Ids):
    pass


@contextlib.contextmanager
def serving(handler: type[Ids], tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """A threaded server of ``handler`` (its notes emptied) on loopback, its URL."""
    handler.seen, handler.ports = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closing_server() -> Iterator[str]:
    with serving(OneAnswerPerConnection) as url:
        yield url


def test_a_connection_the_server_closed_is_not_reused(closing_server: str) -> None:
    # One attempt per call: a call sent on the closed connection would fail as unreachable
    # (a repeatable one would go again on a new connection; a token's consume may not).
    with Idem(closing_server + "/idem/", api_key="k-123", attempts=1) as idem:
        for n in range(1, 6):
            assert idem.snowflake() == [2 * n - 1]
            time.sleep(0.05)  # the server's close arrives
            idem.consume_token("t", "p")
    assert OneAnswerPerConnection.seen == [
        ("/idem/v1/ids/snowflake?count=1", "Bearer k-123"),
        ("/idem/v1/tokens/consume", "Bearer k-123"),
    ] * 5


def certificate(tmp_path: Path, name: str, san: str) -> tuple[Path, Path]:
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_is_verified_against_the_trusted_certificates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    for name, san, trusted, hint in [
        ("untrusted", "IP:127.0.0.1", False, "CERTIFICATE_VERIFY_FAILED"),
        ("other-host", "DNS:other.invalid", True, "mismatch"),
        ("right", "IP:127.0.0.1", True, None),
    ]:
        cert, key = certificate(tmp_path, name, san)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        if trusted:
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        else:
            monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with serving(OneAnswerPerConnection, tls) as url, Idem(url, attempts=1) as idem:
            if hint is None:
                assert idem.snowflake() == [1]
            else:
                # Refused in the handshake: nothing was sent.
                with pytest.raises(Unreachable, match=hint):
                    idem.snowflake()
                assert OneAnswerPerConnection.seen == []


@pytest.fixture
def keep_alive() -> Iterator[str]:
    with serving(KeepAlive) as url:
        yield url


def test_connections_are_kept_alive_and_shared_by_threads(keep_alive: str) -> None:
    with Idem(keep_alive) as idem:
        for _ in range(20):
            idem.snowflake()
        assert len(set(KeepAlive.ports)) == 1  # one connection, reused
        failures: list[BaseException] = []

        def calls() -> None:
            try:
                for _ in range(20):
                    assert len(idem.snowflake()) == 1
            except BaseException as e:  # noqa: BLE001 (reported by the test)
                failures.append(e)

        threads = [threading.Thread(target=calls) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert len(KeepAlive.ports) == 180
        assert len(set(KeepAlive.ports)) <= 9  # at most one more per thread calling at once


class Canned:
    """A server on a raw socket that answers each request with the next of ``answers``: bytes
    as they go on the wire (``None``: none, the connection closed once the request is read),
    and whether to close the connection after. It notes each request's line and the
    connection it came on, the connections that ended, and how many were accepted. With
    ``tls``, it speaks TLS; with ``head_only``, it answers having read only a request's head."""

    def __init__(
        self,
        answers: list[tuple[bytes | None, bool]],
        tls: ssl.SSLContext | None = None,
        head_only: bool = False,
    ) -> None:
        self.answers, self.tls, self.head_only = answers, tls, head_only
        self.seen: list[tuple[int, bytes]] = []
        self.ended: list[int] = []
        self.accepted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        for n in itertools.count():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self.connection, args=(n, conn), daemon=True).start()

    def connection(self, n: int, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self.exchanges(n, conn)
        except OSError:
            pass
        finally:
            conn.close()

    def exchanges(self, n: int, conn: socket.socket) -> None:
        buf = b""
        while self.answers:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    self.ended.append(n)
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: (\d+)", head)
            while not self.head_only and length and len(buf) < int(length.group(1)):
                buf += conn.recv(65536)
            buf = buf[int(length.group(1)) if length else 0 :]
            self.seen.append((n, head.split(b"\r\n")[0]))
            answer, close = self.answers.pop(0)
            if answer is None:
                return
            conn.sendall(answer)
            if close:
                if self.head_only:
                    self.linger(conn)
                return

    @staticmethod
    def linger(conn: socket.socket) -> None:
        """Closes as servers do with a request left unread: no more writes, and what the
        client still sends read and dropped for a while (closing at once would reset the
        connection, and a reset can discard the answer before the client reads it)."""
        conn.settimeout(1)
        try:
            socket.socket.shutdown(conn, socket.SHUT_WR)
            while conn.recv(65536):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def ids(n: int) -> bytes:
    return json.dumps({"ids": [n]}).encode()


def ok(n: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + ids(n)


def test_answers_of_every_framing_are_read() -> None:
    chunked = ids(2)
    server = Canned(
        [
            # A length, after two informational answers.
            (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
             + ok(1), False),
            # Chunked, with an extension and a trailer.
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
             + b"5;x=y\r\n" + chunked[:5] + b"\r\n" + f"{len(chunked) - 5:x}".encode() + b"\r\n"
             + chunked[5:] + b"\r\n0\r\nx-t: 1\r\n\r\n", False),
            # Ended by the close (no length): the next call needs a new connection.
            (b"HTTP/1.1 200 OK\r\n\r\n" + ids(3), True),
            # Connection: close said (the server leaves it open): not used again.
            (b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 12\r\n\r\n"
             + ids(4), False),
            # HTTP/1.0 without keep-alive: not used again.
            (b"HTTP/1.0 200 OK\r\nContent-Length: 12\r\n\r\n" + ids(5), False),
            # A length beside chunked: read as chunked, the connection not used again.
            (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n"
             + b"c\r\n" + ids(6) + b"\r\n0\r\n\r\n", False),
            # Bytes after the answer that nobody asked for: the connection is not used again.
            (ok(7) + b"HTTP/1.1 200 OK\r\n", False),
            (ok(8), False),
        ]
    )
    try:
        with Idem(server.url, attempts=1) as idem:
            assert [idem.snowflake() for _ in range(8)] == [[n] for n in range(1, 9)]
        assert [n for n, _ in server.seen] == [0, 0, 0, 1, 2, 3, 4, 5]
    finally:
        server.close()


def test_a_malformed_answer_is_unreachable_and_its_connection_dropped() -> None:
    for bad in [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"0" * 5000 + b"5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\n",
        b"HTTP/1.1 200 OK\r\nx: " + b"y" * (70 << 10) + b"\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" * 20,
    ]:
        server = Canned([(bad, False), (ok(7), False)])
        try:
            with Idem(server.url, attempts=1) as idem:
                with pytest.raises(Unreachable):
                    idem.snowflake()
                # Closed at once (the server sees it end), and a new one for the next call.
                assert within(2, lambda: 0 in server.ended), bad[:40]
                assert idem.snowflake() == [7], bad[:40]
            assert [n for n, _ in server.seen] == [0, 1]
        finally:
            server.close()


def test_answers_past_the_limit_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from idem_client import _http

    monkeypatch.setattr(_http, "MAX_BODY", 100)
    big = json.dumps({"ids": list(range(100))}).encode()
    for framing in [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % len(big) + big
        + b"\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n" + big,
    ]:
        server = Canned([(framing, True)])
        try:
            with Idem(server.url, attempts=1) as idem, pytest.raises(Unreachable, match="large|length"):
                idem.snowflake()
        finally:
            server.close()


def test_an_answer_that_never_ends_is_cut_at_the_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            try:
                for _ in range(400):  # a byte every 50 ms: each read is quick, the whole is not
                    conn.sendall(b"x")
                    time.sleep(0.05)
            except OSError:
                pass

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    with Idem(url, attempts=1, timeout=0.5) as idem, pytest.raises(Unreachable, match="timed out|timeout"):
        idem.snowflake()
    assert time.monotonic() - started < 10  # not the 20 s the trickle lasts
    listener.close()


def test_a_request_the_server_dropped_goes_again_only_if_safe(keep_alive: str) -> None:
    # Each server answers once, then reads the next request on that connection and closes it
    # unanswered (as a server closing an idle connection as the request arrived).
    for repeatable in (True, False):
        server = Canned([(ok(1), False), (None, False), (ok(2), False)])
        try:
            with Idem(server.url, attempts=1) as idem:
                assert idem.snowflake() == [1]
                if repeatable:
                    assert idem.snowflake() == [2]  # sent again at once, on a new connection
                    assert len(server.seen) == 3
                else:
                    with pytest.raises(Unreachable):
                        idem.consume_token("t", "p")  # never sent twice
                    assert [line for _, line in server.seen][1:] == [
                        b"POST /v1/tokens/consume HTTP/1.1"
                    ]
        finally:
            server.close()


def test_a_request_too_large_gets_the_servers_refusal(server: str, ns: str) -> None:
    from conftest import KEYS

    # Not refused here (max_body past it), so the server's refusal is what comes back.
    with Idem(server, api_key=KEYS["shop"], max_body=1 << 30) as idem:
        begun = idem.begin(ns, "big", request=1)
        assert isinstance(begun, Acquired)
        # Far past --max-body and the socket buffers: the server answers 413 and closes
        # before reading it all.
        with pytest.raises(BodyTooLarge):
            idem.complete(ns, "big", begun.lease, "x" * (8 << 20))
        idem.complete(ns, "big", begun.lease, "small")


def test_a_request_past_max_body_is_refused_before_it_is_sent(keep_alive: str) -> None:
    with Idem(keep_alive, max_body=100) as idem:
        with pytest.raises(BodyTooLarge, match="limit of 100 bytes"):
            idem.complete("n", "k", "1.lease", "x" * 200)
    assert KeepAlive.ports == []


def test_a_closed_client_refuses_calls(keep_alive: str) -> None:
    idem = Idem(keep_alive)
    idem.close()
    with pytest.raises(RuntimeError, match="closed"):
        idem.snowflake()


def test_the_url_and_api_key_are_checked() -> None:
    for url in ("ftp://example.invalid", "127.0.0.1:7070", "http://u:p@127.0.0.1/", "http://h/?q=1"):
        with pytest.raises(ValueError):
            Idem(url)
    with pytest.raises(ValueError, match="API key"):
        Idem("http://127.0.0.1:7070", api_key="k\r\nx-evil: 1")


def test_an_httpx_client_given_is_used_and_left_open(server: str, ns: str) -> None:
    from conftest import KEYS

    seen: list[str] = []
    hooks = {"request": [lambda request: seen.append(request.url.path)]}
    headers = {"authorization": f"Bearer {KEYS['shop']}"}
    with httpx.Client(base_url=server, headers=headers, event_hooks=hooks) as client:
        with Idem(client=client) as idem:
            with idem.run(ns, "k", request=1) as run:
                run.complete("done")
            assert idem.record(ns, "k")["response"] == "done"  # type: ignore[index]
        assert not client.is_closed
    assert seen[:2] == ["/v1/records/begin", "/v1/records/complete"]




def tls_server(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = certificate(tmp_path, "tls", "IP:127.0.0.1")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    return tls, cert


def test_over_tls_a_refusal_before_the_whole_request_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls, cert = tls_server(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    problem = json.dumps({"code": "body_too_large", "detail": "too large"}).encode()
    refusal = (
        b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/problem+json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(problem) + problem
    )
    server = Canned([(refusal, True)], tls=tls, head_only=True)
    try:
        with Idem(server.url, max_body=1 << 30) as idem, pytest.raises(BodyTooLarge):
            idem.complete("n", "k", "1.lease", "x" * (8 << 20))
        assert len(server.seen) == 1  # a refusal, not a failure to retry
    finally:
        server.close()


def test_a_certificate_that_does_not_verify_is_not_tried_again(tmp_path: Path) -> None:
    tls, _ = tls_server(tmp_path)  # not trusted
    server = Canned([(ok(1), False)], tls=tls)
    try:
        with Idem(server.url, attempts=5) as idem, pytest.raises(Unreachable, match="CERTIFICATE"):
            idem.snowflake()
        assert server.accepted == 1
    finally:
        server.close()
