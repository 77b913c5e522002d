#!/bin/bash
# The fair recipe of docs/performance.md: each server in its own session (setsid), AIPerf niced in another.
set -u
cd /work/main
OUT=${1:-/work/peer/out}; mkdir -p "$OUT"
P="--tokenizer local/smollm2-135m --hf-home $HOME/.cache/card-peer/hf --concurrency 1,8 --tokens 64 --out $OUT"
PY=/work/main/.venv/bin/python
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
run() { setsid nice -n 19 $PY -m card.client.bench.peer run "$@" $P </dev/null >>"$OUT/peer.log" 2>&1; }
autogroups() { for p in "$@"; do echo "$p $(cat /proc/$p/autogroup 2>/dev/null)"; done >> "$OUT/autogroups.txt"; }

echo part2 $(date) >> "$OUT/when.txt"
run_trio() {  # label, extra JSON, card-client up flags...
  label=$1; extra=$2; shift 2
  setsid /work/main/.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0 "$@" >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up 8013 && { autogroups $U; run --url http://127.0.0.1:8013 --model default --label trio-$label --extra "$extra";
    [ "$label" = card ] && setsid nice -n 19 $PY /work/peer/turns.py http://127.0.0.1:8013 default trio-card $OUT </dev/null >>"$OUT/turns.log" 2>&1; }
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
}
run_trio ngram '{}' --draft-model ngram
run_trio card '{}'
date >> "$OUT/when.txt"
$PY -m card.client.bench.peer report $OUT/vllm-plain.json $OUT/trio-plain.json $OUT/trio-ngram.json $OUT/trio-card.json --chart $OUT/chart.png > "$OUT/report.md" 2>&1
cat "$OUT/report.md"
