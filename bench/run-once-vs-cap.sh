#!/usr/bin/env bash
# idem's run-once with one caller (crates/idem/benches/run_once.rs, new keys, no local cache)
# beside the most a caller that makes two round trips per call can do on the same Redis: half
# of what `redis-benchmark -c 1` (one connection, one command at a time) measures for SET with
# a value of a record's size. A first execution is a claim and a settle, two round trips at the
# least, so this cap is the honest ceiling for it. Interleaved: per round, the cap, then idem.
#   ROUNDS (default 3), DURATION seconds per scenario (default 5), REDIS_URL
#   (default redis://127.0.0.1:6379).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/.."
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-5}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
authority="${REDIS_URL#redis://}"
authority="${authority%%/*}"
host="${authority%%:*}"
port="${authority##*:}"
[ "$port" = "$authority" ] && port=6379

cargo bench --quiet --manifest-path "$root/Cargo.toml" -p idem --bench run_once --no-run >&2
echo "| round | SET/s, one connection | cap (÷ 2) | idem new keys/s | idem ÷ cap |"
echo "|---|---:|---:|---:|---:|"
for round in $(seq 1 "$ROUNDS"); do
  # About DURATION seconds of SETs of one key (`key:__rand_int__`, deleted at the end);
  # a record is about 200 bytes.
  sets=$(redis-benchmark -h "$host" -p "$port" -c 1 -n $((DURATION * 20000)) -t set -d 200 \
    --csv | awk -F'"' '/^"SET"/ { print $4 }')
  idem=$(cargo bench --quiet --manifest-path "$root/Cargo.toml" -p idem --bench run_once -- \
    --seconds "$DURATION" | python3 -c '
import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        r = json.loads(line)
        if r["scenario"] == "new" and not r["local_cache"]:
            print(r["per_sec"])')
  python3 -c "
sets, idem = float('$sets'), float('$idem')
print(f'| $round | {sets:.0f} | {sets / 2:.0f} | {idem:.0f} | {idem / (sets / 2):.2f} |')"
done
redis-cli -h "$host" -p "$port" DEL key:__rand_int__ >/dev/null
