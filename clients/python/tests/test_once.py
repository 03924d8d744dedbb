"""Running work once per key: the decorator, permanent and retryable failures, a storm of
callers on one key, waiting for an attempt in flight, and lease renewal."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from idem_client import Idem, LeaseLost, PreviousFailure
from idem_client.errors import FingerprintMismatch, InProgress


def test_a_call_runs_once_and_every_retry_gets_its_result(idem: Idem, ns: str) -> None:
    runs: list[dict[str, Any]] = []

    @idem.once(ns, key=lambda order: order["id"])
    def charge(order: dict[str, Any]) -> dict[str, Any]:
        runs.append(order)
        return {"charge": f"ch-{len(runs)}", "amount": order["amount"]}

    first = charge({"id": "o-1", "amount": 100})
    assert charge({"id": "o-1", "amount": 100}) == first == {"charge": "ch-1", "amount": 100}
    assert len(runs) == 1
    assert charge({"id": "o-2", "amount": 100}) == {"charge": "ch-2", "amount": 100}
    # The same key with another payload is another request: refused, never run.
    with pytest.raises(FingerprintMismatch):
        charge({"id": "o-1", "amount": 999})
    assert len(runs) == 2


def test_only_selected_fields_are_fingerprinted(idem: Idem, ns: str) -> None:
    runs = []

    @idem.once(ns, key=lambda o: o["id"], payload=lambda o: {"amount": o["amount"]})
    def charge(o: dict[str, Any]) -> int:
        runs.append(o)
        return len(runs)

    assert charge({"id": "o", "amount": 5, "sent_at": 1}) == 1
    assert charge({"id": "o", "amount": 5, "sent_at": 2}) == 1


def test_a_permanent_failure_is_kept_and_a_retryable_one_runs_again(idem: Idem, ns: str) -> None:
    runs = {"declined": 0, "flaky": 0}

    @idem.once(ns, key=lambda k: k, permanent=(ValueError,))
    def pay(k: str) -> str:
        runs[k] += 1
        if k == "declined":
            raise ValueError("card declined")
        if runs[k] == 1:
            raise ConnectionError("bank timed out before sending")
        return "paid"

    with pytest.raises(ValueError):
        pay("declined")
    with pytest.raises(PreviousFailure) as kept:
        pay("declined")
    assert (kept.value.type_name, kept.value.message) == ("ValueError", "card declined")
    assert runs["declined"] == 1
    with pytest.raises(ConnectionError):
        pay("flaky")
    assert pay("flaky") == "paid"
    assert pay("flaky") == "paid"
    assert runs["flaky"] == 2


def test_a_storm_of_callers_on_one_key_runs_it_once(idem: Idem, ns: str) -> None:
    runs = []
    lock = threading.Lock()

    @idem.once(ns, key=lambda k: k, wait=30)
    def slow(k: str) -> str:
        with lock:
            runs.append(k)
        time.sleep(0.3)
        return f"result-{len(runs)}"

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: slow("one"), range(32)))
    assert results == ["result-1"] * 32
    assert runs == ["one"]


def test_a_call_that_cannot_wait_for_the_one_in_flight_is_refused(idem: Idem, ns: str) -> None:
    started, finish = threading.Event(), threading.Event()

    @idem.once(ns, key=lambda k: k, wait=0)
    def held(k: str) -> str:
        started.set()
        finish.wait(10)
        return "done"

    first = threading.Thread(target=held, args=("k",))
    first.start()
    assert started.wait(10)
    with pytest.raises(InProgress) as refused:
        held("k")
    assert refused.value.retry_after is not None
    finish.set()
    first.join()
    assert held("k") == "done"


def test_a_renewed_lease_outlives_its_length(idem: Idem, ns: str) -> None:
    # A 1 s lease kept alive through 2.5 s of work: no other attempt takes the key.
    with idem.run(ns, "long", request=1, lease=1.0) as run:
        time.sleep(2.5)
        with pytest.raises(InProgress):
            idem.begin(ns, "long", request=1)
        run.complete("kept")
    assert idem.begin(ns, "long", request=1).response == "kept"  # type: ignore[union-attr]


def test_work_that_outlives_a_lease_not_kept_alive_loses_it(idem: Idem, ns: str) -> None:
    with pytest.raises(LeaseLost):
        with idem.run(ns, "lost", request=1, lease=1.0, keep_alive=False) as run:
            time.sleep(1.3)
            other = idem.begin(ns, "lost", request=1)
            idem.complete(ns, "lost", other.lease, "the other's")  # type: ignore[union-attr]
            run.complete("mine")
    assert idem.begin(ns, "lost", request=1).response == "the other's"  # type: ignore[union-attr]


def test_a_result_idem_cannot_store_is_never_run_again(idem: Idem, ns: str) -> None:
    runs = []

    @idem.once(ns, key=lambda k: k)
    def huge(k: str) -> str:
        runs.append(k)
        return "x" * (2 << 20)  # past the server's 1 MiB body limit

    for _ in range(2):
        with pytest.raises(PreviousFailure) as kept:
            huge("big")
        assert kept.value.type_name == "ResultNotKept"
    assert runs == ["big"]


def test_arguments_that_are_not_json_need_a_payload(idem: Idem, ns: str) -> None:
    runs = []

    @idem.once(ns, key=lambda thing: "k")
    def handle(thing: object) -> str:
        runs.append(thing)
        return "done"

    with pytest.raises(TypeError, match="payload="):
        handle(object())
    assert runs == []
