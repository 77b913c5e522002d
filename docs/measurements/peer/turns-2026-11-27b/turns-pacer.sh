#!/bin/bash
set -u
cd /work/main
OUT=${1:-/work/peer/turns-pacer}; mkdir -p "$OUT"
PY=/work/main/.venv/bin/python
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
date >> "$OUT/when.txt"
for label in card-pacer card-nopacer; do
  if [ $label = card-nopacer ]; then export CARD_TARGET_MAX_DECODE_SLOWDOWN=0; fi
  setsid /work/main/.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0 >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up 8013 && setsid nice -n 19 $PY /work/peer/turns.py http://127.0.0.1:8013 default trio-$label $OUT </dev/null >>"$OUT/turns.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
done
date >> "$OUT/when.txt"
