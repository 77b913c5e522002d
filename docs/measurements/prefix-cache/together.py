"""Four questions about one new ~1,500-token document submitted at once (a RAG burst) to the
default model in process on 4 KV slots: each question's time to first token (TTFT), prefix caching
on and off in the same run (a fresh engine per round, rounds alternating), and the outputs of
both, which must be equal token for token. With caching on, the first-admitted prompt computes the
document and the others copy its rows as they come (TargetEngine._follows). Issue 37; output in
together-cpu.txt beside this file.

    .venv/bin/python docs/measurements/prefix-cache/together.py [rounds] [threads]
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import torch
from four_questions import NEW, prompts

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine


def together(model, caching: bool, asks: list[list[int]]):
    """(TTFT seconds, token ids, cached tokens) per question, all four admitted at once."""
    window = max(len(p) for p in asks) + NEW + 1
    engine = TargetEngine(model.model, KVPool(model.model, slots=len(asks), max_len=window,
                                              prefix_caching=caching))
    stop = StopParams(max_new_tokens=NEW, ignore_eos=True)
    gens = [Generation(GenerationRequest(tuple(p), SamplingParams(), stop), NoDraft(), eos_ids=frozenset(),
                       decode=model.decode, context_window=window, mode="vanilla")
            for p in asks]
    t0 = time.perf_counter()
    first: dict[int, float] = {}
    for g in gens:
        engine.add(g)
    while not engine.idle:
        for event in engine.step():
            assert event.error is None, event.error
            if event.chunk is not None and event.chunk.token_ids and id(event.generation) not in first:
                first[id(event.generation)] = time.perf_counter() - t0
    return [(first[id(g)], g.result.token_ids, g.stats.cached_tokens) for g in gens]


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(threads)
    model = load_model(ModelConfig())
    asks = prompts(model)
    print(f"model {model.name}, {next(model.model.parameters()).dtype}, torch {torch.__version__}, "
          f"{threads} thread(s); prompt tokens {[len(p) for p in asks]}")
    ttft: dict[bool, list[list[float]]] = {True: [], False: []}
    outputs: dict[bool, list] = {}
    for r in range(rounds):
        for caching in ((False, True) if r % 2 == 0 else (True, False)):
            got = together(model, caching, asks)
            ttft[caching].append([t for t, _, _ in got])
            outputs[caching] = [ids for _, ids, _ in got]
            times = " / ".join(f"{t:.2f}" for t, _, _ in got)
            print(f"round {r} caching {'on ' if caching else 'off'}: TTFT {times} s, "
                  f"cached {[c for _, _, c in got]}", flush=True)
    assert outputs[True] == outputs[False], "caching changed an output"
    for caching in (False, True):
        per = [statistics.median(r[i] for r in ttft[caching]) for i in range(len(asks))]
        print(f"caching {'on ' if caching else 'off'} median TTFT per question "
              f"{' / '.join(f'{t:.2f}' for t in per)} s; last first token {max(per):.2f} s")
    print("outputs equal: True")


if __name__ == "__main__":
    main()
