"""Does the compiled static step keep one graph across row buckets with dynamo's automatic dynamic
shapes (``dynamic=None``), and at what compile cost? Packed exact linears (card::packed_linear).

    .venv/bin/python docs/measurements/static-step/compiled_dynamic_rows.py auto   # or: dynamic
"""

import sys
import time

import torch
from torch._dynamo.utils import counters

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared import static_step
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.static_step import DecodeRows, StaticStep

torch.set_num_threads(2)
model = load_model(ModelConfig(dtype="float32", exact=True))
pool = KVPool(model.model, slots=8, max_len=1024)
for slot in range(8):
    pool.ready(slot, 0, 1024)
step = StaticStep(model.model, pool, 128, mode="static")
step._fn = torch.compile(static_step.decode_forward, fullgraph=True,
                         dynamic=None if sys.argv[1:] == ["auto"] else True)
tokens = list(range(100, 120))
first: dict[int, torch.Tensor] = {}
for bucket in (1, 2, 4, 8, 16):
    t0 = time.perf_counter()
    out = step.run([DecodeRows(0, 10, tokens[:min(bucket, 8)])], bucket)
    first[bucket] = out.logits[:1].clone()
    print("bucket", bucket, "took", round(time.perf_counter() - t0, 1), "s; graphs",
          counters["stats"]["unique_graphs"], flush=True)
print("equal across buckets:", all(torch.equal(first[1], first[b]) for b in first))
t0 = time.perf_counter()
step.run([DecodeRows(0, 100, tokens[:3])], 4)
print("span 2:", round(time.perf_counter() - t0, 1), "s; graphs", counters["stats"]["unique_graphs"])
