"""The blocking client's connections: kept alive and shared by threads, never reused once the
server closed them, and an ``httpx.Client`` taken instead when one is given."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from idem_client import Idem
from idem_client.errors import Unreachable


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


def test_https_is_verified_against_the_trusted_certificates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=idem-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    OneAnswerPerConnection.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), OneAnswerPerConnection)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    try:
        # Not trusted: refused, nothing sent past the handshake.
        with Idem(url, attempts=1) as idem, pytest.raises(Unreachable, match="CERTIFICATE"):
            idem.snowflake()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        with Idem(url, attempts=1) as idem:
            assert idem.snowflake() == [1]
    finally:
        server.shutdown()
        server.server_close()


def test_connections_are_kept_alive_and_shared_by_threads(idem: Idem) -> None:
    failures: list[BaseException] = []

    def calls() -> None:
        try:
            for _ in range(20):
                assert len(idem.uuid7(2)) == 2
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            failures.append(e)

    threads = [threading.Thread(target=calls) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    pool = idem._http._idle  # type: ignore[attr-defined]
    assert 1 <= len(pool) <= 16  # kept for reuse, bounded


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


def test_a_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        Idem("ftp://example.invalid")
    with pytest.raises(ValueError):
        Idem("127.0.0.1:7070")
