"""Seeded plain decoding of the default model in process (issue 34; output in
device-sampling-cpu.txt beside this file), 1 and 8 in flight:

- steps: one engine on the static step, its steps alternating between drawing on the host (the
  previous static step) and drawing and accepting on the device; the median step of each. The
  two paths share every step's conditions, so this ratio holds on a machine others are loading;
  the outputs must equal an all-host run's (the exactness promise: the path can change mid-way);
- rounds: whole runs, the eager forward (host draws), the static step drawing on the host and on
  the device, three alternating rounds, best of three.

    .venv/bin/python docs/measurements/static-step/device_sampling.py float32 [threads]

``threads``: torch's intra-op threads (default: torch's own). On a machine shared with other jobs,
1 keeps two threads from spinning at a barrier while the other is descheduled.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine
from card.engine.target.verify import TargetState

PROMPTS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is 17 times 23?",
           "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]
DEVICE_SAMPLING = TargetState.device_sampling


def host_only(self: TargetState, chain: int, proposal: object) -> None:
    """TargetState.device_sampling of the previous static step: nothing drawn on the device."""
    return None


def run(model, prompts: list[list[int]], mode: str, in_flight: int, new: int = 48) -> tuple[float, list]:
    """Decoding tokens/s of ``in_flight`` seeded generations run together, their prefills
    excluded, and their outputs. ``mode``: eager, static-host or static-device."""
    TargetState.device_sampling = DEVICE_SAMPLING if mode == "static-device" else host_only
    step = "eager" if mode == "eager" else "static"
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step=step)
    stop = StopParams(max_new_tokens=new, ignore_eos=True)
    gens = [Generation(GenerationRequest(tuple(prompts[i % len(prompts)]),
                                         SamplingParams(0.8, top_k=50, top_p=0.95, seed=i), stop),
                       NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=2048,
                       mode="vanilla")
            for i in range(in_flight)]
    for g in gens:
        engine.add(g)
    while any(g.slot is None or g.prefilling for g in gens if g.result is None):
        engine.step()
    t0 = time.perf_counter()
    while not engine.idle:
        engine.step()
    seconds = time.perf_counter() - t0
    rate = (sum(len(g.result.token_ids) for g in gens if g.result) - in_flight) / seconds
    return rate, [g.result.token_ids for g in gens if g.result]


def steps(model, prompts: list[list[int]], in_flight: int, new: int = 80) -> tuple[dict[str, float], bool]:
    """Median step seconds of each path, steps alternating; whether the outputs equal all-host."""
    def engine_and_gens() -> tuple[TargetEngine, list[Generation]]:
        engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step="static")
        stop = StopParams(max_new_tokens=new, ignore_eos=True)
        gens = [Generation(GenerationRequest(tuple(prompts[i % len(prompts)]),
                                             SamplingParams(0.8, top_k=50, top_p=0.95, seed=i), stop),
                           NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=2048,
                           mode="vanilla") for i in range(in_flight)]
        for g in gens:
            engine.add(g)
        while any(g.slot is None or g.prefilling for g in gens if g.result is None):
            engine.step()
        return engine, gens

    TargetState.device_sampling = host_only
    engine, gens = engine_and_gens()
    while not engine.idle:
        engine.step()
    want = [g.result.token_ids for g in gens if g.result]
    engine, gens = engine_and_gens()
    times: dict[str, list[float]] = {"host": [], "device": []}
    while not engine.idle:
        path = "device" if len(times["host"]) > len(times["device"]) else "host"
        TargetState.device_sampling = DEVICE_SAMPLING if path == "device" else host_only
        t0 = time.perf_counter()
        engine.step()
        times[path].append(time.perf_counter() - t0)
    same = [g.result.token_ids for g in gens if g.result] == want
    return {path: statistics.median(ts) for path, ts in times.items()}, same


def main(dtype: str, threads: int | None) -> None:
    logging.basicConfig(level=logging.INFO)
    if threads:
        torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads", flush=True)
    model = load_model(ModelConfig(dtype=dtype, exact=True))
    prompts = [model.encode_prompt(p) for p in PROMPTS]
    for n in (1, 8):
        median, same = steps(model, prompts, n)
        print(f"{dtype} in flight {n} steps: host draws {median['host'] * 1e3:.1f} ms, device draws "
              f"{median['device'] * 1e3:.1f} ms (median step), device/host step time = "
              f"{median['device'] / median['host']:.2f}; outputs == all-host run: {same}", flush=True)
    modes = ("eager", "static-host", "static-device")
    for n in (1, 8):
        best: dict[str, float] = {}
        outputs: dict[str, list] = {}
        for mode in modes * 3:
            rate, out = run(model, prompts, mode, n)
            best[mode] = max(best.get(mode, 0.0), rate)
            outputs.setdefault(mode, out)
            print(f"{dtype} in flight {n} {mode}: {rate:.1f} tok/s", flush=True)
        same = outputs["static-device"] == outputs["static-host"]
        print(f"{dtype} in flight {n}: static-device/eager = {best['static-device'] / best['eager']:.2f}, "
              f"static-device/static-host = {best['static-device'] / best['static-host']:.2f}, "
              f"static-host/eager = {best['static-host'] / best['eager']:.2f}; "
              f"device outputs == host-drawn static outputs: {same}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32", int(sys.argv[2]) if len(sys.argv) > 2 else None)
