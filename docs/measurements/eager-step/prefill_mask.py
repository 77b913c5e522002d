"""A 1,500-token prefill (and 4 tokens) with the causal mask filled over the block's own corner
against the former mask over every key of the span, alternating, 3 rounds, in one process. The
former ``attend_blocks`` is loaded from commit 5b2083b.

    .venv/bin/python docs/measurements/eager-step/prefill_mask.py
"""

import importlib.util
import subprocess
import sys
import tempfile
import time

import torch

import card.engine.shared.exact_attention as new
import card.engine.shared.kv_pool as kv_pool
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

source = subprocess.run(["git", "show", "5b2083b:engine/shared/exact_attention.py"], check=True,
                        capture_output=True, text=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
spec = importlib.util.spec_from_file_location("former_exact_attention", f.name)
old = importlib.util.module_from_spec(spec)
sys.modules["former_exact_attention"] = old
spec.loader.exec_module(old)

torch.set_num_threads(2)
model = load_model(ModelConfig(dtype="float32", exact=True))
ids = model.encode_prompt("the quick brown fox jumps over the lazy dog and then " * 200)[:1500]


def run(attend_blocks):
    kv_pool.attend_blocks = attend_blocks
    engine = TargetEngine(model.model, KVPool(model.model, slots=2, max_len=2048), decode_step="eager")
    stop = StopParams(max_new_tokens=4, ignore_eos=True)
    g = Generation(GenerationRequest(tuple(ids), SamplingParams(), stop),
                   NoDraft(), eos_ids=frozenset(), decode=model.decode, context_window=8192,
                       mode="vanilla")
    engine.add(g)
    t = time.perf_counter()
    while not g.done:
        engine.step()
    return time.perf_counter() - t, g.tracker.text


to = tn = 0.0
for _ in range(3):
    a, text_old = run(old.attend_blocks)
    b, text_new = run(new.attend_blocks)
    to, tn = to + a, tn + b
print(f"1500-token prefill + 4 tokens: whole-span mask {to / 3:.2f} s, corner mask {tn / 3:.2f} s, "
      f"ratio {to / tn:.3f}; texts equal: {text_old == text_new}")
