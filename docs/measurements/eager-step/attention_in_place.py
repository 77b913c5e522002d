"""Decoding attention of a lone tile read in place (a view of the KV pool) against the former
gather (a copy of the span every layer), in one process: two engines over the default model (fp32,
exact), ``N`` requests each prefilled to ``P`` tokens, steps alternating in rounds of 4 (16 rounds).
The gather is the same plan with ``alone = -1`` (what RowPlan did before).

    .venv/bin/python docs/measurements/eager-step/attention_in_place.py N P
"""

import dataclasses
import sys
import time

import torch

import card.engine.shared.exact_attention as ea
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

torch.set_num_threads(2)
model = load_model(ModelConfig(dtype="float32", exact=True))
in_place = ea.RowPlan._group


def gathered(S, tiles, device):
    return dataclasses.replace(in_place(S, tiles, device), alone=-1)


nreq, plen = int(sys.argv[1]), int(sys.argv[2])
ids = model.encode_prompt("the quick brown fox jumps over the lazy dog and then " * 200)


def engine():
    e = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=4096), decode_step="eager")
    gens = []
    for i in range(nreq):
        g = Generation(GenerationRequest(tuple(ids[i:i + plen]), SamplingParams(),
                                         StopParams(max_new_tokens=200, ignore_eos=True)),
                       NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=8192,
                       mode="vanilla")
        e.add(g)
        gens.append(g)
    while any(g.prefilling for g in gens):
        e.step()
    for _ in range(3):
        e.step()
    return e


def use(group):
    ea.RowPlan._group = staticmethod(group)


use(in_place)
a = engine()
use(gathered)
b = engine()
ta = tb = 0.0
for _ in range(16):
    use(in_place)
    t = time.perf_counter()
    for _ in range(4):
        a.step()
    ta += time.perf_counter() - t
    use(gathered)
    t = time.perf_counter()
    for _ in range(4):
        b.step()
    tb += time.perf_counter() - t
print(f"{nreq} in flight at ~{plen} tokens: in place {ta / 64 * 1e3:.1f} ms/step, "
      f"gathered {tb / 64 * 1e3:.1f} ms/step, ratio {tb / ta:.3f}")
