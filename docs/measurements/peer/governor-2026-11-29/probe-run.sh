#!/bin/bash
# label, env..., -- then card-client up extra args
cd /work/main
label=$1; shift
setsid env "$@" .venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0 > /tmp/gov/up-$label.log 2>&1 < /dev/null &
U=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:8013/v1/models >/dev/null && break; sleep 1; done
sleep 3
for off in 0 100; do
  nice .venv/bin/python docs/measurements/peer/turns-2026-11-29/probe_ttft.py http://127.0.0.1:8013 default $off | sed "s/^/$label /"
done
curl -s http://127.0.0.1:8013/metrics | grep -E "^card_target_engine_thread_changes_total" | sed "s/^/$label /"
kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
