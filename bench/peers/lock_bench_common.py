"""What the lock peers' benchmarks share: pairing acquisitions with releases into hand-off
latencies, percentiles, and the JSON line each scenario prints."""

import json
import math
import sys


class Violation(Exception):
    """Two clients held the lock at once."""


def handoffs(events, deadline):
    """Pair each acquisition with the latest release before it; keep cross-client ones (us)."""
    us, last_rel = [], None
    for t, kind, i in sorted(events):
        if kind == "rel":
            last_rel = (t, i)
        elif last_rel and last_rel[1] != i and t <= deadline:
            us.append((t - last_rel[0]) / 1000)
    return sorted(us)


def pct(sorted_us, p):
    if not sorted_us:
        return None
    i = min(len(sorted_us) - 1, max(0, math.ceil(p * len(sorted_us)) - 1))
    return round(sorted_us[i], 1)


def report(peer, scenario, clients, pairs, start, deadline, handoff_us):
    seconds = (deadline - start) / 1e9
    line = {
        "peer": peer,
        "scenario": scenario,
        "clients": clients,
        "pairs": pairs,
        "seconds": round(seconds, 3),
        "pairs_per_s": round(pairs / seconds, 1),
        "handoff_p50_us": pct(handoff_us, 0.5) if handoff_us is not None else None,
        "handoff_p99_us": pct(handoff_us, 0.99) if handoff_us is not None else None,
    }
    print(json.dumps(line), flush=True)
    if handoff_us is not None:
        print(f"# {peer} {scenario}: {len(handoff_us)} cross-client hand-offs in {pairs} pairs", file=sys.stderr)
