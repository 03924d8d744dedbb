"""Steps: recorded as work goes, skipped with their output by the attempt that takes over
after a process is killed mid-work, again and again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from idem_client import Idem

from conftest import KEYS

CHILD = textwrap.dedent(
    """
    import sys, time
    from idem_client import Idem

    url, key, ns, effects = sys.argv[1:5]
    idem = Idem(url, api_key=key)

    def effect(name):
        with open(effects, "a") as f:
            f.write(name + "\\n")
        return {"done": name}

    # Each step an earlier attempt recorded is skipped; the first new one is done, printed,
    # and the process waits to be killed.
    with idem.run(ns, "transfer-1", request={"amount": 100}, lease=1.0, wait=10) as run:
        for name in ("debit", "fee", "credit"):
            if name in run.steps and run.steps[name].done:
                continue
            run.step(name, effect, name)
            print(name, flush=True)
            time.sleep(60)
    """
)


def test_a_process_killed_after_each_step_is_resumed_each_time(
    idem: Idem, server: str, ns: str, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    # Two workers in turn, each killed after recording one step: the next takes the key over
    # once the killed one's lease (1 s, renewed no more) ends, and does the next step.
    for expected in (b"debit", b"fee"):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, server, KEYS["shop"], ns, str(effects)],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == expected
        child.send_signal(signal.SIGKILL)
        child.wait()

    def effect(name: str) -> dict[str, str]:
        with open(effects, "a") as f:
            f.write(name + "\n")
        return {"done": name}

    with idem.run(ns, "transfer-1", request={"amount": 100}, wait=10) as run:
        assert not run.replayed
        assert run.steps["debit"].done and run.steps["fee"].done
        outputs = {name: run.step(name, effect, name) for name in ("debit", "fee", "credit")}
        run.complete(outputs)
    assert effects.read_text().split() == ["debit", "fee", "credit"]
    assert outputs == {name: {"done": name} for name in ("debit", "fee", "credit")}
    with idem.run(ns, "transfer-1", request={"amount": 100}) as again:
        assert again.replayed
        assert again.response == outputs


def test_step_keys_are_the_same_on_every_attempt(idem: Idem, ns: str) -> None:
    with idem.run(ns, "k", request=1, step_keys=["bank"]) as first:
        bank_key = first.step_keys["bank"]
        first.release()
    with idem.run(ns, "k", request=1, step_keys=["bank"]) as second:
        assert second.step_keys["bank"] == bank_key
        second.complete("ok")
