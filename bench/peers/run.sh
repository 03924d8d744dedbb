#!/usr/bin/env bash
# Installs the peer libraries outside the repo and runs their benchmarks.
#   IDEM_PEERS_DIR  install dir (default $HOME/.cache/idem/peers): node_modules + venv
#   REDIS_URL       Redis to bench against (default redis://127.0.0.1:6379)
#   DURATION        seconds per scenario (default 5)
#   ZK_HOSTS        ZooKeeper for kazoo (default 127.0.0.1:2181)
#   ETCD_ENDPOINT   etcd for python-etcd3 (default 127.0.0.1:2379)
#   PEERS           space-separated subset of: redlock python-redis-lock powertools kazoo
#                   etcd3 (default: all but kazoo and etcd3, in that order)
# Installs are skipped when the pinned manifests there already match these.
# stdout: one JSON line per scenario; install logs and notes go to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export IDEM_PEERS_DIR="${IDEM_PEERS_DIR:-$HOME/.cache/idem/peers}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
export DURATION="${DURATION:-5}"
all_peers="redlock python-redis-lock powertools kazoo etcd3"
PEERS="${PEERS:-redlock python-redis-lock powertools}"
for p in $PEERS; do
  case " $all_peers " in
    *" $p "*) ;;
    *) echo "run.sh: unknown peer '$p' in PEERS (known: $all_peers)" >&2; exit 2 ;;
  esac
done
mkdir -p "$IDEM_PEERS_DIR"

# Node peer: redlock + ioredis, exactly as locked in package-lock.json.
if ! cmp -s "$here/package.json" "$IDEM_PEERS_DIR/package.json" \
  || ! cmp -s "$here/package-lock.json" "$IDEM_PEERS_DIR/package-lock.json" \
  || [ ! -d "$IDEM_PEERS_DIR/node_modules/redlock" ]; then
  cp "$here/package.json" "$here/package-lock.json" "$IDEM_PEERS_DIR/"
  npm ci --prefix "$IDEM_PEERS_DIR" --no-audit --no-fund >&2
fi

# Python peers: python-redis-lock, aws-lambda-powertools + redis, kazoo, etcd3, in one venv.
venv="$IDEM_PEERS_DIR/venv"
if ! cmp -s "$here/requirements.txt" "$venv/requirements.txt"; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt" >&2
  cp "$here/requirements.txt" "$venv/requirements.txt"
fi

for p in $PEERS; do
  case "$p" in
    redlock) node "$here/redlock_bench.mjs" ;;
    python-redis-lock) "$venv/bin/python" "$here/python_redis_lock_bench.py" ;;
    powertools) "$venv/bin/python" "$here/powertools_bench.py" ;;
    kazoo) "$venv/bin/python" "$here/kazoo_lock_bench.py" ;;
    etcd3) "$venv/bin/python" "$here/etcd3_lock_bench.py" ;;
  esac
done
