"""bf16 on AMX, in process: packed linears in 8-row tiles (before) vs chunks of <= 32 rows (after),
plain decoding at 1 and 8 in flight and a ~300-token prefill, alternating, one process."""
import logging
import time

import torch

import card.engine.loading.invariant as inv
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

PROMPTS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is 17 times 23?",
           "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 18)
def run(model, prompts, in_flight, new=48):
    engine = TargetEngine(model.model, KVPool(model.model, slots=8, max_len=1024))
    stop = StopParams(max_new_tokens=new, ignore_eos=True)
    gens = [Generation(GenerationRequest(tuple(prompts[i % len(prompts)]), SamplingParams(), stop), NoDraft(),
                       eos_ids=frozenset(), decode=model.decode, context_window=2048, mode="vanilla")
            for i in range(in_flight)]
    t0 = time.perf_counter()
    for g in gens:
        engine.add(g)
    while any(g.slot is None or g.prefilling for g in gens if g.result is None):
        engine.step()
    t1 = time.perf_counter()
    while not engine.idle:
        engine.step()
    toks = [g.result.token_ids for g in gens]
    return t1 - t0, (sum(len(t) for t in toks) - in_flight) / (time.perf_counter() - t1), toks
logging.basicConfig(level=logging.INFO)
torch.set_num_threads(2)
new = load_model(ModelConfig(dtype="bfloat16", exact=True))
real = inv.invariant_rows
inv.invariant_rows = lambda layer, most=64: 0  # before: the 8-row tiles
old = load_model(ModelConfig(dtype="bfloat16", exact=True))
inv.invariant_rows = real
models = {"tiles8": old, "chunks32": new}
for rnd in range(2):
    for name, m in models.items():
        long = [m.encode_prompt(LONG)]
        pf, _, _ = run(m, long, 1, new=2)
        print(f"{name} round {rnd}: prefill of {len(long[0])} tokens {pf*1000:.0f} ms", flush=True)
outs = {}
for n in (1, 8):
    for rnd in range(2):
        for name, m in models.items():
            prompts = [m.encode_prompt(p) for p in PROMPTS]
            pf, r, toks = run(m, prompts, n)
            outs.setdefault((n, name), toks)
            print(f"{name} in flight {n} round {rnd}: decode {r:.1f} tok/s (prefill {pf * 1000:.0f} ms)",
                  flush=True)
    same = outs[(n, "tiles8")] == outs[(n, "chunks32")]
    print(f"in flight {n}: outputs equal tiles8 vs chunks32: {same}", flush=True)
