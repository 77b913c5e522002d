"""Eight MT-Bench first turns (conversations 8-15, chat template applied) admitted at once to the
default model in process (TargetEngine, 8 slots, prefix caching on), for several token budgets an
iteration: each prompt's first-token time. Usage: eight_prompts_in_process.py THREADS"""

import statistics
import sys
import time

import torch

from card.client.bench import data
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
model = load_model(ModelConfig(dtype="float32", exact=True))
convs = data.load("mt_bench_followup", 16).prompts
prompts = [tuple(model.tokenizer.apply_chat_template([c[0]], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)) for c in convs]


def generation(p: tuple[int, ...], tokens: int) -> Generation:
    request = GenerationRequest(p, SamplingParams(), StopParams(max_new_tokens=tokens, ignore_eos=True))
    return Generation(request, NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=2048,
                      mode="vanilla")


def run(ps: list[tuple[int, ...]], budget: int) -> None:
    pool = KVPool(model.model, slots=8, max_len=2048, prefix_caching=True)
    engine = TargetEngine(model.model, pool, budget, decode_step="eager")
    engine.add(generation(ps[0][:30], 2))  # warm, and the chat template's system prompt cached
    while not engine.idle:
        engine.step()
    gens = [generation(p, 4) for p in ps]
    t0 = time.perf_counter()
    for g in gens:
        engine.add(g)
    first: dict[int, float] = {}
    while len(first) < len(gens):
        engine.step()
        for i, g in enumerate(gens):
            if i not in first and g.stats.new_tokens > 0:
                first[i] = time.perf_counter() - t0
    ts = sorted(first.values())
    p50 = round(1000 * statistics.median(ts))
    print(f"budget {budget}: TTFT ms", [round(1000 * t) for t in ts], "p50", p50, flush=True)


if __name__ == "__main__":  # ../../prefill-order/burst.py imports the model, prompts and generation
    for b in (2048, 512, 256, 128):
        run(prompts[8:16], b)
