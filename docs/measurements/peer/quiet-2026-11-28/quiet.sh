#!/bin/bash
# quiet.py against each server in turn, each in its own session, the client niced in another.
# Usage: quiet.sh OUT [LABEL...]: vllm (vLLM's CPU build, client/bench/peer-vllm-cpu.sh serve), vllm-ngram
# (the same with its n-gram speculation, 4 tokens, lookup 2-4),
# plain (card-client up, requests in mode vanilla), plain-onednn (the same with the target's linears
# on oneDNN, --cpu-linear onednn), plain-torch-attention (the target's exact attention through torch,
# --cpu-attention torch), ngram (--draft-model ngram), card (default pair), card-overlap (the same with
# --no-draft-after-prefill: the draft prefills beside the target)
set -u
cd "$(git rev-parse --show-toplevel)"
OUT=$1; shift; mkdir -p "$OUT"
PY=$PWD/.venv/bin/python
Q=$PWD/docs/measurements/peer/quiet-2026-11-28/quiet.py
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
serve() {  # port, model, label, extra JSON, command...
  port=$1 model=$2 label=$3 extra=$4; shift 4
  setsid "$@" >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up "$port" && setsid nice -n 19 "$PY" "$Q" "http://127.0.0.1:$port" "$model" "$label" "$OUT" "$extra" \
    </dev/null >>"$OUT/quiet.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
}
UP=(.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0)
date >> "$OUT/when.txt"
labels=("$@"); [ ${#labels[@]} -eq 0 ] && labels=(vllm plain ngram card)
for label in "${labels[@]}"; do
  case $label in
    vllm) serve 8012 smollm2-135m vllm '{}' bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012 ;;
    vllm-ngram) serve 8012 smollm2-135m vllm-ngram '{}' bash client/bench/peer-vllm-cpu.sh serve \
      /work/peer/smollm2-135m 8012 --speculative-config \
      '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}' ;;
    plain) serve 8013 default trio-plain '{"mode": "vanilla"}' "${UP[@]}" ;;
    plain-onednn) CARD_TARGET_CPU_LINEAR=onednn serve 8013 default trio-plain-onednn '{"mode": "vanilla"}' \
      "${UP[@]}" ;;
    plain-torch-attention) CARD_TARGET_CPU_ATTENTION=torch serve 8013 default trio-plain-torch-attention \
      '{"mode": "vanilla"}' "${UP[@]}" ;;
    ngram) serve 8013 default trio-ngram '{}' "${UP[@]}" --draft-model ngram ;;
    card) serve 8013 default trio-card '{}' "${UP[@]}" ;;
    card-overlap) CARD_TARGET_DRAFT_AFTER_PREFILL=false serve 8013 default trio-card-overlap '{}' "${UP[@]}" ;;
    *) echo "unknown label $label"; exit 2 ;;
  esac
done
date >> "$OUT/when.txt"
