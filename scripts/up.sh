#!/usr/bin/env bash
# Set up, then start a local Apogee cluster (a nameserver and a broker as background processes,
# data under $APOGEE_HOME/local, default ~/.apogee/local), create a demo topic, send a message,
# look it up and receive it as a consumer group. Running it again is harmless: a running cluster
# is reused (and the demo group only receives what is new since its last run).
source "$(dirname "$0")/_env.sh"
apogee() { uv run --frozen apogee "$@"; }

echo "==> starting the local cluster"
apogee cluster up
echo "==> creating the demo topic"
apogee topic create DemoOrders --queues 4
echo "==> sending a message"
id=$(apogee send DemoOrders --tag created --key order-1 --property source=demo '{"order": 1}')
echo "sent message $id"
echo "==> looking it up by id"
apogee message get "$id"
echo "==> receiving it as consumer group demo-readers"
apogee consume DemoOrders --group demo-readers --from earliest --timeout 3
cat <<'NEXT'
The cluster keeps running in the background. Try next (from this folder):
  uv run apogee cluster status
  uv run apogee topic describe DemoOrders
  seq 1 5 | uv run apogee send DemoOrders --key batch      # one message per line
  uv run apogee message query --topic DemoOrders --key order-1
  uv run apogee group describe demo-readers               # offsets and lag of the group
  uv run apogee cluster down                                # stop it; the data is kept
The five-minute tour in README.md goes further.
NEXT
