"""Peer benchmark: AWS Lambda Powertools for Python `idempotent_function` on Redis.

PyPI `aws-lambda-powertools[redis]` with its Redis persistence layer
(RedisCachePersistenceLayer over a `redis` client). ONE caller: a single
thread making sequential calls to a trivial function
    work(order) -> {"ok": True, "n": order["n"]}
decorated with idempotent_function(data_keyword_argument="order", ...).
The idempotency key is Powertools' own: "<key_prefix>#md5(json(order))", with
key_prefix = "idem-peer-bench:powertools:<run id>:<scenario>:<lc|nolc>", so
no scenario or run can replay another's records. expires_after_seconds=3600.
Scenarios, each for DURATION seconds, each with use_local_cache=False and
True (Powertools' in-process LRU, local_cache_max_items=2048):
  new:    every call uses a fresh payload (a counter), so each call is a first
          execution. Checked: executions == calls.
  replay: a pool of 1,000 payloads is run once first (untimed); the timed
          calls cycle over the pool, so each is a replay of a completed
          record. Checked: no execution during the timed phase, and every
          replayed result equals what the first execution returned.
A failed check prints to stderr and exits 1.
Latency is time.perf_counter_ns() around each call (p50/p99 in us). `calls`
counts every call started before the deadline; `seconds` runs from the start
to the end of the last call.
Redis commands per call (read from the code of 3.37.0, confirmed with
redis-cli MONITOR): new = SET NX EX (in-progress) + SET EX (completed) = 2;
replay without local cache = SET NX EX (fails) + GET (inside the put) + GET
(get_record) = 3; replay with local cache = 0 (answered from the LRU).
stderr also gets an approximate commands/call from INFO total_commands_processed
(counts other clients of the same Redis too).

Env: REDIS_URL (redis://127.0.0.1:6379), DURATION (5); argv[1] overrides DURATION.
"""

import json
import math
import os
import sys
import time
import uuid
import warnings

import redis
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.persistence.redis import RedisCachePersistenceLayer

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
DURATION = float(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DURATION", "5"))
PREFIX = "idem-peer-bench:"
PEER = "powertools"
RUN_ID = uuid.uuid4().hex[:12]
REPLAY_POOL = 1000
EXPIRES_S = 3600
LOCAL_CACHE_MAX = 2048

EXECUTIONS = 0  # bumped by every real execution of the decorated function


class CheckFailed(Exception):
    pass


class FakeLambdaContext:
    """Stand-in for the Lambda context, as in Powertools' docs ("Testing your code").

    idempotent_function works without one, but then every save_inprogress
    calls warnings.warn("Couldn't determine the remaining time left. Did you
    call register_lambda_context ...") and in-progress records carry no
    in_progress_expiration. Registering a context avoids both, as a real
    Lambda handler would.
    """

    function_name = "idem-peer-bench"
    memory_limit_in_mb = 128
    invoked_function_arn = "arn:aws:lambda:eu-west-1:000000000000:function:idem-peer-bench"
    aws_request_id = "00000000-0000-0000-0000-000000000000"

    @staticmethod
    def get_remaining_time_in_millis():
        return 15 * 60 * 1000  # Lambda's maximum timeout


def make_work(client, scenario, local_cache):
    """A freshly decorated function with its own persistence layer and config.

    A persistence layer takes its settings (use_local_cache, LRU) from the first
    config it sees and ignores later ones, so each scenario gets a new one.
    """
    config = IdempotencyConfig(
        expires_after_seconds=EXPIRES_S,
        use_local_cache=local_cache,
        local_cache_max_items=LOCAL_CACHE_MAX,
    )
    config.register_lambda_context(FakeLambdaContext())
    with warnings.catch_warnings():
        # 3.37.0 marks RedisCachePersistenceLayer deprecated in favour of the
        # CachePersistenceLayer alias (the same class); silence that notice.
        warnings.simplefilter("ignore", DeprecationWarning)
        store = RedisCachePersistenceLayer(client=client)
    key_prefix = f"{PREFIX}{PEER}:{RUN_ID}:{scenario}:{'lc' if local_cache else 'nolc'}"

    @idempotent_function(data_keyword_argument="order", persistence_store=store, config=config, key_prefix=key_prefix)
    def work(order):
        global EXECUTIONS
        EXECUTIONS += 1
        return {"ok": True, "n": order["n"]}

    return work


def payload(n):
    return {"run": RUN_ID, "n": n}


def timed_loop(work, n_of_call, check):
    """Call work(order=payload(n_of_call(i))) until the deadline; return (calls, seconds, latencies_us)."""
    lat_ns = []
    start = time.perf_counter_ns()
    deadline = start + int(DURATION * 1e9)
    now = start
    i = 0
    while now < deadline:
        n = n_of_call(i)
        t0 = time.perf_counter_ns()
        result = work(order=payload(n))
        now = time.perf_counter_ns()
        lat_ns.append(now - t0)
        check(n, result)
        i += 1
    return i, (now - start) / 1e9, sorted(x / 1000 for x in lat_ns)


def expect_result(n, result):
    if result != {"ok": True, "n": n}:
        raise CheckFailed(f"call for n={n} returned {result!r}")


def commands_processed(client):
    return client.info("stats")["total_commands_processed"]


def scenario_new(client, local_cache):
    work = make_work(client, "new", local_cache)
    before_exec, before_cmds = EXECUTIONS, commands_processed(client)
    calls, seconds, lat = timed_loop(work, lambda i: i, expect_result)
    cmds = commands_processed(client) - before_cmds - 1
    executed = EXECUTIONS - before_exec
    if executed != calls:
        raise CheckFailed(f"new, local_cache={local_cache}: {executed} executions for {calls} calls")
    report("new", local_cache, calls, seconds, lat, cmds)


def scenario_replay(client, local_cache):
    work = make_work(client, "replay", local_cache)
    before_exec = EXECUTIONS
    for n in range(REPLAY_POOL):  # untimed first executions
        expect_result(n, work(order=payload(n)))
    if EXECUTIONS - before_exec != REPLAY_POOL:
        raise CheckFailed(f"replay pre-run: {EXECUTIONS - before_exec} executions for {REPLAY_POOL} keys")
    before_exec, before_cmds = EXECUTIONS, commands_processed(client)
    calls, seconds, lat = timed_loop(work, lambda i: i % REPLAY_POOL, expect_result)
    cmds = commands_processed(client) - before_cmds - 1
    if EXECUTIONS != before_exec:
        raise CheckFailed(
            f"replay, local_cache={local_cache}: {EXECUTIONS - before_exec} executions during {calls} replays"
        )
    report("replay", local_cache, calls, seconds, lat, cmds)


def pct(sorted_us, p):
    if not sorted_us:
        return None
    i = min(len(sorted_us) - 1, max(0, math.ceil(p * len(sorted_us)) - 1))
    return round(sorted_us[i], 1)


def report(scenario, local_cache, calls, seconds, lat_us, cmds):
    line = {
        "peer": PEER,
        "scenario": scenario,
        "local_cache": local_cache,
        "calls": calls,
        "seconds": round(seconds, 3),
        "per_sec": round(calls / seconds, 1),
        "p50_us": pct(lat_us, 0.5),
        "p99_us": pct(lat_us, 0.99),
    }
    print(json.dumps(line), flush=True)
    print(
        f"# {PEER} {scenario} local_cache={local_cache}: ~{cmds / calls:.2f} redis commands/call"
        " (INFO delta, includes other clients)",
        file=sys.stderr,
    )


def cleanup():
    conn = redis.Redis.from_url(REDIS_URL)
    keys = list(conn.scan_iter(match=f"{PREFIX}*", count=1000))
    for i in range(0, len(keys), 1000):
        conn.delete(*keys[i : i + 1000])
    conn.close()


def main():
    cleanup()
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    print(f"# {PEER}: run id {RUN_ID}, replay pool {REPLAY_POOL}, expiry {EXPIRES_S}s", file=sys.stderr)
    try:
        for local_cache in (False, True):
            scenario_new(client, local_cache)
        for local_cache in (False, True):
            scenario_replay(client, local_cache)
    except CheckFailed as e:
        print(f"powertools_bench: check failed: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
