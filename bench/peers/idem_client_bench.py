"""The Python client (clients/python) over `idem serve` on Redis: the same calls as
powertools_bench.py, for the ratio between them.

ONE caller: a single thread making sequential calls to the same trivial function
    work(order) -> {"ok": True, "n": order["n"]}
decorated with ``@idem.once(namespace, key=…, payload=…)``: the key is the order's run and
number, the payload (fingerprinted) the order. Scenarios, each for DURATION seconds:
  new:    every call a fresh order, so each is a first execution (begin + complete: two calls
          to idem serve, each one Redis script or plain command there). Checked: executions ==
          calls.
  replay: a pool of 1,000 orders run once first (untimed); the timed calls cycle over it, so
          each is a replay (one call to idem serve, answered from its replay cache). Checked:
          no execution in the timed phase, every result the first one.
A failed check prints to stderr and exits 1. Output: one JSON line per scenario, as the peers'.

Beside the client, the same two calls written by hand (no retries, no lease renewal, no
fingerprint options), to show where the time goes: "stdlib-by-hand" on Python's http.client
(one keep-alive connection), the standard library's HTTP, and "httpx-by-hand" on httpx.Client
(keep-alive), which the client uses when given one. The client itself speaks HTTP/1.1 on its
own connections.

Env: IDEM_URL (the idem serve to call), IDEM_API_KEY (none), DURATION (5).
"""

import http.client
import json
import math
import os
import sys
import time
import uuid
from urllib.parse import urlparse

import httpx

from idem_client import Idem

URL = os.environ.get("IDEM_URL", "http://127.0.0.1:7070")
DURATION = float(os.environ.get("DURATION", "5"))
RUN_ID = uuid.uuid4().hex[:12]
REPLAY_POOL = 1000
EXECUTIONS = 0


class CheckFailed(Exception):
    pass


def make_work(idem, scenario):
    @idem.once(
        f"bench-{RUN_ID}-{scenario}",
        key=lambda order: f"{order['run']}:{order['n']}",
        payload=lambda order: order,
        ttl=3600,
    )
    def work(order):
        global EXECUTIONS
        EXECUTIONS += 1
        return {"ok": True, "n": order["n"]}

    return work


def timed(work, n_of_call):
    lat_ns = []
    start = time.perf_counter_ns()
    deadline = start + int(DURATION * 1e9)
    now, i = start, 0
    while now < deadline:
        n = n_of_call(i)
        t0 = time.perf_counter_ns()
        result = work({"run": RUN_ID, "n": n})
        now = time.perf_counter_ns()
        lat_ns.append(now - t0)
        if result != {"ok": True, "n": n}:
            raise CheckFailed(f"call for n={n} returned {result!r}")
        i += 1
    return i, (now - start) / 1e9, sorted(x / 1000 for x in lat_ns)


def pct(sorted_us, p):
    i = min(len(sorted_us) - 1, max(0, math.ceil(p * len(sorted_us)) - 1))
    return round(sorted_us[i], 1)


def by_hand(post, scenario):
    """The dedupe of work(order) written by hand over ``post(path, body) -> dict``: begin, then
    run and complete, or the replayed response."""
    ns = f"bench-{RUN_ID}-{scenario}"

    def work(order):
        global EXECUTIONS
        key = f"{order['run']}:{order['n']}"
        begun = post("/v1/records/begin", {"namespace": ns, "key": key, "request": order})
        if begun["outcome"] == "replay":
            return begun["response"]["value"]
        EXECUTIONS += 1
        result = {"ok": True, "n": order["n"]}
        lease = begun["lease"]["id"]
        body = {"namespace": ns, "key": key, "lease": lease, "response": {"value": result}}
        post("/v1/records/complete", body)
        return result

    return work


def httpx_post(client):
    return lambda path, body: client.post(path, json=body).json()


def stdlib_post(url):
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port)
    headers = {"content-type": "application/json"}

    def post(path, body):
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        return json.loads(conn.getresponse().read())

    return post


def scenarios(peer, make):
    global EXECUTIONS
    work = make("new")
    before = EXECUTIONS
    calls, seconds, lat = timed(work, lambda i: i)
    if EXECUTIONS - before != calls:
        raise CheckFailed(f"{peer} new: {EXECUTIONS - before} executions for {calls} calls")
    report(peer, "new", calls, seconds, lat)
    work = make("replay")
    for n in range(REPLAY_POOL):
        work({"run": RUN_ID, "n": n})
    before = EXECUTIONS
    calls, seconds, lat = timed(work, lambda i: i % REPLAY_POOL)
    if EXECUTIONS != before:
        raise CheckFailed(f"{peer} replay: {EXECUTIONS - before} executions in {calls} replays")
    report(peer, "replay", calls, seconds, lat)


def report(peer, scenario, calls, seconds, lat):
    print(
        json.dumps(
            {
                "peer": peer,
                "scenario": scenario,
                "local_cache": False,
                "calls": calls,
                "seconds": round(seconds, 3),
                "per_sec": round(calls / seconds, 1),
                "p50_us": pct(lat, 0.5),
                "p99_us": pct(lat, 0.99),
            }
        ),
        flush=True,
    )


def main():
    with Idem(URL, api_key=os.environ.get("IDEM_API_KEY")) as idem:
        scenarios("idem-client", lambda scenario: make_work(idem, scenario))
    with httpx.Client(base_url=URL) as client:
        post = httpx_post(client)
        scenarios("httpx-by-hand", lambda scenario: by_hand(post, f"httpx-{scenario}"))
    post = stdlib_post(URL)
    scenarios("stdlib-by-hand", lambda scenario: by_hand(post, f"stdlib-{scenario}"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as e:
        print(f"idem_client_bench: check failed: {e}", file=sys.stderr)
        sys.exit(1)
