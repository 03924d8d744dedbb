"""The first caller is given what every retry is given: a result, a step's output and a
response as JSON carries them; a value JSON cannot carry is refused before it is stored."""

from __future__ import annotations

import enum
from collections import namedtuple
from typing import Any

import pytest

from idem_client import AsyncIdem, Idem, PreviousFailure


class Tier(enum.IntEnum):
    GOLD = 1


Point = namedtuple("Point", "x y")

#: A value that JSON changes on the way, and what it becomes.
CHANGED = (
    {7: "a", 2.5: "b", True: "c", None: "d", "pair": (1, 2), "tier": Tier.GOLD, "at": Point(3, 4)}
)
CARRIED = {"7": "a", "2.5": "b", "true": "c", "null": "d", "pair": [1, 2], "tier": 1, "at": [3, 4]}

#: Results idem cannot store: what JSON cannot carry, and one past the server's 1 MiB limit.
REFUSED = {
    "nan": float("nan"),
    "inf": float("inf"),
    "keys that collide": {1: "a", "1": "b"},
    "a lone surrogate": "\ud800",
    "an object": {"at": object()},
    "too large": "x" * (2 << 20),
}


def test_the_first_call_gets_what_a_retry_gets(idem: Idem, ns: str) -> None:
    @idem.once(ns, key=lambda k: k)
    def answer(k: str) -> Any:
        return CHANGED

    first = answer("k")
    assert first == answer("k") == CARRIED
    assert type(first["tier"]) is int


def test_a_step_and_a_response_are_returned_as_recorded(idem: Idem, ns: str) -> None:
    with idem.run(ns, "k", request=1) as run:
        assert run.step("s", lambda: CHANGED) == CARRIED
        assert run.complete({"out": (1, 2)}) == {"out": [1, 2]}
    with idem.run(ns, "k", request=1) as again:
        assert again.replayed and again.response == {"out": [1, 2]}


@pytest.mark.parametrize("value", REFUSED.values(), ids=REFUSED.keys())
def test_a_result_idem_cannot_store_is_refused_and_never_run_again(
    idem: Idem, ns: str, value: Any
) -> None:
    runs = []

    @idem.once(ns, key=lambda k: k)
    def answer(k: str) -> Any:
        runs.append(k)
        return value

    for _ in range(2):
        with pytest.raises(PreviousFailure) as kept:
            answer("k")
        assert kept.value.type_name == "ResultNotKept"
    assert runs == ["k"]


def test_arguments_whose_keys_collide_in_json_are_refused(idem: Idem, ns: str) -> None:
    runs = []

    @idem.once(ns, key=lambda order: "k")
    def charge(order: dict[Any, str]) -> str:
        runs.append(order)
        return "done"

    with pytest.raises(TypeError, match="payload="):
        charge({1: "a", "1": "b"})  # one fingerprint for two calls, if it were let through
    assert runs == []


async def test_the_first_awaited_call_gets_what_a_retry_gets(aidem: AsyncIdem, ns: str) -> None:
    @aidem.once(ns, key=lambda k: k)
    async def answer(k: str) -> Any:
        return CHANGED

    assert await answer("k") == await answer("k") == CARRIED

    async def step() -> Any:
        return CHANGED

    async with aidem.run(ns, "r", request=1) as run:
        assert await run.step("s", step) == CARRIED
        assert await run.complete((1, 2)) == [1, 2]
