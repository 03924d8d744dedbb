"""Starts a real `idem serve` (the binary the workspace builds) for the tests, on the memory
store, with two callers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from idem_client import AsyncIdem, Idem

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"shop": "shop-key-0123456789abcdef", "bank": "bank-key-0123456789abcdef"}


def idem_binary() -> str | None:
    """``IDEM_BIN``, else the workspace's debug build, else ``idem`` on the PATH."""
    if os.environ.get("IDEM_BIN"):
        return os.environ["IDEM_BIN"]
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for build in ("debug", "release"):
        if (target / build / "idem").exists():
            return str(target / build / "idem")
    return shutil.which("idem")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    binary = idem_binary()
    if binary is None:
        why = "no idem binary: build it (cargo build -p idem-server) or set IDEM_BIN"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("".join(f"{scope} {key}\n" for scope, key in KEYS.items()))
        url = f"http://127.0.0.1:{free_port()}"
        child = subprocess.Popen(
            [binary, "serve", "--store", "memory://", "--listen", url[7:], "--api-keys", str(keys)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if child.poll() is not None or time.monotonic() > deadline:
                    err = child.stderr.read().decode() if child.stderr else ""
                    pytest.fail(f"idem serve did not start: {err}")
                time.sleep(0.05)
            yield url
        finally:
            child.kill()
            child.wait()


@pytest.fixture
def idem(server: str) -> Iterator[Idem]:
    with Idem(server, api_key=KEYS["shop"]) as client:
        yield client


@pytest.fixture
async def aidem(server: str) -> AsyncIterator[AsyncIdem]:
    async with AsyncIdem(server, api_key=KEYS["shop"]) as client:
        yield client


@pytest.fixture
def ns() -> str:
    """A namespace of the test's own."""
    return "t-" + uuid.uuid4().hex[:12]
