"""The same scenario inside the engine (no HTTP): SmolLM2-135M, one torch thread, four greedy
streams decoding alone for 40 iterations, then a 7,500-token prompt joins (pacing at 1.5); every
iteration timed, the chunk iterations (more than 4 rows) listed. Output in iterations-cpu.txt.

    .venv/bin/python docs/measurements/long-context/iterations.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

SHORTS = ["The history of", "A recipe", "def f(n):", "Photosynthesis is"]


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model(ModelConfig("default"))
    model, tok = loaded.model, loaded.tokenizer
    engine = TargetEngine(model, KVPool(model, slots=8, max_len=8192, prefix_caching=True), 512,
                          exact=loaded.exact, max_decode_slowdown=1.5)

    def gen(ids: list[int], n: int) -> Generation:
        stop = StopParams(max_new_tokens=n, ignore_eos=True)
        request = GenerationRequest(tuple(ids), SamplingParams(), stop)
        return Generation(request, NoDraft(), eos_ids=frozenset(), decode=lambda _: "", context_window=8192,
                          mode="vanilla", vocab_size=model.config.vocab_size)

    docs = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in sorted(docs.glob("*.md")))
    shorts = [gen(tok.encode(s, add_special_tokens=False), 120) for s in SHORTS]
    for g in shorts:
        engine.add(g)
    rec: list[tuple[str, float, int]] = []

    def step(phase: str) -> None:
        t = time.perf_counter()
        engine.step()
        rec.append((phase, time.perf_counter() - t, engine.last.rows if engine.last else 0))

    for _ in range(40):
        step("alone")
    engine.add(gen(tok.encode(text, add_special_tokens=False)[:7500], 2))
    while any(not g.done for g in shorts) and len(rec) < 200:
        step("beside")
    alone = [d for _, d, _ in rec[5:40]]
    beside = [d for p, d, _ in rec if p == "beside"]
    decode = [d for p, d, r in rec if p == "beside" and r <= 4]
    print(f"alone: decoding iterations p50 {statistics.median(alone) * 1e3:.1f} ms "
          f"p90 {sorted(alone)[int(.9 * len(alone))] * 1e3:.1f} ms, "
          f"mean {statistics.mean(alone) * 1e3:.1f} ms")
    print(f"beside: iterations without a chunk p50 {statistics.median(decode) * 1e3:.1f} ms "
          f"p90 {sorted(decode)[int(.9 * len(decode))] * 1e3:.1f} ms ({len(decode)})")
    chunks = [(round(d, 3), r) for p, d, r in rec if p == "beside" and r > 4]
    print(f"beside: chunk iterations (s, rows) {chunks}")
    print(f"beside: all iterations mean {statistics.mean(beside) * 1e3:.1f} ms "
          f"({statistics.mean(beside) / statistics.mean(alone):.2f}x alone's)")
    print(f"beside: every iteration (ms) {[round(d * 1e3) for d in beside]}")


if __name__ == "__main__":
    main()
