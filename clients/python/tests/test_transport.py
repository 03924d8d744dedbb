"""The blocking client's connections: kept alive and shared by threads, never reused once the
server closed them, and an ``httpx.Client`` taken instead when one is given."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from idem_client import Acquired, Idem
from idem_client.errors import BodyTooLarge, Unreachable


class OneAnswerPerConnection(BaseHTTPRequestHandler):
    """Answers one request per connection, then closes it without saying so (no
    ``Connection: close``), as a server closing an idle keep-alive connection does."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("authorization")))
        body = json.dumps({"ids": [len(self.seen)]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def closing_server() -> Iterator[str]:
    OneAnswerPerConnection.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), OneAnswerPerConnection)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_connection_the_server_closed_is_not_reused(closing_server: str) -> None:
    # One attempt per call: a call sent on the closed connection would fail as unreachable.
    with Idem(closing_server + "/idem/", api_key="k-123", attempts=1) as idem:
        for n in range(1, 6):
            assert idem.snowflake() == [n]
    assert OneAnswerPerConnection.seen == [
        ("/idem/v1/ids/snowflake?count=1", "Bearer k-123")
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
        OneAnswerPerConnection.seen = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), OneAnswerPerConnection)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"https://127.0.0.1:{server.server_address[1]}"
        if trusted:
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        else:
            monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        try:
            with Idem(url, attempts=1) as idem:
                if hint is None:
                    assert idem.snowflake() == [1]
                else:
                    # Refused in the handshake: nothing was sent.
                    with pytest.raises(Unreachable, match=hint):
                        idem.snowflake()
                    assert OneAnswerPerConnection.seen == []
        finally:
            server.shutdown()
            server.server_close()


class KeepAlive(BaseHTTPRequestHandler):
    """Answers every request on a connection kept open; notes the client's port of each."""

    protocol_version = "HTTP/1.1"
    ports: list[int] = []

    def answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.ports.append(self.client_address[1])
        body = json.dumps({"ids": [len(self.ports)]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keep_alive() -> Iterator[str]:
    KeepAlive.ports = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


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
    """A server on a raw socket that answers each request with the next of ``answers`` (bytes
    as they go on the wire, and whether to close the connection after), noting each request's
    line and which connection it came on."""

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        self.answers = answers
        self.seen: list[tuple[int, bytes]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        for n in itertools.count():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.connection, args=(n, conn), daemon=True).start()

    def connection(self, n: int, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while self.answers:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head)
                buf = buf[int(length.group(1)) if length else 0 :]
                self.seen.append((n, head.split(b"\r\n")[0]))
                answer, close = self.answers.pop(0)
                conn.sendall(answer)
                if close:
                    return

    def close(self) -> None:
        self.listener.close()


def ids(n: int) -> bytes:
    return json.dumps({"ids": [n]}).encode()


def test_answers_of_every_framing_are_read() -> None:
    chunked = ids(2)
    server = Canned(
        [
            # A length, after two informational answers.
            (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
             b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + ids(1), False),
            # Chunked, with an extension and a trailer.
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
             + b"5;x=y\r\n" + chunked[:5] + b"\r\n" + f"{len(chunked) - 5:x}".encode() + b"\r\n"
             + chunked[5:] + b"\r\n0\r\nx-t: 1\r\n\r\n", False),
            # Ended by the close (no length): the next call needs a new connection.
            (b"HTTP/1.1 200 OK\r\n\r\n" + ids(3), True),
            # Connection: close said, and done.
            (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 12\r\n\r\n" + ids(4), True),
            # HTTP/1.0 without keep-alive.
            (b"HTTP/1.0 200 OK\r\nContent-Length: 12\r\n\r\n" + ids(5), True),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + ids(6), False),
        ]
    )
    try:
        with Idem(server.url, attempts=1) as idem:
            assert [idem.snowflake() for _ in range(6)] == [[1], [2], [3], [4], [5], [6]]
        connections = [n for n, _ in server.seen]
        assert connections == [0, 0, 0, 1, 2, 3]
    finally:
        server.close()


def test_a_malformed_answer_is_unreachable_and_its_connection_dropped() -> None:
    for bad in [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nx: " + b"y" * (70 << 10) + b"\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    ]:
        good = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + ids(7)
        server = Canned([(bad, False), (good, False)])
        try:
            with Idem(server.url, attempts=1) as idem:
                with pytest.raises(Unreachable):
                    idem.snowflake()
                assert idem.snowflake() == [7], bad[:40]
            assert [n for n, _ in server.seen] == [0, 1]  # a new connection after the bad one
        finally:
            server.close()


def test_a_request_too_large_gets_the_servers_refusal(idem: Idem, ns: str) -> None:
    begun = idem.begin(ns, "big", request=1)
    assert isinstance(begun, Acquired)
    # Far past --max-body and the socket buffers: the server answers 413 and closes before
    # reading it all.
    with pytest.raises(BodyTooLarge):
        idem.complete(ns, "big", begun.lease, "x" * (8 << 20))
    idem.complete(ns, "big", begun.lease, "small")


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


