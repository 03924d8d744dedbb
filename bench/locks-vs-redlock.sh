#!/usr/bin/env bash
# idem's Redis locks beside redlock, interleaved: per round, the lock bench's Redis rows
# (idem, the floor of our scripts and redis-benchmark's limits, then contended and tokens),
# then redlock's three scenarios, on the same Redis.
#   ROUNDS (default 3), DURATION seconds per scenario (default 5); see bench/peers/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
export DURATION="${DURATION:-5}"
cargo bench -q -p idem --bench locks --no-run >&2
for round in $(seq 1 "$ROUNDS"); do
  echo "## round $round"
  IDEM_BENCH_BACKENDS=redis IDEM_BENCH_SECONDS="$DURATION" cargo bench -q -p idem --bench locks 2>/dev/null | grep '^|'
  PEERS=redlock bench/peers/run.sh
done
