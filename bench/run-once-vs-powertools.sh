#!/usr/bin/env bash
# idem's run-once (crates/idem/benches/run_once.rs) beside AWS Lambda Powertools'
# idempotent_function (bench/peers/powertools_bench.py) on one Redis, one caller each,
# interleaved: per round, idem then Powertools, every scenario with and without the local
# cache. Prints each round's rates and idem's ratio to Powertools per scenario.
#   ROUNDS (default 3), DURATION seconds per scenario (default 5), REDIS_URL.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/.."
ROUNDS="${ROUNDS:-3}"
export DURATION="${DURATION:-5}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT

cargo bench --quiet --manifest-path "$root/Cargo.toml" -p idem --bench run_once --no-run >&2
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round" >&2
  cargo bench --quiet --manifest-path "$root/Cargo.toml" -p idem --bench run_once -- \
    --seconds "$DURATION" | sed "s/^{/{\"round\":$round,/" >>"$out"
  PEERS=powertools "$here/peers/run.sh" | sed "s/^{/{\"round\":$round,/" >>"$out"
done

python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {(r["round"], r["peer"], r["scenario"], r["local_cache"]): r for r in rows}
print("| round | scenario | local cache | idem calls/s | Powertools calls/s | idem × Powertools |")
print("|---|---|---|---:|---:|---:|")
for (rnd, peer, scenario, cache), r in sorted(by.items()):
    if peer != "idem":
        continue
    p = by.get((rnd, "powertools", scenario, cache))
    if p:
        print(f"| {rnd} | {scenario} | {'yes' if cache else 'no'} | {r['per_sec']:.0f} | "
              f"{p['per_sec']:.0f} | {r['per_sec'] / p['per_sec']:.1f} |")
PY
