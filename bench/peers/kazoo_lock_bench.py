"""Peer benchmark: PyPI `kazoo`'s Lock recipe on ZooKeeper.

kazoo's Lock is the reference recipe: an ephemeral sequential node under the
lock's path, the lowest holds, each waiter watches the node just below its
own. Every lock client is a thread in this one process with its own
KazooClient (its own session); each pair is acquire(blocking=True) and
release() of kazoo.recipe.lock.Lock with default settings.
Scenarios, as the other peers':
  uncontended, clients=1 and 8: each client acquires/releases its OWN lock
    as fast as it can.
  contended, clients=8: all clients acquire (blocking) and release ONE shared
    lock. Hand-off latency = time from the releasing client starting release()
    to a DIFFERENT client's acquire() returning, paired through an event log
    on time.perf_counter_ns().
Each scenario runs for DURATION seconds. Note the GIL: the 8 clients share one
interpreter (kazoo's own threads too).
Output: one JSON line per scenario on stdout (plus a hand-off count on stderr).

Env: ZK_HOSTS (127.0.0.1:2181), DURATION (5); argv[1] overrides DURATION.
"""

import os
import sys
import threading
import time
import uuid

from kazoo.client import KazooClient

from lock_bench_common import Violation, handoffs, report

ZK_HOSTS = os.environ.get("ZK_HOSTS", "127.0.0.1:2181")
DURATION = float(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DURATION", "5"))
ROOT = f"/idem-peer-bench/{uuid.uuid4().hex[:8]}"
PEER = "kazoo"


def run_clients(n, body):
    """Run body(client, client_id, deadline) in n threads; return (pairs, start, deadline)."""
    clients = [KazooClient(hosts=ZK_HOSTS) for _ in range(n)]
    for c in clients:
        c.start(timeout=10)
    start = time.perf_counter_ns()
    deadline = start + int(DURATION * 1e9)
    counts, errors = [0] * n, []

    def worker(i):
        try:
            counts[i] = body(clients[i], i, deadline)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.stop()
        c.close()
    if errors:
        raise errors[0]
    return sum(counts), start, deadline


def uncontended(clients):
    def body(zk, i, deadline):
        lock = zk.Lock(f"{ROOT}/uncontended-{clients}-{i}", f"client-{i}")
        pairs = 0
        while time.perf_counter_ns() < deadline:
            lock.acquire(blocking=True)
            lock.release()
            if time.perf_counter_ns() <= deadline:
                pairs += 1
        return pairs

    pairs, start, deadline = run_clients(clients, body)
    report(PEER, "uncontended", clients, pairs, start, deadline, None)


def contended(clients):
    path = f"{ROOT}/contended"
    events = []  # (t, kind, client); list.append is atomic under the GIL
    state = {"holder": None}
    guard = threading.Lock()

    def body(zk, i, deadline):
        lock = zk.Lock(path, f"client-{i}")
        pairs = 0
        while time.perf_counter_ns() < deadline:
            lock.acquire(blocking=True)
            events.append((time.perf_counter_ns(), "acq", i))
            with guard:
                if state["holder"] is not None:
                    raise Violation(f"client {i} acquired while client {state['holder']} holds the lock")
                state["holder"] = i
            time.sleep(0)
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
    zk = KazooClient(hosts=ZK_HOSTS)
    zk.start(timeout=10)
    zk.delete(ROOT, recursive=True)
    zk.stop()
    zk.close()


def main():
    try:
        uncontended(1)
        uncontended(8)
        contended(8)
    except Violation as e:
        print(f"kazoo_lock_bench: mutual exclusion violated: {e}", file=sys.stderr)
        return 1
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
