#!/bin/bash
# Two-turn TTFT (../fair-2026-11-27/turns.py), one server at a time, each in its own session and the
# harness niced. Usage: turns-runs.sh OUT LABEL... where LABEL is one of
#   vllm          vLLM's CPU build (client/bench/peer-vllm-cpu.sh serve), prefix caching on
#   card          card-client up, default pair
#   card-nocache  the same, CARD_TARGET_ENABLE_PREFIX_CACHING=false
#   card-nopacer  the same, CARD_TARGET_MAX_DECODE_SLOWDOWN=0
#   card-t2       the same, --target-threads 2 (adaptive threads since 2026-11-28: at most 2)
#   card-t1       the same, --target-threads 1 (card-client up's split before adaptive threads)
#   card-t2-fixed the same, --target-threads 2 and CARD_TARGET_ADAPTIVE_THREADS=false
#   card-arrival  the same, CARD_TARGET_PREFILL_ORDER=arrival (prompts prefilled first come first served)
#   card-never    the same, CARD_TARGET_SPECULATION=never (every draft stopped: the target alone)
# The runs of 2026-11-27: OUT vllm card card-nocache (20:43), then card card-nopacer (turns
# labelled card-pacer / card-nopacer: pacer-turns.log), then card card-t2 (threads-turns.log).
# The runs of 2026-11-27/28 (../turns-2026-11-27c/): OUT vllm card card-t1 card-t2-fixed, then
# three rounds of OUT/rN card card-t1 vllm (card = the new default: adaptive threads, every core).
# The runs of 2026-11-30 (../turns-2026-11-30/): OUT vllm card card-arrival, twice.
set -u
cd "$(git rev-parse --show-toplevel)"
OUT=$1; shift; mkdir -p "$OUT"
PY=$PWD/.venv/bin/python
TURNS=$PWD/docs/measurements/peer/fair-2026-11-27/turns.py
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "not up: $1"; return 1; }
serve() {  # port, model name, label, command...
  port=$1 model=$2 label=$3; shift 3
  setsid "$@" >"$OUT/up-$label.log" 2>&1 </dev/null &
  U=$!; wait_up "$port" && setsid nice -n 19 "$PY" "$TURNS" "http://127.0.0.1:$port" "$model" "$label" "$OUT" \
    </dev/null >>"$OUT/turns.log" 2>&1
  kill -INT -- -$U; sleep 8; kill -KILL -- -$U 2>/dev/null; sleep 2
}
date >> "$OUT/when.txt"
UP=(.venv/bin/card-client up --http-port 8013 --target-port 0 --cache-port 0 --draft-port 0)
for label in "$@"; do
  case $label in
    vllm) serve 8012 smollm2-135m vllm bash client/bench/peer-vllm-cpu.sh serve /work/peer/smollm2-135m 8012 ;;
    card) serve 8013 default trio-card "${UP[@]}" ;;
    card-nocache) serve 8013 default trio-card-nocache env CARD_TARGET_ENABLE_PREFIX_CACHING=false "${UP[@]}" ;;
    card-nopacer) serve 8013 default trio-card-nopacer env CARD_TARGET_MAX_DECODE_SLOWDOWN=0 "${UP[@]}" ;;
    card-arrival) serve 8013 default trio-card-arrival env CARD_TARGET_PREFILL_ORDER=arrival "${UP[@]}" ;;
    card-never) serve 8013 default trio-card-never env CARD_TARGET_SPECULATION=never "${UP[@]}" ;;
    card-t2) serve 8013 default trio-card-t2 "${UP[@]}" --target-threads 2 ;;
    card-t1) serve 8013 default trio-card-t1 "${UP[@]}" --target-threads 1 ;;
    card-t2-fixed) serve 8013 default trio-card-t2-fixed env CARD_TARGET_ADAPTIVE_THREADS=false \
      "${UP[@]}" --target-threads 2 ;;
    *) echo "unknown label $label"; exit 2 ;;
  esac
done
date >> "$OUT/when.txt"
