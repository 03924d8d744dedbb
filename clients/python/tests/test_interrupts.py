"""Work stopped by what is not its failure (a cancelled task, a KeyboardInterrupt, a
SystemExit) may have had its effects, so no retry runs it again: a guarded coroutine and a
step run to their end and are recorded; a block stopped elsewhere keeps its key until the
lease ends, renewed no more."""

from __future__ import annotations

import asyncio
import time

import pytest

from idem_client import Acquired, AsyncIdem, Idem
from idem_client.errors import InProgress


async def test_a_caller_cancelled_after_the_effect_is_given_its_result_on_retry(
    aidem: AsyncIdem, ns: str
) -> None:
    runs: list[str] = []

    @aidem.once(ns, key=lambda k: k)
    async def charge(k: str) -> dict[str, str]:
        runs.append(k)  # the effect, done
        await asyncio.sleep(0.3)  # the answer on its way when the caller gives up
        return {"charge": f"ch-{len(runs)}"}

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(charge("o-1"), 0.1)
    assert await charge("o-1") == {"charge": "ch-1"}  # waits for the first, given its result
    assert runs == ["o-1"]


async def test_a_caller_cancelled_before_a_retryable_failure_lets_a_retry_run(
    aidem: AsyncIdem, ns: str
) -> None:
    runs: list[str] = []

    @aidem.once(ns, key=lambda k: k)
    async def flaky(k: str) -> str:
        runs.append(k)
        if len(runs) == 1:
            await asyncio.sleep(0.3)
            raise ConnectionError("the bank timed out before sending")
        return "paid"

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(flaky("o-1"), 0.1)
    await asyncio.sleep(0.4)  # the first failed after its caller left, and gave the key back
    assert await flaky("o-1") == "paid"
    assert runs == ["o-1", "o-1"]


async def test_a_cancelled_step_runs_to_its_end_and_is_recorded(aidem: AsyncIdem, ns: str) -> None:
    effects: list[str] = []

    async def debit() -> dict[str, str]:
        effects.append("debit")
        await asyncio.sleep(0.3)
        return {"hold": "h-1"}

    async def transfer() -> None:
        async with aidem.run(ns, "t", request=1, lease=0.6) as run:
            await run.step("debit", debit)
            await run.complete("done")

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(transfer(), 0.1)
    # Held while the step runs and until the lease ends (renewed no more once it is recorded).
    with pytest.raises(InProgress):
        await aidem.begin(ns, "t", request=1)
    taken = await taken_over(aidem, ns, "t")
    assert taken.steps and taken.steps[0].name == "debit" and taken.steps[0].done
    assert taken.steps[0].output == {"hold": "h-1"}
    assert effects == ["debit"]


async def test_a_block_cancelled_elsewhere_keeps_its_key_until_the_lease_ends(
    aidem: AsyncIdem, ns: str
) -> None:
    async def transfer() -> None:
        async with aidem.run(ns, "t", request=1, lease=0.6) as run:
            await asyncio.sleep(10)  # the effect is under way when the caller gives up
            await run.complete("done")

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(transfer(), 0.4)  # after one renewal
    with pytest.raises(InProgress):
        await aidem.begin(ns, "t", request=1)
    await taken_over(aidem, ns, "t")


async def taken_over(aidem: AsyncIdem, ns: str, key: str) -> Acquired:
    """The key, taken over once the lease it was kept under ends (within 3 s)."""
    deadline = time.monotonic() + 3
    while True:
        try:
            taken = await aidem.begin(ns, key, request=1)
            assert isinstance(taken, Acquired)
            return taken
        except InProgress:
            assert time.monotonic() < deadline, "the key was kept past its lease"
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_after_the_effect_never_runs_it_again(
    idem: Idem, ns: str, interrupt: type[BaseException]
) -> None:
    runs: list[str] = []

    @idem.once(ns, key=lambda k: k, lease=0.6, wait=0)
    def charge(k: str) -> str:
        runs.append(k)  # the effect, done
        if len(runs) == 1:
            raise interrupt()
        return "run again"

    with pytest.raises(interrupt):
        charge("o-1")
    with pytest.raises(InProgress):
        charge("o-1")
    assert runs == ["o-1"]
    time.sleep(1.0)  # renewed no more: the lease ends and an attempt may take over
    assert isinstance(idem.begin(ns, "o-1", request={"args": ["o-1"], "kwargs": {}}), Acquired)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_block_interrupted_after_a_step_keeps_its_key(
    idem: Idem, ns: str, interrupt: type[BaseException]
) -> None:
    with pytest.raises(interrupt):
        with idem.run(ns, "t", request=1, lease=0.6) as run:
            run.step("debit", lambda: {"hold": "h-1"})
            raise interrupt()
    with pytest.raises(InProgress):
        idem.begin(ns, "t", request=1)
    time.sleep(1.0)
    with idem.run(ns, "t", request=1) as again:
        assert again.steps["debit"].done and again.steps["debit"].output == {"hold": "h-1"}
        again.complete("done")
