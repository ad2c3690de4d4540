#!/usr/bin/env bash
# Set up, then start a local Apogee cluster (a nameserver, a broker and the schedule service as
# background processes, data under $APOGEE_HOME/local, default ~/.apogee/local), create a demo
# topic, send a message, look it up and receive it as a consumer group, then send a message due
# in 2 seconds and watch it arrive. Running it again is harmless: a running cluster is reused
# (and the demo group only receives what is new since its last run).
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
echo "==> sending a message due in 2 seconds (a timer message, delivered by the schedule service)"
id=$(apogee send DemoOrders --tag reminder --deliver-in 2 '{"order": 1, "remind": true}')
echo "sent message $id at $(date +%T); waiting for it"
apogee consume DemoOrders --group demo-readers --count 1 --timeout 15
echo "received at $(date +%T)"
cat <<'NEXT'
The cluster keeps running in the background. Open the console (`uv run apogee cluster status`
prints its URL) to see topics, groups, lag and messages in a browser. Try next (from this
folder):
  uv run apogee cluster status
  uv run apogee topic describe DemoOrders
  seq 1 5 | uv run apogee send DemoOrders --key batch      # one message per line
  uv run apogee send DemoOrders --delay-level 3 'in 10 s'  # levels 1s 5s 10s 30s 1m 2m ... 2h
  uv run apogee send DemoOrders --deliver-in 60 'in a minute'  # or --deliver-at ISO-TIME+OFFSET
  uv run apogee consume DemoOrders --group demo-readers --timeout 70  # watch them arrive
  uv run apogee message query --topic DemoOrders --key order-1
  uv run apogee group describe demo-readers               # offsets and lag of the group
  uv run apogee cluster down                                # stop it; the data is kept
The five-minute tour in README.md goes further.
NEXT
