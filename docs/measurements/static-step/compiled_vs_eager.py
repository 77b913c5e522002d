"""Plain decoding of the default model in process, fp32, one request: the eager forward, the static
step run eagerly and the static step compiled by inductor (packed linears through the
``card::packed_linear`` op), alternating, in one process; steps 40-90 of each run (every span the
run reaches already compiled). The probe is skipped: at start-up it compiles every (bucket, span)
it visits, which is what makes ``compiled`` slow to start (docs/performance.md).

    .venv/bin/python docs/measurements/static-step/compiled_vs_eager.py
"""

import logging
import time

import torch
import torch._dynamo

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.static_step import StaticStep
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

StaticStep.probe = lambda self, *a, **k: None  # type: ignore[method-assign]
logging.basicConfig(level=logging.INFO)
torch.set_num_threads(2)
model = load_model(ModelConfig(dtype="float32", exact=True))


def ms_per_step(mode: str) -> float:
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step=mode)
    prompt = tuple(model.encode_prompt("Write a story about a cat."))
    stop = StopParams(max_new_tokens=300, ignore_eos=True)
    gen = Generation(GenerationRequest(prompt, SamplingParams(), stop), NoDraft(), eos_ids=frozenset(),
                     decode=model.decode, context_window=2048, mode="vanilla")
    engine.add(gen)
    for _ in range(40):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(50):
        engine.step()
    return (time.perf_counter() - t0) / 50 * 1000


t0 = time.perf_counter()
ms_per_step("compiled")
print(f"compiled: first run with its compiles {time.perf_counter() - t0:.1f} s", flush=True)
for _ in range(2):
    for mode in ("eager", "static", "compiled"):
        print(f"{mode} {ms_per_step(mode):.1f} ms/step", flush=True)
print("dynamo", dict(torch._dynamo.utils.counters["stats"]))
