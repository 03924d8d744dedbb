"""Every problem code as an exception, the server's refusals as the right ones, and idem's
own calls retried when the server is unavailable."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from idem_client import Idem, IdemError
from idem_client.errors import (
    BY_CODE,
    AlreadyUsed,
    BadInput,
    Conflict,
    FingerprintMismatch,
    InvalidKey,
    NotOwner,
    StaleLease,
    StoreUnavailable,
    Unauthorized,
    Unavailable,
    Unreachable,
)

from conftest import KEYS

README = Path(__file__).resolve().parents[3] / "README.md"


def test_every_code_of_the_catalogue_has_its_exception() -> None:
    table = re.findall(r"^\| (\d{3}) \| `([a-z_]+)` \|", README.read_text(), re.M)
    assert table, "the README's problem-code table"
    assert {code for _, code in table} == set(BY_CODE)
    for status, code in table:
        cls = BY_CODE[code]
        assert cls.code == code
        expected = {409: Conflict, 422: Conflict, 503: Unavailable, 429: Unavailable}
        if int(status) in expected:
            assert issubclass(cls, expected[int(status)]), code
        elif int(status) < 500:
            assert issubclass(cls, BadInput), code


def test_refusals_are_raised_as_their_codes(idem: Idem, server: str, ns: str) -> None:
    acquired = idem.begin(ns, "k", request=1)
    with pytest.raises(FingerprintMismatch) as e:
        idem.begin(ns, "k", request=2)
    assert e.value.status == 422 and e.value.code == "fingerprint_mismatch"
    idem.release(ns, "k", acquired.lease)  # type: ignore[union-attr]
    with pytest.raises(StaleLease):
        idem.complete(ns, "k", acquired.lease, "late")  # type: ignore[union-attr]
    with pytest.raises(InvalidKey):
        idem.begin(ns, "k" * 300, request=1)
    with Idem(server, api_key="not-a-key") as stranger:
        with pytest.raises(Unauthorized):
            stranger.begin(ns, "k", request=1)
    token = idem.issue_token("form")
    idem.consume_token(token, "form")
    with pytest.raises(AlreadyUsed):
        idem.consume_token(token, "form")
    with idem.lock(f"{ns}-lock", lease=5) as lock:
        assert lock.fence > 0
        lock.renew()
    with pytest.raises(NotOwner):
        lock.renew()


def test_keys_are_the_callers_own(server: str, ns: str) -> None:
    with Idem(server, api_key=KEYS["shop"]) as shop, Idem(server, api_key=KEYS["bank"]) as bank:
        with shop.run(ns, "same", request=1) as run:
            run.complete("shop's")
        with bank.run(ns, "same", request=1) as run:
            assert not run.replayed
            run.complete("bank's")
        assert shop.record(ns, "same")["response"] == "shop's"  # type: ignore[index]


def test_calls_are_retried_while_the_store_is_unavailable() -> None:
    answers = iter(
        [
            httpx.Response(
                503,
                json={"code": "store_unavailable", "detail": "down", "retry_after_ms": 10},
            ),
            httpx.Response(503, json={"code": "store_unavailable", "detail": "down"}),
            httpx.Response(200, json={"ids": ["01a1fdca-467a-7000-8015-a20556160a95"]}),
        ]
    )
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return next(answers)

    client = httpx.Client(base_url="http://idem", transport=httpx.MockTransport(handler))
    assert Idem(client=client).uuid7() == ["01a1fdca-467a-7000-8015-a20556160a95"]
    assert len(seen) == 3
    # Out of attempts: the last refusal is raised.
    client = httpx.Client(
        base_url="http://idem",
        transport=httpx.MockTransport(
            lambda _: httpx.Response(503, json={"code": "store_unavailable", "detail": "down"})
        ),
    )
    with pytest.raises(StoreUnavailable):
        Idem(client=client, attempts=2).uuid7()
    # A refusal that retrying cannot mend is raised at once.
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(409, json={"code": "in_progress", "detail": "held"})

    client = httpx.Client(base_url="http://idem", transport=httpx.MockTransport(refuse))
    with pytest.raises(IdemError):
        Idem(client=client).begin("n", "k", request=1)
    assert len(calls) == 1


def test_a_server_that_does_not_answer_is_unreachable() -> None:
    with socket_closed_port() as url:
        with pytest.raises(Unreachable):
            Idem(url, attempts=2, timeout=1).uuid7()


class socket_closed_port:
    """A loopback URL where nothing listens."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        pass
