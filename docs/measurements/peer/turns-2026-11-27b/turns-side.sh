#!/bin/bash
# Two-turn TTFT side by side: vLLM's CPU build, then the trio (card-client up, default pair) with
# prefix caching on and off; one server at a time, each in its own session, the harness niced.
set -u
cd /work/main
OUT=${1:-/work/peer/turns}; mkdir -p "$OUT"
PY=/work/main/.venv/bin/python
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
date >> "$OUT/when.txt"
setsid bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012 >"$OUT/vllm.log" 2>&1 </dev/null &
V=$!; wait_up 8012 && setsid nice -n 19 $PY /work/peer/turns.py http://127.0.0.1:8012 smollm2-135m vllm $OUT </dev/null >>"$OUT/turns.log" 2>&1
kill -INT -- -$V; sleep 8; kill -KILL -- -$V 2>/dev/null; sleep 2
for label in card card-nocache; do
  if [ $label = card-nocache ]; then export CARD_TARGET_ENABLE_PREFIX_CACHING=false; fi
  setsid /work/main/.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0 >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up 8013 && setsid nice -n 19 $PY /work/peer/turns.py http://127.0.0.1:8013 default trio-$label $OUT </dev/null >>"$OUT/turns.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
done
date >> "$OUT/when.txt"
