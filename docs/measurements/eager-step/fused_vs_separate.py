"""The eager decoding step with sibling linears fused (card.engine.loading.fused_linear) and apart:
two copies of the default model (fp32, exact) in one process, ``N`` requests each, steps
alternating in rounds of 10 after 5 warm-up steps; then both run to the end and their texts are
compared.

    .venv/bin/python docs/measurements/eager-step/fused_vs_separate.py N
"""

import sys
import time

import torch

import card.engine.loading.invariant as invariant
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

torch.set_num_threads(2)
nreq = int(sys.argv[1]) if len(sys.argv) > 1 else 1
fused = load_model(ModelConfig(dtype="float32", exact=True))
keep = invariant.fuse_siblings
invariant.fuse_siblings = lambda model, pack: 0
apart = load_model(ModelConfig(dtype="float32", exact=True))
invariant.fuse_siblings = keep


def engine(model):
    e = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024), decode_step="eager")
    gens = []
    for i in range(nreq):
        prompt = tuple(model.encode_prompt(f"Write a story about a cat number {i}."))
        stop = StopParams(max_new_tokens=120, ignore_eos=True)
        g = Generation(GenerationRequest(prompt, SamplingParams(), stop),
                       NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=2048,
                       mode="vanilla")
        e.add(g)
        gens.append(g)
    for _ in range(5):
        e.step()
    return e, gens


ea, ga = engine(fused)
eb, gb = engine(apart)
ta = tb = 0.0
for _ in range(10):
    t = time.perf_counter()
    for _ in range(10):
        ea.step()
    ta += time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(10):
        eb.step()
    tb += time.perf_counter() - t
print(f"{nreq} in flight: fused {ta / 100 * 1e3:.1f} ms/step, apart {tb / 100 * 1e3:.1f} ms/step, "
      f"ratio {tb / ta:.3f}")
while not all(g.done for g in ga):
    ea.step()
while not all(g.done for g in gb):
    eb.step()
print("texts equal:", [g.tracker.text for g in ga] == [g.tracker.text for g in gb])
