#!/bin/bash
set -u
cd /work/main
OUT=${1:-/work/peer/turns-threads}; mkdir -p "$OUT"
PY=/work/main/.venv/bin/python
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
date >> "$OUT/when.txt"
for label in card-t1 card-t2; do
  T=1; [ $label = card-t2 ] && T=2
  setsid /work/main/.venv/bin/card-client up --target-threads $T --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0 >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up 8013 && setsid nice -n 19 $PY /work/peer/turns.py http://127.0.0.1:8013 default trio-$label $OUT </dev/null >>"$OUT/turns.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
done
date >> "$OUT/when.txt"
