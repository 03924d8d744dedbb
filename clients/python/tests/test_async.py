"""The asyncio client: the same rules, awaited."""

from __future__ import annotations

import asyncio

import pytest

from idem_client import AsyncIdem, PreviousFailure
from idem_client.errors import FingerprintMismatch, InProgress


async def test_a_storm_of_tasks_on_one_key_runs_it_once(aidem: AsyncIdem, ns: str) -> None:
    runs = []

    @aidem.once(ns, key=lambda k: k)
    async def slow(k: str) -> str:
        runs.append(k)
        await asyncio.sleep(0.3)
        return f"result-{len(runs)}"

    results = await asyncio.gather(*(slow("one") for _ in range(20)))
    assert results == ["result-1"] * 20
    assert runs == ["one"]
    with pytest.raises(FingerprintMismatch):
        await aidem.begin(ns, "one", request="another")


async def test_steps_and_permanent_failures(aidem: AsyncIdem, ns: str) -> None:
    async def effect(name: str) -> str:
        return name

    async with aidem.run(ns, "t", request=1, lease=1.0) as run:
        assert await run.step("debit", effect, "debit") == "debit"
        await asyncio.sleep(1.5)  # kept alive past the lease's first end: not taken over
        with pytest.raises(InProgress):
            await aidem.begin(ns, "t", request=1)
        await run.complete("ok")
    async with aidem.run(ns, "t", request=1) as again:
        assert again.replayed and again.response == "ok"

    @aidem.once(ns, key=lambda k: k, permanent=(KeyError,))
    async def lookup(k: str) -> str:
        raise KeyError(k)

    with pytest.raises(KeyError):
        await lookup("missing")
    with pytest.raises(PreviousFailure):
        await lookup("missing")
    assert len(await aidem.uuid7(3)) == 3
