"""Plain decoding of the default model in process, the decoder layers through transformers against
the lean layer (card.engine.shared.lean_layers), alternating in one process, three rounds each;
prints each round's ms per iteration, the ratio of the best, and whether every output is the same.
Output of the runs in results.txt beside this file.

    .venv/bin/python docs/measurements/lean-layer/lean_vs_transformers.py IN_FLIGHT STEPS [THREADS] [DTYPE]
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared import lean_layers
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

PROMPTS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is 17 times 23?",
           "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]


def run(model, in_flight: int, steps: int, lean: bool) -> tuple[float, list[tuple[int, ...]]]:
    """ms per iteration over ``steps`` decoding iterations (after 10 that hold the prefills), and
    every output."""
    if lean:
        lean_layers._PLANS.pop(model.model, None)  # decided afresh: checked, then the lean layers
    else:
        lean_layers._PLANS[model.model] = None  # transformers' layers
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step="eager")
    stop = StopParams(max_new_tokens=steps + 30, ignore_eos=True)
    prompts = [tuple(model.encode_prompt(PROMPTS[i % 8])) for i in range(in_flight)]
    gens = [Generation(GenerationRequest(p, SamplingParams(), stop), NoDraft(), eos_ids=frozenset(),
                       decode=model.decode, context_window=2048, mode="vanilla") for p in prompts]
    for g in gens:
        engine.add(g)
    for _ in range(10):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) / steps * 1000
    while not engine.idle:
        engine.step()
    return ms, [tuple(g.result.token_ids) for g in gens if g.result]


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    in_flight, steps = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    model = load_model(ModelConfig(dtype=sys.argv[4] if len(sys.argv) > 4 else "float32", exact=True))
    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[tuple[int, ...]]] = {}
    for _ in range(3):
        for lean in (False, True):
            ms, out = run(model, in_flight, steps, lean)
            times[lean].append(ms)
            assert outputs.setdefault(lean, out) == out
    print(f"in flight {in_flight}, {torch.get_num_threads()} threads: transformers {sorted(times[False])} "
          f"lean {sorted(times[True])} ms/iteration; lean / transformers speed "
          f"{min(times[False]) / min(times[True]):.3f}; same outputs {outputs[True] == outputs[False]}",
          flush=True)


if __name__ == "__main__":
    main()
