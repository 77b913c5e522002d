"""Draft rounds/s in process (issue 34): the eager tree forward with SDPA (the CPU's default before
the attention kernel), with the attention kernel (card.engine.shared.row_attention, the default on
fp32 CPU pools since 2026-11-29), the eager forward on the block tree (``KVPool.tree_blocks``) and
the static tree step (card.engine.draft.static_tree), interleaved rep by rep so that all four see
the same load.

    python docs/measurements/draft-static-step/tree_rounds.py QUANTIZE SESSIONS REPS
    e.g.   ... none 1,8 6

The embedded SmolLM2-135M, one intra-op thread, trees of width 4 and depth 8; a rep restarts each
session (its prompt of 100-380 tokens prefilled, untimed) and times the 7 expansion rounds that
grow its tree to depth 8. Prints the median rounds/s of each and its ratio to SDPA's."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from card.engine.draft.drafter import Drafter, grow_round
from card.engine.draft.static_tree import TreeStep
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import TreeParams
from card.engine.shared.kv_pool import KVPool

torch.set_num_threads(1)
model = load_model(ModelConfig(quantize=sys.argv[1])).model
params = TreeParams(width=4, max_depth=8)
prompts = [torch.randint(0, 49000, (100 + 40 * i,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(8)]


def setup(n: int, static: bool, kernel: bool) -> tuple[KVPool, list[Drafter], TreeStep | None]:
    pool = KVPool(model, slots=8, max_len=1024)
    pool.row_kernel = kernel  # tree rows through the attention kernel (card.engine.shared.row_attention)
    drafters = [Drafter(model, params, pool=pool) for _ in range(n)]
    return pool, drafters, (TreeStep(model, pool, 8 * params.width) if static else None)


def bench(n: int, reps: int) -> None:
    envs = {v: setup(n, v == "static", v == "kernel") for v in ("sdpa", "kernel", "blocks", "static")}
    res: dict[str, list[float]] = {v: [] for v in envs}
    for _ in range(reps):
        for v, (pool, drafters, step) in envs.items():
            pool.tree_blocks = v in ("blocks", "static")
            for i, d in enumerate(drafters):
                d.start(prompts[i], epoch=d.epoch + 1)
            while any(d.pending for d in drafters):
                grow_round(model, pool, drafters)
            t0 = time.perf_counter()
            for _ in range(params.max_depth - 1):
                grow_round(model, pool, drafters, step=step)
            res[v].append((params.max_depth - 1) / (time.perf_counter() - t0))
    med = {v: statistics.median(x) for v, x in res.items()}
    print(f"{n} sessions ({reps} interleaved reps, median): " + ", ".join(
        f"{v} {med[v]:.2f} rounds/s ({med[v] / med['sdpa']:.2f}x)" for v in res), flush=True)


for sessions in map(int, sys.argv[2].split(",")):
    bench(sessions, int(sys.argv[3]))
