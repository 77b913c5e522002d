"""A fresh prompt's prefill (the default model in process, exact fp32, 64 / 256 / 512 tokens, 1
token out) on one and two torch threads, quiet and beside a nice-0 busy loop in another process."""
import subprocess
import sys
import time

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

model = load_model(ModelConfig(dtype="float32", exact=True))


def ttft(threads: int, n: int, seed: int) -> int:
    torch.set_num_threads(threads)
    engine = TargetEngine(model.model, KVPool(model.model, slots=2, max_len=2048), 512, decode_step="eager")
    prompt = tuple(torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
    request = GenerationRequest(prompt, SamplingParams(), StopParams(max_new_tokens=1, ignore_eos=True))
    gen = Generation(request, NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=2048,
                     mode="vanilla")
    engine.add(gen)
    t0 = time.perf_counter()
    while gen.stats.new_tokens == 0:
        engine.step()
    return round(1000 * (time.perf_counter() - t0))


ttft(2, 64, 0)
for spin in (False, True):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if spin else None
    time.sleep(0.5)
    for n in (64, 256, 512):
        print("spinner" if spin else "quiet", n, "1 thread", [ttft(1, n, s) for s in range(3)],
              "2 threads", [ttft(2, n, s) for s in range(3)], flush=True)
    if spinner is not None:
        spinner.kill()
