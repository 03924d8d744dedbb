#!/usr/bin/env bash
# Runs every command of BENCHMARKS.md's headline table in turn, in the table's order, each
# printing its rows with the ratio to its peer measured in the same run. The figures in the
# table come from these outputs; a headline whose service or peer is missing is skipped by its
# own bench with a note, as in the tests.
#
#   bench/headline.sh            # every headline, one after the other
#   bench/headline.sh store ids  # only the headlines whose name contains one of the words
#
# ROUNDS (default 3) and DURATION (seconds per scenario, default 5) go to the benches that
# take them. The Valkey 9 headlines run against VALKEY_URL (a server of `.ci/valkey` started
# by hand, e.g. redis://127.0.0.1:6390), and are skipped with a note without it. Output: a
# `### <headline>` line, then the bench's own output, for each.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-5}"
VALKEY_URL="${VALKEY_URL:-}"

# name | command (run with bash -c, from the repository's root)
headlines=(
  "store (memory, SQLite, PostgreSQL, MariaDB, Redis)|cargo bench -q -p idem-store --all-features --bench store"
  "gateway on SQLite|cargo bench -q -p idem-server --bench gateway -- --seconds $DURATION --rounds $ROUNDS"
  "layer on Redis|cargo bench -q -p idem-http --bench layer -- --seconds $DURATION --rounds $ROUNDS"
  "gRPC layer on Redis|cargo bench -q -p idem-http --bench grpc -- --seconds $DURATION --rounds $ROUNDS"
  "layer on Valkey 9|REDIS_URL=$VALKEY_URL cargo bench -q -p idem-http --bench layer -- --seconds $DURATION --rounds $ROUNDS --only 'new keys'"
  "run-once against Powertools|ROUNDS=$ROUNDS DURATION=$DURATION bench/run-once-vs-powertools.sh"
  "Python client against Powertools|ROUNDS=$ROUNDS DURATION=$DURATION bench/python-client-vs-powertools.sh"
  "run-once against two round trips, Valkey 9|REDIS_URL=$VALKEY_URL ROUNDS=$ROUNDS DURATION=$DURATION bench/run-once-vs-cap.sh"
  "locks against redlock|ROUNDS=$ROUNDS DURATION=$DURATION bench/locks-vs-redlock.sh"
  "locks on Valkey 9|IDEM_BENCH_ROUNDS=$ROUNDS IDEM_BENCH_BACKENDS=redis IDEM_BENCH_SECONDS=$DURATION IDEM_TEST_REDIS_URL=$VALKEY_URL cargo bench -q -p idem --bench locks"
  "consumer on RabbitMQ|cargo bench -q -p idem-mq --bench consumer -- --rounds $ROUNDS --only idem-redis --broker rabbitmq"
  "consumer on NATS|cargo bench -q -p idem-mq --bench consumer -- --prefetch 256 --only idem-redis --broker nats --messages 40000 --rounds $ROUNDS"
  "consumers on Valkey 9, RabbitMQ|IDEM_TEST_REDIS_URL=$VALKEY_URL cargo bench -q -p idem-mq --bench consumer -- --rounds $ROUNDS --only idem-redis --broker rabbitmq"
  "consumers on Valkey 9, NATS|IDEM_TEST_REDIS_URL=$VALKEY_URL cargo bench -q -p idem-mq --bench consumer -- --prefetch 256 --only idem-redis --broker nats --messages 40000 --rounds $ROUNDS"
  "consumer on Redis Streams, Valkey 9|IDEM_TEST_REDIS_URL=$VALKEY_URL cargo bench -q -p idem-mq --bench consumer -- --broker redis-streams --prefetch 256 --only idem-redis --messages 40000 --rounds $ROUNDS"
  "relay|cargo bench -q -p idem-server --bench relay"
  "ids|cargo bench -q -p idem-id --bench ids"
  "listing records on SQLite|cargo bench -q -p idem-store --bench listing_sqlite"
)

# Whether headline $1 is among the words that follow (all are, when none follow).
wanted() {
  local name=$1
  shift
  [ "$#" -eq 0 ] && return 0
  for word in "$@"; do
    case $name in *"$word"*) return 0 ;; esac
  done
  return 1
}

for entry in "${headlines[@]}"; do
  name=${entry%%|*}
  command=${entry#*|}
  wanted "$name" "$@" || continue
  echo "### $name"
  if [[ $name == *"Valkey 9"* && -z $VALKEY_URL ]]; then
    echo "skipped: set VALKEY_URL to a Valkey 9 server's URL (see .ci/valkey)"
    echo
    continue
  fi
  echo "\$ $command"
  bash -c "$command"
  echo
done
