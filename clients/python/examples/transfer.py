"""A transfer that must happen once, however often it is retried, and that resumes after a
crash: run `idem serve` (cargo run --release --bin idem -- serve), then

    python clients/python/examples/transfer.py [IDEM_URL] [API_KEY]
"""

import sys
import uuid

from idem_client import Idem, PreviousFailure

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7070"
idem = Idem(url, api_key=sys.argv[2] if len(sys.argv) > 2 else None)
run_id = uuid.uuid4().hex[:8]  # a fresh run each time the example is run
moved: list[str] = []


class InsufficientFunds(Exception):
    pass


@idem.once(f"example-{run_id}", key=lambda t: t["id"], permanent=(InsufficientFunds,))
def transfer(t: dict[str, object]) -> dict[str, object]:
    if int(str(t["amount"])) > 1000:
        raise InsufficientFunds(f"cannot move {t['amount']}")
    moved.append(str(t["id"]))
    return {"transfer": t["id"], "status": "sent"}


order = {"id": "t-1", "amount": 100, "to": "bob"}
for attempt in (1, 2, 3):  # a client that timed out and retries
    print(f"attempt {attempt}: {transfer(order)}")
print(f"money moved {len(moved)} time(s)")

too_much = {"id": "t-2", "amount": 5000, "to": "bob"}
for attempt in (1, 2):
    try:
        transfer(too_much)
    except (InsufficientFunds, PreviousFailure) as e:
        print(f"attempt {attempt}: refused: {e!r}")

# Steps: each one recorded as it finishes, skipped by an attempt that takes over after a crash.
with idem.run(f"example-{run_id}", "t-3", request={"amount": 50}, step_keys=["bank"]) as run:
    hold = run.step("debit", lambda: {"hold": "h-1"})
    sent = run.step("bank", lambda: {"sent_with_key": run.step_keys["bank"][:12]})
    run.complete({"hold": hold, "sent": sent})
with idem.run(f"example-{run_id}", "t-3", request={"amount": 50}) as again:
    print(f"t-3 replayed: {again.replayed}, response: {again.response}")
