"""Adaptive threads in process (card.engine.shared.thread_governor): plain decoding of the default
model, 1 and 8 in flight, on 1 thread, on 2, and on 2 governed (the count card-target's engine
thread would run), on idle cores, beside a spinner (a niced busy loop in a session of its own, as
AIPerf's timing loop is) and beside one that spins 2 s and sleeps 2 s. Output in governor-cpu.txt.

    .venv/bin/python docs/measurements/threads/governor.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.thread_governor import ProcCores, ThreadGovernor, decoder_layers
from card.engine.shared.torch_threads import name_os_thread
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

PROMPTS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is 17 times 23?",
           "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]
SPIN = "while True: pass"
BLINK = ("import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 2: pass\n"
         "    time.sleep(2)")


def tok_s(model, prompts: list[list[int]], in_flight: int, mode: str,
          new: int) -> tuple[float, str]:
    """Tokens/s of ``in_flight`` generations decoded together (prefill included), on ``mode``
    threads ("1", "2", or "gov": 2 at most, governed)."""
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024))
    stop = StopParams(max_new_tokens=new, ignore_eos=True)
    gens = [Generation(GenerationRequest(tuple(prompts[i % len(prompts)]), SamplingParams(), stop), NoDraft(),
                       eos_ids=frozenset(), decode=model.decode, context_window=2048, mode="vanilla")
            for i in range(in_flight)]
    for g in gens:
        engine.add(g)
    governor, detach = None, None
    if mode == "gov":
        cores = ProcCores.open()
        assert cores is not None
        governor = ThreadGovernor(2, cores)
        detach = governor.attach(decoder_layers(model.model))
    else:
        torch.set_num_threads(int(mode))
    start = time.perf_counter()
    while not engine.idle:
        if governor:
            governor.before_iteration()
        engine.step()
        if governor:
            governor.after_iteration()
    seconds = time.perf_counter() - start
    note = ""
    if governor and detach:
        detach()
        note = f" (drops {governor.drops}, climbs {governor.climbs})"
    return sum(len(g.result.token_ids) for g in gens if g.result) / seconds, note


def main() -> None:
    name_os_thread("bench-engine")  # the governor's team: this thread and its OpenMP workers
    model = load_model(ModelConfig(dtype="float32", exact=True))
    prompts = [model.encode_prompt(p) for p in PROMPTS]
    for beside, code in (("idle cores", None), ("a spinner", SPIN), ("a 2 s on / 2 s off spinner", BLINK)):
        neighbour = None
        if code:
            neighbour = subprocess.Popen(["setsid", "nice", "-n", "19", sys.executable, "-c", code])
        time.sleep(0.5)
        try:
            for n in (1, 8):
                for mode in ("1", "2", "gov", "1", "2", "gov"):
                    # 0.4-0.6 tok/s at 1 in flight: governor-cpu-with-probes.txt
                    if mode == "2" and code == SPIN:
                        print(f"beside {beside}, {n} in flight, threads 2: skipped (collapses)", flush=True)
                        continue
                    rate, note = tok_s(model, prompts, n, mode, new=48 if n == 1 else 96)
                    line = f"beside {beside}, {n} in flight, threads {mode}: {rate:.1f} tok/s{note}"
                    print(line, flush=True)
        finally:
            if neighbour:
                subprocess.run(["pkill", "-s", str(neighbour.pid)], check=False)
                neighbour.wait()


if __name__ == "__main__":
    print(Path(__file__).name, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), flush=True)
    main()
