#!/bin/bash
# many_turns.py against one server at a time, each in its own session and the harness niced.
# Usage: many-runs.sh OUT CONVERSATIONS LABEL... where LABEL is one of
#   vllm      vLLM's CPU build (client/bench/peer-vllm-cpu.sh serve), prefix caching on, its
#             cached-token counts reported (--enable-prompt-tokens-details)
#   card      card-client up, default pair (finished sequences cached past the live slots)
#   card-old  the same with CARD_TARGET_PREFIX_CACHE_GB=0 and CARD_DRAFT_PREFIX_CACHE_GB=0: only
#             free live slots keep finished sequences (the behaviour before 2026-11-29's change)
set -u
cd "$(git rev-parse --show-toplevel)"
OUT=$1; N=$2; shift 2; mkdir -p "$OUT"
PY=$PWD/.venv/bin/python
RUN=$PWD/docs/measurements/peer/many-turns-2026-11-29/many_turns.py
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
serve() {  # port, model name, label, command...
  port=$1 model=$2 label=$3; shift 3
  setsid "$@" >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up "$port" && setsid nice -n 19 "$PY" "$RUN" "http://127.0.0.1:$port" "$model" "$label" "$OUT" "$N" \
    </dev/null >>"$OUT/many.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
}
date >> "$OUT/when.txt"
UP=(.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0)
for label in "$@"; do
  case $label in
    vllm) serve 8012 smollm2-135m vllm bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012 \
      --enable-prompt-tokens-details ;;
    card) serve 8013 default card "${UP[@]}" ;;
    card-old) serve 8013 default card-old env CARD_TARGET_PREFIX_CACHE_GB=0 CARD_DRAFT_PREFIX_CACHE_GB=0 "${UP[@]}" ;;
    *) echo "unknown label $label"; exit 2 ;;
  esac
done
date >> "$OUT/when.txt"
