"""Plain decoding of the default model in process, the eager forward against the static step, 1 and 8
in flight, two alternating rounds each (issue 34; output in issue34-cpu.txt beside this file).

    .venv/bin/python docs/measurements/static-step/eager_vs_static.py float32
"""

from __future__ import annotations

import logging
import sys
import time

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

PROMPTS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is 17 times 23?",
           "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]


def tok_s(model, prompts: list[list[int]], mode: str, in_flight: int, new: int = 48) -> float:
    """Decoding tokens/s of ``in_flight`` generations run together, their prefills excluded."""
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step=mode)
    stop = StopParams(max_new_tokens=new, ignore_eos=True)
    gens = [Generation(GenerationRequest(tuple(prompts[i % len(prompts)]), SamplingParams(), stop), NoDraft(),
                       eos_ids=frozenset(), decode=model.decode, context_window=2048, mode="vanilla")
            for i in range(in_flight)]
    for g in gens:
        engine.add(g)
    while any(g.slot is None or g.prefilling for g in gens if g.result is None):
        engine.step()
    t0 = time.perf_counter()
    while not engine.idle:
        engine.step()
    seconds = time.perf_counter() - t0
    return (sum(len(g.result.token_ids) for g in gens if g.result) - in_flight) / seconds


def main(dtype: str) -> None:
    logging.basicConfig(level=logging.INFO)
    model = load_model(ModelConfig(dtype=dtype, exact=True))
    prompts = [model.encode_prompt(p) for p in PROMPTS]
    for n in (1, 8):
        best: dict[str, float] = {}
        for mode in ("eager", "static", "eager", "static"):
            rate = tok_s(model, prompts, mode, n)
            best[mode] = max(best.get(mode, 0.0), rate)
            print(f"{dtype} in flight {n} {mode}: {rate:.1f} tok/s", flush=True)
        print(f"{dtype} in flight {n}: static/eager = {best['static'] / best['eager']:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
