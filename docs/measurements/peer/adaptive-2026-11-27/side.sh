#!/bin/bash
# AIPerf side by side, the fair recipe of docs/performance.md (each server in its own session,
# AIPerf niced in another), for card-target's adaptive threads: every trio side twice, with
# card-client up's new default (the target on every core, --adaptive-threads) and with the split
# before it (--target-threads 1: one core each for target and draft). Usage: side.sh OUT
set -u
cd "$(git rev-parse --show-toplevel)"
OUT=${1:-/work/peer/out}; mkdir -p "$OUT"
P="--tokenizer local/smollm2-135m --hf-home $HOME/.cache/card-peer/hf --concurrency 1,8 --tokens 64 --out $OUT"
PY=$PWD/.venv/bin/python
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
run() { setsid nice -n 19 "$PY" -m card.client.bench.peer run "$@" $P </dev/null >>"$OUT/peer.log" 2>&1; }
date > "$OUT/when.txt"
setsid bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012 >"$OUT/vllm.log" 2>&1 </dev/null &
V=$!; wait_up 8012 && run --url http://127.0.0.1:8012 --model smollm2-135m --label vllm-plain
kill -TERM -- -$V; sleep 5; kill -KILL -- -$V 2>/dev/null
run_trio() {  # label, extra JSON, card-client up flags...
  label=$1; extra=$2; shift 2
  setsid .venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0 "$@" >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up 8013 && { T=$(pgrep -f "card-target .*--port" | head -1)
    run --url http://127.0.0.1:8013 --model default --label trio-$label --extra "$extra"
    # CPU seconds of each of card-target's engine threads (the engine's thread and its OpenMP workers)
    for t in /proc/$T/task/*; do [ "$(cat $t/comm)" = target-engine ] && echo "$(basename $t) $(awk '{print ($14+$15)/100}' $t/stat)"; done > "$OUT/engine-cpu-$label.txt"; }
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
}
run_trio plain '{"mode": "vanilla"}'
run_trio plain-t1 '{"mode": "vanilla"}' --target-threads 1
run_trio ngram '{}' --draft-model ngram
run_trio ngram-t1 '{}' --draft-model ngram --target-threads 1
run_trio card '{}'
run_trio card-t1 '{}' --target-threads 1
date >> "$OUT/when.txt"
"$PY" -m card.client.bench.peer report "$OUT"/vllm-plain.json "$OUT"/trio-*.json > "$OUT/report.md" 2>&1
cat "$OUT/report.md"
