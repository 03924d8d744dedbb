"""A client of `idem serve`: run work once per key, in steps that resume after a crash, with
ids, one-time tokens and fenced locks, for Python programs (sync and asyncio).

    from idem_client import Idem

    idem = Idem("http://127.0.0.1:7070", api_key="…")

    @idem.once("orders", key=lambda order: order["id"])
    def charge(order): ...
"""

from ._core import Acquired, Lease, Replay, Step
from .aio import AsyncIdem, AsyncLock, AsyncRun
from .client import Idem, Lock, Run
from .errors import IdemError, LeaseLost, PreviousFailure

__all__ = [
    "Acquired",
    "AsyncIdem",
    "AsyncLock",
    "AsyncRun",
    "Idem",
    "IdemError",
    "Lease",
    "LeaseLost",
    "Lock",
    "PreviousFailure",
    "Replay",
    "Run",
    "Step",
]
