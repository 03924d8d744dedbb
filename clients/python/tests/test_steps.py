"""Steps: recorded as work goes, skipped with their output by the attempt that takes over
after a process is killed mid-work."""

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

    with idem.run(ns, "transfer-1", request={"amount": 100}, lease=1.0) as run:
        run.step("debit", effect, "debit")
        print("debited", flush=True)
        time.sleep(60)
    """
)


def test_a_killed_process_is_resumed_after_its_last_step(
    idem: Idem, server: str, ns: str, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, server, KEYS["shop"], ns, str(effects)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"debited"
    child.send_signal(signal.SIGKILL)
    child.wait()

    def effect(name: str) -> dict[str, str]:
        with open(effects, "a") as f:
            f.write(name + "\n")
        return {"done": name}

    # The killed attempt's lease (1 s, renewed no more) ends; this one takes over.
    with idem.run(ns, "transfer-1", request={"amount": 100}, wait=10) as run:
        assert not run.replayed
        assert run.steps["debit"].done
        debit = run.step("debit", effect, "debit")
        credit = run.step("credit", effect, "credit")
        run.complete({"debit": debit, "credit": credit})
    assert effects.read_text().split() == ["debit", "credit"]
    assert debit == {"done": "debit"}
    with idem.run(ns, "transfer-1", request={"amount": 100}) as again:
        assert again.replayed
        assert again.response == {"debit": {"done": "debit"}, "credit": {"done": "credit"}}


def test_step_keys_are_the_same_on_every_attempt(idem: Idem, ns: str) -> None:
    with idem.run(ns, "k", request=1, step_keys=["bank"]) as first:
        bank_key = first.step_keys["bank"]
        first.release()
    with idem.run(ns, "k", request=1, step_keys=["bank"]) as second:
        assert second.step_keys["bank"] == bank_key
        second.complete("ok")
