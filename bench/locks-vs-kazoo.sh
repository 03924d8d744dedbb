#!/usr/bin/env bash
# idem's ZooKeeper locks beside kazoo's Lock recipe, interleaved on one ZooKeeper server this
# script starts (Debian's zookeeper, default settings but a loopback port and a temporary
# data directory): per round, the lock bench's ZooKeeper rows, then kazoo's three scenarios,
# then idem's Redis lock, contended, on the machine's Redis (IDEM_TEST_REDIS_URL) for scale.
#   ROUNDS (default 3), DURATION seconds per scenario (default 5); see bench/peers/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
export DURATION="${DURATION:-5}"
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$dir/zoo.cfg" <<CFG
tickTime=2000
dataDir=$dir/data
clientPort=$port
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=ruok
CFG
mkdir -p "$dir/data"
java -cp "/usr/share/java/*:/etc/zookeeper/conf" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg" >"$dir/server.log" 2>&1 &
zk=$!
trap 'kill $zk 2>/dev/null; rm -rf "$dir"' EXIT
until python3 -c "import socket,sys; s=socket.create_connection(('127.0.0.1',$port)); s.sendall(b'ruok'); sys.exit(s.recv(4)!=b'imok')" 2>/dev/null; do sleep 0.2; done
export ZK_HOSTS="127.0.0.1:$port" IDEM_BENCH_ZK_HOSTS="127.0.0.1:$port"
cargo bench -q -p idem --bench locks --no-run >&2
for round in $(seq 1 "$ROUNDS"); do
  echo "## round $round"
  IDEM_BENCH_BACKENDS=zookeeper IDEM_BENCH_SECONDS="$DURATION" cargo bench -q -p idem --bench locks 2>/dev/null | grep '^| zookeeper'
  PEERS=kazoo bench/peers/run.sh
  IDEM_BENCH_BACKENDS=redis IDEM_BENCH_SECONDS="$DURATION" cargo bench -q -p idem --bench locks 2>/dev/null | grep '^| redis | contended'
done
