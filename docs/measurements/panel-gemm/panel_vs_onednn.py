"""The default model in process on the panel kernel against oneDNN's packed linears (both exact,
fp32), alternating in one process: plain decoding at 1 and 8 in flight (ms per iteration) and the
prefill of a ~300-token prompt (ms), best of ROUNDS; prints whether each kernel's outputs at 8 in
flight equal its own outputs alone (the promise) and whether the two kernels chose the same tokens.

    .venv/bin/python docs/measurements/panel-gemm/panel_vs_onednn.py [ROUNDS] [THREADS]
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
LONG = " ".join(["The history of the printing press begins with movable type in East Asia and continues"
                 " through Gutenberg's workshop in Mainz, where metal type, oil-based ink and a screw"
                 " press came together."] * 8)
STEPS = 40


def _gen(model, prompt: tuple[int, ...], new: int) -> Generation:
    request = GenerationRequest(prompt, SamplingParams(), StopParams(max_new_tokens=new, ignore_eos=True))
    return Generation(request, NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=2048,
                      mode="vanilla")


def decode(model, in_flight: int) -> tuple[float, list[tuple[int, ...]]]:
    """ms per decoding iteration (after 10 that hold the prefills), and every output."""
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step="eager")
    gens = [_gen(model, tuple(model.encode_prompt(PROMPTS[i % 8])), STEPS + 20) for i in range(in_flight)]
    for g in gens:
        engine.add(g)
    for _ in range(10):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    ms = (time.perf_counter() - t0) / STEPS * 1000
    while not engine.idle:
        engine.step()
    return ms, [tuple(g.result.token_ids) for g in gens if g.result]


def prefill(model) -> float:
    """ms from admission to the first token of the long prompt (one slot, its chunks alone)."""
    engine = TargetEngine(model.model, KVPool(model.model, slots=1, max_len=1024), decode_step="eager")
    gen = _gen(model, tuple(model.encode_prompt(LONG)), 1)
    engine.add(gen)
    t0 = time.perf_counter()
    while not engine.idle:
        engine.step()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    models = {k: load_model(ModelConfig(dtype="float32", exact=True, cpu_linear=k))
              for k in ("onednn", "panel")}
    print(f"prompt of {len(models['panel'].encode_prompt(LONG))} tokens; {torch.get_num_threads()} threads")
    best: dict[tuple[str, str], float] = {}
    outs: dict[tuple[str, int], list[tuple[int, ...]]] = {}
    for r in range(rounds):
        for kernel, model in models.items():
            for in_flight in (1, 8):
                ms, out = decode(model, in_flight)
                outs[(kernel, in_flight)] = out
                key = (kernel, f"decode@{in_flight}")
                best[key] = min(ms, best.get(key, 1e9))
                print(f"round {r} {kernel:6s} decode @{in_flight}: {ms:6.1f} ms/iteration", flush=True)
            ms = prefill(model)
            best[(kernel, "prefill")] = min(ms, best.get((kernel, "prefill"), 1e9))
            print(f"round {r} {kernel:6s} prefill: {ms:6.1f} ms", flush=True)
    for what in ("decode@1", "decode@8", "prefill"):
        o, p = best[("onednn", what)], best[("panel", what)]
        print(f"best {what}: onednn {o:.1f} ms, panel {p:.1f} ms: panel speed {o / p:.2f}x")
    for kernel in models:
        alone = outs[(kernel, 1)][0]
        print(f"{kernel}: first prompt at 8 in flight equals it alone: {outs[(kernel, 8)][0] == alone}")
    print(f"the kernels chose the same tokens at 8 in flight: {outs[('onednn', 8)] == outs[('panel', 8)]}")


if __name__ == "__main__":
    main()
