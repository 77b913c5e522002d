"""Plain decoding of the default model in process, exact attention through the C kernel
(card.engine.shared.row_attention) against the torch paths (RowPlan, attend_blocks), alternating
in one process, three rounds each; prints each round's ms per decoding iteration, a prompt's
prefill time, the ratios of the best, and whether every output is the same token for token (the
two paths' bits differ; greedy tokens rarely do). Output of the runs in results.txt beside this file.

    .venv/bin/python docs/measurements/attention-kernel/kernel_vs_torch.py IN_FLIGHT STEPS [THREADS] \
        [PROMPT_TOKENS] [DTYPE]
"""

from __future__ import annotations

import sys
import time

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

PROMPTS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is 17 times 23?",
           "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]


def _engine(model, kernel: bool, max_len: int) -> TargetEngine:
    pool = KVPool(model.model, slots=8, max_len=max_len)
    pool.row_kernel = kernel  # the pool's choice, overridden for the A/B
    return TargetEngine(model.model, pool, decode_step="eager")


def decode(model, in_flight: int, steps: int, kernel: bool) -> tuple[float, list[tuple[int, ...]]]:
    """ms per iteration over ``steps`` decoding iterations (after 10 that hold the prefills), and
    every output."""
    engine = _engine(model, kernel, 2048)
    stop = StopParams(max_new_tokens=steps + 20, ignore_eos=True)
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


def prefill(model, tokens: int, kernel: bool) -> float:
    """Seconds to the first token of one prompt of ``tokens`` tokens."""
    engine = _engine(model, kernel, tokens + 64)
    text = " ".join(PROMPTS * (tokens // 40 + 1))
    prompt = tuple(model.tokenizer(text)["input_ids"][:tokens])
    stop = StopParams(max_new_tokens=1, ignore_eos=True)
    gen = Generation(GenerationRequest(prompt, SamplingParams(), stop), NoDraft(), eos_ids=frozenset(),
                     decode=model.decode, context_window=tokens + 64, mode="vanilla")
    engine.add(gen)
    t0 = time.perf_counter()
    while not engine.idle:
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    in_flight, steps = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    prompt_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 1500
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    model = load_model(ModelConfig(dtype=dtype, exact=True))
    times: dict[bool, list[float]] = {False: [], True: []}
    first: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[tuple[int, ...]]] = {}
    for _ in range(3):
        for kernel in (False, True):
            ms, out = decode(model, in_flight, steps, kernel)
            times[kernel].append(round(ms, 2))
            assert outputs.setdefault(kernel, out) == out
            first[kernel].append(round(prefill(model, prompt_tokens, kernel), 3))
    print(f"{dtype}, in flight {in_flight}, {steps} steps, {torch.get_num_threads()} threads: "
          f"torch {sorted(times[False])} kernel {sorted(times[True])} ms/iteration, kernel / torch speed "
          f"{min(times[False]) / min(times[True]):.3f}; prefill of {prompt_tokens} tokens: torch "
          f"{sorted(first[False])} kernel {sorted(first[True])} s, "
          f"speed {min(first[False]) / min(first[True]):.3f}; "
          f"same outputs {outputs[True] == outputs[False]}", flush=True)


if __name__ == "__main__":
    main()
