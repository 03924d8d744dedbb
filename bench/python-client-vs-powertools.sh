#!/usr/bin/env bash
# The Python client (clients/python, bench/peers/idem_client_bench.py) over `idem serve` on
# Redis beside AWS Lambda Powertools' idempotent_function on the same Redis
# (bench/peers/powertools_bench.py), one caller each, interleaved: per round, the client, then
# Powertools. idem serve is the release build, on a Redis prefix of the run's own, with its
# replay cache (the default). Beside them, the same two calls written by hand on Python's
# http.client and on httpx (what the client's own HTTP/1.1 saves). Prints each round's rates
# and the client's ratio to Powertools.
#   ROUNDS (default 3), DURATION seconds per scenario (default 5), REDIS_URL.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/.."
ROUNDS="${ROUNDS:-3}"
export DURATION="${DURATION:-5}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
export IDEM_PEERS_DIR="${IDEM_PEERS_DIR:-$HOME/.cache/idem/peers}"
out="$(mktemp)"
prefix="idem-bench-pyclient-$$"

cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p idem-server --bin idem >&2
target="${CARGO_TARGET_DIR:-$root/target}"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$target/release/idem" serve --store "$REDIS_URL/?idem_prefix=$prefix:" --listen "127.0.0.1:$port" \
  2>/dev/null &
server=$!
trap 'kill $server 2>/dev/null; rm -f "$out"' EXIT
export IDEM_URL="http://127.0.0.1:$port"
until curl -sf "$IDEM_URL/healthz" >/dev/null; do sleep 0.1; done

# The peers' venv (Powertools) gets the client too.
PEERS=powertools DURATION=0.1 "$here/peers/run.sh" >/dev/null
"$IDEM_PEERS_DIR/venv/bin/pip" install --quiet --disable-pip-version-check "$root/clients/python" >&2

for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round" >&2
  "$IDEM_PEERS_DIR/venv/bin/python" "$here/peers/idem_client_bench.py" | sed "s/^{/{\"round\":$round,/" >>"$out"
  PEERS=powertools "$here/peers/run.sh" | sed "s/^{/{\"round\":$round,/" >>"$out"
done

python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {(r["round"], r["peer"], r["scenario"], r["local_cache"]): r["per_sec"] for r in rows}
print("| round | scenario | idem client | httpx by hand | stdlib by hand | Powertools (no cache / local cache) | client × Powertools (no cache / local cache) |")
print("|---|---|---:|---:|---:|---:|---:|")
for rnd in sorted({k[0] for k in by}):
    for scenario in ("new", "replay"):
        c = by[(rnd, "idem-client", scenario, False)]
        hx = by[(rnd, "httpx-by-hand", scenario, False)]
        std = by[(rnd, "stdlib-by-hand", scenario, False)]
        p, pc = by[(rnd, "powertools", scenario, False)], by[(rnd, "powertools", scenario, True)]
        print(f"| {rnd} | {scenario} | {c:.0f} | {hx:.0f} | {std:.0f} | {p:.0f} / {pc:.0f} | {c / p:.2f} / {c / pc:.2f} |")
PY
