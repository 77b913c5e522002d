"""Eight MT-Bench first turns (conversations 8-15, chat template applied) admitted at once to the
default model in process (TargetEngine, 8 slots, prefix caching on, a budget of 512 tokens an
iteration, card-target's default), prefilled in arrival order and shortest first, alternating:
each prompt's first-token time, when the last of 16 new tokens each came, and that the tokens are
the same both ways. Usage: burst.py THREADS ROUNDS"""

import statistics
import sys
import time
from pathlib import Path

from card.engine.shared.kv_pool import KVPool
from card.engine.target.scheduler import TargetEngine

# the model (its torch threads from argv[1]), the chat prompts and a plain generation of each:
# the same setup as the budget sweep of 2026-11-29
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "peer" / "turns-2026-11-29"))
from eight_prompts_in_process import generation, model, prompts


def run(ps: list[tuple[int, ...]], order: str) -> list[list[int]]:
    pool = KVPool(model.model, slots=8, max_len=2048, prefix_caching=True)
    engine = TargetEngine(model.model, pool, 512, decode_step="eager", prefill_order=order)
    engine.add(generation(ps[0][:30], 6))  # the system prompt cached, the cost of a forward measured
    while not engine.idle:
        engine.step()
    gens = [generation(p, 16) for p in ps]
    t0 = time.perf_counter()
    for g in gens:
        engine.add(g)
    first: dict[int, float] = {}
    while not engine.idle:
        engine.step()
        for i, g in enumerate(gens):
            if i not in first and len(g.target.committed) > len(g.request.prompt_ids):
                first[i] = time.perf_counter() - t0
    done = time.perf_counter() - t0
    ts = sorted(first.values())
    print(f"{order:8s}: TTFT p50 {1000 * statistics.median(ts):.0f} mean {1000 * statistics.mean(ts):.0f} "
          f"max {1000 * ts[-1]:.0f} ms, all 16 tokens {1000 * done:.0f} ms; each",
          [round(1000 * t) for t in ts], flush=True)
    return [g.result.token_ids for g in gens if g.result is not None]


print("prompt tokens:", [len(p) for p in prompts[8:16]])
reference = None
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for order in ("arrival", "shortest"):
        out = run(prompts[8:16], order)
        reference = reference or out
        print("  tokens the same as the first run's:", out == reference, flush=True)
