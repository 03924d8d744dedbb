"""Peer benchmark: PyPI `etcd3` (python-etcd3)'s Lock on etcd.

python-etcd3's Lock is the Python ecosystem's etcd lock: a key created in a
transaction only if it does not exist (create_revision == 0), attached to an
etcd lease of `ttl` seconds; a waiter watches that one key and tries again
when it is deleted. Every lock client is a thread in this one process with
its own etcd3 client (its own gRPC channel); each pair is acquire() and
release() with ttl=60. Its waiter starts watching only after its attempt
failed, so a release in between is missed: with no timeout it waits for
ever (seen here), so acquire(timeout=1) is called until it succeeds, and a
missed release costs up to a second.
Scenarios, as the other peers':
  uncontended, clients=1 and 8: each client acquires/releases its OWN lock
    as fast as it can.
  contended, clients=8: all clients acquire (blocking) and release ONE shared
    lock. Hand-off latency = time from the releasing client starting release()
    to a DIFFERENT client's acquire() returning, paired through an event log
    on time.perf_counter_ns().
Each scenario runs for DURATION seconds. Note the GIL: the 8 clients share one
interpreter (grpcio's own threads too).
Output: one JSON line per scenario on stdout (plus a hand-off count on stderr).

Env: ETCD_ENDPOINT (127.0.0.1:2379), DURATION (5); argv[1] overrides DURATION.
"""

import os
import sys
import threading
import time
import uuid

import etcd3

from lock_bench_common import Violation, handoffs, report

HOST, PORT = os.environ.get("ETCD_ENDPOINT", "127.0.0.1:2379").rsplit(":", 1)
DURATION = float(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DURATION", "5"))
ROOT = f"idem-peer-bench-{uuid.uuid4().hex[:8]}"
PEER = "python-etcd3"
TTL = 60


def run_clients(n, body):
    """Run body(client, client_id, deadline) in n threads; return (pairs, start, deadline)."""
    clients = [etcd3.client(host=HOST, port=int(PORT)) for _ in range(n)]
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
        c.close()
    if errors:
        raise errors[0]
    return sum(counts), start, deadline


def uncontended(clients):
    def body(etcd, i, deadline):
        lock = etcd.lock(f"{ROOT}-uncontended-{clients}-{i}", ttl=TTL)
        pairs = 0
        while time.perf_counter_ns() < deadline:
            while not lock.acquire(timeout=1):
                pass
            lock.release()
            if time.perf_counter_ns() <= deadline:
                pairs += 1
        return pairs

    pairs, start, deadline = run_clients(clients, body)
    report(PEER, "uncontended", clients, pairs, start, deadline, None)


def contended(clients):
    name = f"{ROOT}-contended"
    events = []  # (t, kind, client); list.append is atomic under the GIL
    state = {"holder": None}
    guard = threading.Lock()

    def body(etcd, i, deadline):
        lock = etcd.lock(name, ttl=TTL)
        pairs = 0
        while time.perf_counter_ns() < deadline:
            while not lock.acquire(timeout=1):
                pass
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


def main():
    try:
        uncontended(1)
        uncontended(8)
        contended(8)
    except Violation as e:
        print(f"etcd3_lock_bench: mutual exclusion violated: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
