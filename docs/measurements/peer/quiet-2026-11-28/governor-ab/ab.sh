#!/bin/bash
cd /work/main
OUT=/work/peer/ab1; mkdir -p $OUT
PY=$PWD/.venv/bin/python
Q=$PWD/docs/measurements/peer/quiet-2026-11-28/quiet.py
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
serve() { port=$1 model=$2 label=$3 extra=$4; shift 4
  setsid "$@" >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up "$port" && setsid nice -n 19 "$PY" "$Q" "http://127.0.0.1:$port" "$model" "$label" "$OUT" "$extra" </dev/null >>"$OUT/quiet.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2; }
UP=(.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0)
date >> $OUT/when.txt
serve 8012 smollm2-135m vllm-a '{}' bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012
for r in 1 2; do
serve 8013 default plain-dw1-$r '{"mode": "vanilla"}' env CARD_GOV_DW=1 "${UP[@]}"
serve 8013 default plain-dw2-$r '{"mode": "vanilla"}' env CARD_GOV_DW=2 "${UP[@]}"
done
serve 8013 default ngram-dw1 '{}' env CARD_GOV_DW=1 "${UP[@]}" --draft-model ngram
serve 8013 default ngram-dw2 '{}' env CARD_GOV_DW=2 "${UP[@]}" --draft-model ngram
serve 8012 smollm2-135m vllm-b '{}' bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012
date >> $OUT/when.txt
