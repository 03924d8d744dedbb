#!/usr/bin/env bash
# idem's etcd locks beside python-etcd3's Lock, interleaved on one etcd server this script
# starts (Debian's etcd-server, default settings but loopback ports and a temporary data
# directory): per round, the lock bench's etcd rows, then python-etcd3's three scenarios, then
# idem's Redis lock, contended, on the machine's Redis (IDEM_TEST_REDIS_URL) for scale.
#   ROUNDS (default 3), DURATION seconds per scenario (default 5); see bench/peers/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
export DURATION="${DURATION:-5}"
dir=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
peer=$(free_port)
etcd --name bench --data-dir "$dir/data" \
  --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
  --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
  --initial-cluster "bench=http://127.0.0.1:$peer" >"$dir/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$dir"' EXIT
until curl -sf "http://127.0.0.1:$port/health" | grep -q true; do sleep 0.2; done
export ETCD_ENDPOINT="127.0.0.1:$port" IDEM_BENCH_ETCD_ENDPOINTS="127.0.0.1:$port"
cargo bench -q -p idem --features etcd --bench locks --no-run >&2
for round in $(seq 1 "$ROUNDS"); do
  echo "## round $round"
  IDEM_BENCH_BACKENDS=etcd IDEM_BENCH_SECONDS="$DURATION" cargo bench -q -p idem --features etcd --bench locks 2>/dev/null | grep '^| etcd'
  PEERS=etcd3 bench/peers/run.sh
  IDEM_BENCH_BACKENDS=redis IDEM_BENCH_SECONDS="$DURATION" cargo bench -q -p idem --features etcd --bench locks 2>/dev/null | grep '^| redis | contended'
done
