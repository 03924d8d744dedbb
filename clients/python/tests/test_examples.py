"""The example of the docs runs, and shows what it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import KEYS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transfer.py"


def test_the_transfer_example_moves_money_once(server: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), server, KEYS["shop"]],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(EXAMPLE.parents[1] / "src")},
    ).stdout
    assert "money moved 1 time(s)" in out, out
    assert "attempt 2: refused: PreviousFailure" in out, out
    assert "t-3 replayed: True" in out, out
