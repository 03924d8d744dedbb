"""The asyncio client: the same rules, awaited."""

from __future__ import annotations

import asyncio

import pytest

from idem_client import Acquired, AsyncIdem, LeaseLost, PreviousFailure
from idem_client.errors import FingerprintMismatch, InProgress, LockHeld


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


async def test_a_run_sees_that_its_key_was_taken_over(aidem: AsyncIdem, ns: str) -> None:
    with pytest.raises(LeaseLost):
        async with aidem.run(ns, "k", request=1, lease=0.6) as run:
            assert run.lease is not None
            lost_at_first = run.lost
            await aidem.release(ns, "k", run.lease)
            other = await aidem.begin(ns, "k", request=1)
            for _ in range(100):
                if run.lost:
                    break
                await asyncio.sleep(0.05)
            assert run.lost
            assert not lost_at_first and isinstance(other, Acquired)
            await aidem.complete(ns, "k", other.lease, "the other's")
            await run.complete("mine")
    assert (await aidem.record(ns, "k"))["response"] == "the other's"  # type: ignore[index]


async def test_a_lock_waited_for_is_had_with_a_higher_fence(aidem: AsyncIdem, ns: str) -> None:
    name = f"{ns}-lock"
    async with aidem.lock(name, lease=5) as first:
        waiter = asyncio.create_task(aidem.lock(name, lease=5, wait=5).__aenter__())
        await asyncio.sleep(0.3)
        assert not waiter.done()  # still waiting while the first holds it
        await first.renew(2)
    second = await asyncio.wait_for(waiter, 10)
    assert second.fence > first.fence
    with pytest.raises(LockHeld):
        async with aidem.lock(name, lease=5):
            pass
    await second.__aexit__(None, None, None)
    async with aidem.lock(name, lease=5) as third:
        assert third.fence > second.fence


async def test_a_result_too_large_to_keep_runs_once(aidem: AsyncIdem, ns: str) -> None:
    runs = []

    @aidem.once(ns, key=lambda k: k, lease=1)
    async def huge(k: str) -> str:
        runs.append(k)
        return "x" * (2 << 20)  # past the server's 1 MiB limit: refused before it is sent

    for _ in range(2):
        with pytest.raises(PreviousFailure) as kept:
            await huge("k")
        assert kept.value.type_name == "ResultNotKept"
    await asyncio.sleep(1.2)  # past the lease: still kept, not run again
    with pytest.raises(PreviousFailure):
        await huge("k")
    assert runs == ["k"]


async def test_a_settled_run_is_renewed_no_more(aidem: AsyncIdem, ns: str) -> None:
    async with aidem.run(ns, "k", request=1, lease=0.3) as run:
        await run.complete("done")
        await asyncio.sleep(0.5)  # past a beat: a renewal now would be stale
        assert not run.lost


async def test_a_step_whose_output_cannot_be_kept_never_runs_again(
    aidem: AsyncIdem, ns: str
) -> None:
    effects = []

    async def effect() -> str:
        effects.append(1)
        return "y" * (2 << 20)

    for _ in range(2):
        with pytest.raises(PreviousFailure):
            async with aidem.run(ns, "k", request=1) as run:
                if run.replayed:
                    raise PreviousFailure("replayed", str(run.response))
                await run.step("big", effect)
    assert effects == [1]
