#!/usr/bin/env bash
# The CPU a consumer bench row costs each process: the bench (perf stat's task-clock),
# redis-server and nats-server (user and system time from /proc), over one run of
#   cargo bench -p idem-mq --bench consumer -- --only ROW --broker BROKER --messages N --rounds 1
# A run holds the `bare` row too, and every row publishes its messages before its timed
# consume: run ROW=bare alone as well and take its figures off the others'.
# Usage: bench/consumer-cpu.sh ROW [BROKER (nats)] [N (100000)]; needs perf, and the servers
# on this machine (one process each).
set -euo pipefail
cd "$(dirname "$0")/.."
row=${1:?a row: bare, idem-memory, idem-redis-1, redis-by-hand, …}
broker=${2:-nats}
n=${3:-100000}
# Builds the bench (if it is not built) and names its binary.
bin=$(cargo bench -p idem-mq --bench consumer --all-features --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("target", {}).get("name") == "consumer": print(m["executable"])')
ticks() { # user + system time of the named process, in clock ticks (0 if it is not running)
  local pid; pid=$(pgrep -x "$1" | head -1) || { echo 0; return; }
  awk '{print $14 + $15}' "/proc/$pid/stat"
}
hz=$(getconf CLK_TCK)
r0=$(ticks redis-server); n0=$(ticks nats-server)
out=$(perf stat -e task-clock -x, "$bin" --bench --only "$row" --broker "$broker" --messages "$n" --rounds 1 2>&1)
r1=$(ticks redis-server); n1=$(ticks nats-server)
echo "$out" | grep -E "^\| $broker \| 1 \|"
bench_ms=$(echo "$out" | awk -F, '/task-clock/ {printf "%d", $1}')
echo "CPU over the run, ms: bench $bench_ms, redis-server $(( (r1 - r0) * 1000 / hz )), nats-server $(( (n1 - n0) * 1000 / hz ))"
