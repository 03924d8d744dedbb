#!/usr/bin/env bash
# What the Redis store's settle (`complete`) costs the server, beside plain commands, in
# interleaved rounds of redis-benchmark on one connection with PIPELINE commands in flight
# (default 128: deep enough that the server's work, not the round trip or waking up, sets the
# rate; with 16 a plain GET measured 5 µs on a quiet machine, against 1 µs here). The scripts are built from the store's own
# Lua (`RECORD` in crates/idem-store/src/redis/scripts.rs) on an in-progress record of the
# store's layout:
#   GET, SET      plain commands on a value of the record's size
#   nop           EVALSHA of a script that touches no key (what calling a script costs)
#   read          the store's `record()`: GET and the checks of the layout
#   settle        `record()`, the lease and fence checks and `rewrite()`, as a settle runs
#                 them (rewriting the record in its own state, so every call does the work)
#   unchecked     an experiment, not shipped: the same settle reading only the fields it
#                 needs, without the layout checks
# ROUNDS (default 3), REQUESTS per row (default 200000), PIPELINE (default 128), REDIS_HOST
# and REDIS_PORT (default 127.0.0.1:6379); keys bench-settle:* are written and deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
REQUESTS="${REQUESTS:-200000}"
PIPELINE="${PIPELINE:-128}"
HOST="${REDIS_HOST:-127.0.0.1}"
PORT="${REDIS_PORT:-6379}"
cli() { redis-cli -h "$HOST" -p "$PORT" "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"; cli del bench-settle:q bench-settle:s >/dev/null' EXIT

python3 - "$work" <<'PY'
import re, subprocess, sys
work = sys.argv[1]
src = open('crates/idem-store/src/redis/scripts.rs').read()
record = re.search(r'pub\(super\) const RECORD: &str = r"(.*?)";\n', src, re.S).group(1)
args = "local now, id, fence, margin = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])\n"
scripts = {
    'nop': "return 'ok'\n",
    'read': record + "local v = record(KEYS[1]) return 'ok'\n",
    'settle': record + args + """
local v, st, f, _, ttl, exp, kb = record(KEYS[1])
if not v or exp <= now or string.sub(v, 35, 50) ~= id or f ~= fence then return 'stale' end
rewrite(KEYS[1], v, st, ttl, kb, now, margin, nil)
return 'ok'
""",
    'unchecked': args + """
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 35, 50) ~= id or string.sub(v, 2, 2) ~= 'p' then return 'stale' end
local f, ttl, exp = tonumber(string.sub(v, 51, 70)), tonumber(string.sub(v, 87, 102)),
  tonumber(string.sub(v, 135, 150))
if f ~= fence or exp <= now then return 'stale' end
local e = math.min(now + ttl, 9007199254740991)
local px = string.format('%d', e - now + margin)
redis.call('SET', KEYS[1], string.sub(v, 1, 118) .. string.format('%016d%016d', now, e)
  .. string.sub(v, 151), 'PX', px)
redis.call('PEXPIRE', KEYS[1] .. ':s', px)
return 'ok'
""",
}
for name, text in scripts.items():
    open(f'{work}/{name}.lua', 'w').write(text)
# An in-progress record in the store's layout (format 2): a printable lease id, so that it can
# be passed on redis-benchmark's command line.
now = 1795685103352
key = b'relay orders m-12345'
kb = b'%04d' % len(key) + key
value = (b'2p' + b'F' * 32 + b'A' * 16 + b'%020d' % 1 + b'%016d' % (now + 30000)
         + b'%016d' % 600000 + b'%016d' % now + b'%016d' % now + b'%016d' % (now + 600000) + kb)
open(f'{work}/record', 'wb').write(value)
PY
cli -x set bench-settle:q <"$work/record" >/dev/null
value=$(printf 'x%.0s' $(seq 1 "$(stat -c %s "$work/record")"))
declare -A sha
for s in nop read settle unchecked; do sha[$s]=$(cli script load "$(cat "$work/$s.lua")"); done
args=(1 bench-settle:q 1795685103352 AAAAAAAAAAAAAAAA 1 10000)
[ "$(cli evalsha "${sha[settle]}" "${args[@]}")" = ok ] || { echo "the settle did not run" >&2; exit 1; }

echo "| round | command | per second | µs each |"
echo "|---:|---|---:|---:|"
for round in $(seq 1 "$ROUNDS"); do
  for s in GET SET nop read settle unchecked; do
    case $s in
      GET) cmd=(GET bench-settle:q) ;;
      SET) cmd=(SET bench-settle:s "$value" PX 600000) ;;
      *) cmd=(EVALSHA "${sha[$s]}" "${args[@]}") ;;
    esac
    rate=$(redis-benchmark -h "$HOST" -p "$PORT" -q -n "$REQUESTS" -c 1 -P "$PIPELINE" "${cmd[@]}" \
      | tr '\r' '\n' | grep 'requests per second' | tail -1 | grep -o '[0-9.]* requests' | grep -o '^[0-9.]*')
    echo "| $round | $s | ${rate%.*} | $(python3 -c "print(f'{1e6/$rate:.1f}')") |"
  done
done
