"""Peer benchmark: PyPI `python-redis-lock` (module redis_lock) over `redis`.

Every lock client is a thread in this one process with its own redis
connection; each pair builds redis_lock.Lock(conn, name, expire=10) with
default settings (no auto_renewal), then acquire(blocking=True) and release().
Waiters block in BLPOP on the lock's signal list, which release() pushes to.
Scenarios:
  uncontended, clients=1 and 8: each client acquires/releases its OWN lock
    as fast as it can.
  contended, clients=8: all clients acquire (blocking) and release ONE shared
    lock. Hand-off latency = time from the releasing client starting release()
    to a DIFFERENT client's acquire() returning, paired through an event log
    on time.perf_counter_ns().
Each scenario runs for DURATION seconds. `pairs` counts acquire+release pairs
whose release returned before the deadline and `seconds` is that window;
clients still waiting at the deadline get the lock once more and then stop,
outside the window. Note the GIL: the 8 clients share one interpreter.
The library prefixes keys itself: lock:<name> and lock-signal:<name>.
Output: one JSON line per scenario on stdout (plus a hand-off count on stderr).

Env: REDIS_URL (redis://127.0.0.1:6379), DURATION (5); argv[1] overrides DURATION.
"""

import os
import sys
import threading
import time

import redis
import redis_lock

from lock_bench_common import Violation, handoffs, report

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
DURATION = float(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DURATION", "5"))
PREFIX = "idem-peer-bench:"
PEER = "python-redis-lock"
LEASE_S = 10


def run_clients(n, body):
    """Run body(conn, client_id, deadline) in n threads; return (pairs, start, deadline)."""
    conns = [redis.Redis.from_url(REDIS_URL) for _ in range(n)]
    for c in conns:
        c.ping()
    start = time.perf_counter_ns()
    deadline = start + int(DURATION * 1e9)
    counts, errors = [0] * n, []

    def worker(i):
        try:
            counts[i] = body(conns[i], i, deadline)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    if errors:
        raise errors[0]
    return sum(counts), start, deadline


def uncontended(clients):
    def body(conn, i, deadline):
        name = f"{PREFIX}{PEER}:uncontended:{clients}:{i}"
        pairs = 0
        while time.perf_counter_ns() < deadline:
            lock = redis_lock.Lock(conn, name, expire=LEASE_S)
            lock.acquire(blocking=True)
            lock.release()
            if time.perf_counter_ns() <= deadline:
                pairs += 1
        return pairs

    pairs, start, deadline = run_clients(clients, body)
    report(PEER, "uncontended", clients, pairs, start, deadline, None)


def contended(clients):
    name = f"{PREFIX}{PEER}:contended"
    events = []  # (t, kind, client); list.append is atomic under the GIL
    state = {"holder": None}
    guard = threading.Lock()

    def body(conn, i, deadline):
        pairs = 0
        while time.perf_counter_ns() < deadline:
            lock = redis_lock.Lock(conn, name, expire=LEASE_S)
            lock.acquire(blocking=True)
            events.append((time.perf_counter_ns(), "acq", i))
            with guard:
                if state["holder"] is not None:
                    raise Violation(f"client {i} acquired while client {state['holder']} holds the lock")
                state["holder"] = i
            time.sleep(0)  # yield the GIL so other clients run while we hold it: lets the check bite
            with guard:
                if state["holder"] != i:
                    raise Violation(f"client {state['holder']} took the lock from client {i}")
                state["holder"] = None
            events.append((time.perf_counter_ns(), "rel", i))
            lock.release()
            if time.perf_counter_ns() <= deadline:
                pairs += 1
        return pairs

    pairs, start, deadline = run_clients(clients, body)
    report(PEER, "contended", clients, pairs, start, deadline, handoffs(events, deadline))


def cleanup():
    conn = redis.Redis.from_url(REDIS_URL)
    for pattern in (f"{PREFIX}*", f"lock:{PREFIX}*", f"lock-signal:{PREFIX}*"):
        keys = list(conn.scan_iter(match=pattern, count=1000))
        if keys:
            conn.delete(*keys)
    conn.close()


def main():
    cleanup()
    try:
        uncontended(1)
        uncontended(8)
        contended(8)
    except Violation as e:
        print(f"python_redis_lock_bench: mutual exclusion violated: {e}", file=sys.stderr)
        return 1
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
