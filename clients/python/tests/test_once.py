"""Running work once per key: the decorator, permanent and retryable failures, a storm of
callers on one key, waiting for an attempt in flight, lease renewal, and locks."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
import pytest

from idem_client import Acquired, Idem, LeaseLost, PreviousFailure
from idem_client.errors import FingerprintMismatch, InProgress, LockHeld


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


def test_arguments_that_are_not_json_need_a_payload(idem: Idem, ns: str) -> None:
    runs = []

    @idem.once(ns, key=lambda thing: "k")
    def handle(thing: object) -> str:
        runs.append(thing)
        return "done"

    with pytest.raises(TypeError, match="payload="):
        handle(object())
    assert runs == []


def test_every_run_is_kept_alive(idem: Idem, ns: str) -> None:
    # Eight runs with 0.6 s leases, each working 1.5 s, on one client: all kept alive.
    done = []

    def work(n: int) -> None:
        with idem.run(ns, f"k{n}", request=n, lease=0.6) as run:
            time.sleep(1.5)
            with pytest.raises(InProgress):
                idem.begin(ns, f"k{n}", request=n)
            run.complete(n)
            done.append(n)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert sorted(done) == list(range(8))


def test_a_short_lease_is_kept_while_the_keeper_waits_for_a_long_one(idem: Idem, ns: str) -> None:
    with idem.run(ns, "long", request=1, lease=60):
        # The keeper now waits 20 s for the long lease's renewal; a shorter one comes first.
        with idem.run(ns, "short", request=1, lease=0.6) as run:
            time.sleep(1.5)
            with pytest.raises(InProgress):
                idem.begin(ns, "short", request=1)
            run.complete("kept")


def test_a_settled_run_is_renewed_no_more(idem: Idem, ns: str) -> None:
    with idem.run(ns, "k", request=1, lease=0.3) as run:
        run.complete("done")
    time.sleep(0.5)  # past its renewal's beat: a renewal of a settled record would be stale
    assert not run.lost


def test_a_run_sees_that_its_key_was_taken_over(idem: Idem, ns: str) -> None:
    with pytest.raises(LeaseLost):
        with idem.run(ns, "k", request=1, lease=0.6) as run:
            assert run.lease is not None
            lost_at_first = run.lost
            # Another attempt takes the key: this run's lease is given back behind its back.
            idem.release(ns, "k", run.lease)
            other = idem.begin(ns, "k", request=1)
            deadline = time.monotonic() + 5
            while not run.lost and time.monotonic() < deadline:
                time.sleep(0.05)
            assert run.lost  # seen by the renewal, which then stops
            assert not lost_at_first and isinstance(other, Acquired)
            idem.complete(ns, "k", other.lease, "the other's")
            run.complete("mine")
    assert idem.record(ns, "k")["response"] == "the other's"  # type: ignore[index]


def test_a_lock_waited_for_is_had_with_a_higher_fence(idem: Idem, ns: str) -> None:
    name = f"{ns}-lock"
    fences = []
    with idem.lock(name, lease=5) as first:
        fences.append(first.fence)
        got: list[int] = []
        waiter = threading.Thread(
            target=lambda: got.append(idem.lock(name, lease=5, wait=5).acquire().fence)
        )
        waiter.start()
        time.sleep(0.3)
        assert got == []  # still waiting while the first holds it
    waiter.join(10)
    assert len(got) == 1 and got[0] > fences[0]
    with pytest.raises(LockHeld):
        idem.lock(name, lease=5, wait=0).acquire()  # the waiter holds it now


def test_a_storm_over_many_keys_runs_each_once(idem: Idem, ns: str) -> None:
    runs: dict[str, int] = {}
    lock = threading.Lock()

    @idem.once(ns, key=lambda k: k, wait=30)
    def work(k: str) -> dict[str, Any]:
        with lock:
            runs[k] = runs.get(k, 0) + 1
        time.sleep(0.1)
        return {"key": k, "run": runs[k]}

    keys = [f"k-{i % 8}" for i in range(256)]
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(work, keys))
    assert results == [{"key": k, "run": 1} for k in keys]
    assert runs == {f"k-{i}": 1 for i in range(8)}


def test_the_keepers_thread_ends_when_idle_and_comes_back(
    server: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idem_client import client as blocking

    from conftest import KEYS

    monkeypatch.setattr(blocking, "_KEEPER_IDLE", 0.2)
    idem = Idem(server, api_key=KEYS["shop"])  # never closed, as a careless program leaves one
    # Its renewal would come up after 0.1 s; found ended then, the thread is idle.
    with idem.run(ns, "first", request=1, lease=0.3) as run:
        run.complete(1)
    thread = idem._keeper._thread
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive() and idem._keeper._thread is None
    # The next run starts it again: its short lease is kept alive past its length.
    with idem.run(ns, "second", request=2, lease=0.6) as run:
        time.sleep(1.2)
        with pytest.raises(InProgress):
            idem.begin(ns, "second", request=2)
        run.complete(2)


def fake_idem(renew: Callable[[str, int], httpx.Response]) -> Idem:
    """A client of a fake server that hands out leases and answers renewals with
    ``renew(key, nth renewal of that key)``."""
    counts: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/records/begin":
            lease = {"id": f"1.{body['key']}", "fence": 1, "expires_at": "2030-01-01T00:00:00Z"}
            return httpx.Response(200, json={"outcome": "acquired", "lease": lease, "steps": []})
        if request.url.path == "/v1/records/renew":
            counts[body["key"]] = counts.get(body["key"], 0) + 1
            return renew(body["key"], counts[body["key"]])
        return httpx.Response(200, json={})

    client = httpx.Client(base_url="http://idem", transport=httpx.MockTransport(handler))
    return Idem(client=client, attempts=1)


def test_an_answer_not_understood_does_not_stop_the_renewals() -> None:
    renewals: list[str] = []

    def renew(key: str, n: int) -> httpx.Response:
        renewals.append(key)
        if n == 1:
            return httpx.Response(200, text="<html>a proxy's page</html>")
        return httpx.Response(200, json={"lease": {"id": "x", "fence": 1, "expires_at": "z"}})

    idem = fake_idem(renew)
    with idem.run("n", "first", request=1, lease=0.3) as run:
        time.sleep(0.7)  # beats every 0.1 s
        run.complete(1)
    with idem.run("n", "second", request=1, lease=0.3) as run:
        time.sleep(0.5)
        run.complete(1)
    assert renewals.count("first") >= 3
    assert renewals.count("second") >= 2


def test_a_slow_renewal_holds_up_no_other_run() -> None:
    renewals: list[str] = []

    def renew(key: str, n: int) -> httpx.Response:
        renewals.append(key)
        if key == "slow":
            time.sleep(2)
        return httpx.Response(200, json={"lease": {"id": "x", "fence": 1, "expires_at": "z"}})

    idem = fake_idem(renew)
    with idem.run("n", "slow", request=1, lease=0.3):
        time.sleep(0.15)  # the slow run's renewal is under way
        with idem.run("n", "fast", request=1, lease=0.3) as fast:
            time.sleep(1.0)
            fast.complete(1)
    assert renewals.count("fast") >= 5


def test_a_forked_child_keeps_its_own_runs_alive(server: str, ns: str) -> None:
    from conftest import KEYS

    with Idem(server, api_key=KEYS["shop"]) as idem:
        with idem.run(ns, "parent", request=1, lease=0.6) as run:  # starts the keeper
            run.complete(1)
        pid = os.fork()
        if pid == 0:  # the child: a run past its lease, then whether another attempt was held off
            code = 1
            try:
                with idem.run(ns, "child", request=1, lease=0.6) as run:
                    time.sleep(1.5)
                    try:
                        idem.begin(ns, "child", request=1)
                    except InProgress:
                        code = 0
                    run.complete(1)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert idem.uuid7() != []  # the parent's connections still work


def test_a_step_whose_output_cannot_be_kept_never_runs_again(idem: Idem, ns: str) -> None:
    effects = []

    def effect() -> float:
        effects.append(1)
        return float("nan")  # not JSON

    for _ in range(2):
        with pytest.raises(PreviousFailure):
            with idem.run(ns, "k", request=1) as run:
                if run.replayed:
                    raise PreviousFailure("replayed", str(run.response))
                run.step("nan", effect)
    assert effects == [1]


def test_a_lock_can_be_waited_for_past_the_call_timeout(server: str, ns: str) -> None:
    from conftest import KEYS

    name = f"{ns}-lock"
    with Idem(server, api_key=KEYS["shop"], timeout=1) as idem:
        first = idem.lock(name, lease=2).acquire()  # never released: held for 2 s
        waited = idem.lock(name, lease=5, wait=4).acquire()
        assert waited.fence > first.fence


def test_records_named_dot_cannot_be_read_by_url(idem: Idem, ns: str) -> None:
    for key in (".", ".."):
        with pytest.raises(ValueError):
            idem.record(ns, key)
