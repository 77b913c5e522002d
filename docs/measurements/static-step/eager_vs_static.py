"""vanilla decoding of the default model, eager vs static step, 1 and 8 in flight (CPU)."""
import sys, time, torch, logging
logging.basicConfig(level=logging.INFO)
from card.engine.loading.models import load_model, ModelConfig
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine
dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
m = load_model(ModelConfig(dtype=dtype, exact=True))
prompts = [m.encode_prompt(p) for p in ["Write a story about a cat.", "Explain gravity.", "List ten fruits.",
           "What is 17 times 23?", "Describe Paris.", "Tell a joke.", "How do planes fly?", "Name the planets."]]
def run(mode, n, new=48):
    engine = TargetEngine(m.model, KVPool(m.model, slots=8, max_len=1024), decode_step=mode)
    gens = [Generation(GenerationRequest(tuple(prompts[i % 8]), SamplingParams(), StopParams(max_new_tokens=new, ignore_eos=True)),
                       NoDraft(), eos_ids=frozenset(), decode=m.decode, context_window=2048, mode="vanilla") for i in range(n)]
    for g in gens: engine.add(g)
    while any(g.slot is None and g.result is None for g in gens) or any(g.prefilling for g in gens): engine.step()
    t = time.perf_counter(); steps = 0; tok0 = sum(len(g.target.committed) for g in gens)
    while not engine.idle:
        engine.step(); steps += 1
    dt = time.perf_counter() - t
    toks = sum(len(g.result.token_ids) for g in gens) - n  # minus the token of the prefill
    return toks / dt, [g.result.token_ids for g in gens]
for n in (1, 8):
    out = {}
    for mode in ("eager", "static", "eager", "static"):
        rate, ids = run(mode, n)
        out.setdefault(mode, []).append(rate)
        print(f"{dtype} in flight {n} {mode}: {rate:.1f} tok/s", flush=True)
    print(f"{dtype} in flight {n}: static/eager = {max(out['static'])/max(out['eager']):.2f}", flush=True)
