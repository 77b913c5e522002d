"""Four questions about one ~1,500-token document, asked in turn, to the default model in process:
the time to first token (TTFT) of each, with prefix caching on and off in the same run (a fresh
engine of one KV slot per round, rounds alternating), and the outputs of both, which must be equal
token for token (greedy and seeded). Issue 37; output in four-questions-cpu.txt beside this file.

    .venv/bin/python docs/measurements/prefix-cache/four_questions.py [rounds] [threads]

The document is the first 1,500 tokens of this repository's docs/architecture.md (held out: the
model never saw it), in the chat template with each question after it.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

QUESTIONS = ["What does the target service do?", "Which service keeps the draft trees?",
             "How does a draft worker find its work?", "What happens when the cache restarts?"]
DOC_TOKENS = 1500
NEW = 24


def prompts(model) -> list[list[int]]:
    text = (Path(__file__).resolve().parents[2] / "architecture.md").read_text()
    ids = model.tokenizer(text)["input_ids"][:DOC_TOKENS]
    doc = model.tokenizer.decode(ids)
    return [model.encode_prompt([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]) for q in QUESTIONS]


def ask_in_turn(model, caching: bool, asks: list[list[int]], seed: int | None):
    """(TTFT seconds, token ids, cached tokens) per question, asked in turn on a fresh engine."""
    window = max(len(p) for p in asks) + NEW + 1
    engine = TargetEngine(model.model, KVPool(model.model, slots=1, max_len=window, prefix_caching=caching))
    out = []
    for prompt in asks:
        sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
        stop = StopParams(max_new_tokens=NEW, ignore_eos=True)
        gen = Generation(GenerationRequest(tuple(prompt), sampling, stop), NoDraft(), eos_ids=frozenset(),
                         decode=model.decode, context_window=window, mode="vanilla")
        t0 = time.perf_counter()
        ttft = None
        for chunk in engine.stream(gen):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
        assert gen.result is not None and ttft is not None
        out.append((ttft, gen.result.token_ids, gen.stats.cached_tokens))
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(threads)
    model = load_model(ModelConfig())
    asks = prompts(model)
    print(f"model {model.name}, {next(model.model.parameters()).dtype}, torch {torch.__version__}, "
          f"{threads} thread(s); prompt tokens {[len(p) for p in asks]}")
    ask_in_turn(model, False, [asks[0][:64]], None)  # warm-up
    ttft: dict[bool, list[list[float]]] = {True: [], False: []}
    for r in range(rounds):
        for caching in ((False, True) if r % 2 == 0 else (True, False)):
            got = ask_in_turn(model, caching, asks, None)
            ttft[caching].append([t for t, _, _ in got])
            if caching:
                cached_round = got
            else:
                plain_round = got
        same = [a[1] == b[1] for a, b in zip(cached_round, plain_round, strict=True)]
        print(f"round {r + 1}: greedy outputs equal on/off: {same}; cached tokens "
              f"{[c for _, _, c in cached_round]}")
    for seed in (1, 2):
        on, off = ask_in_turn(model, True, asks, seed), ask_in_turn(model, False, asks, seed)
        same = [a[1] == b[1] for a, b in zip(on, off, strict=True)]
        print(f"seed {seed}: sampled outputs equal on/off: {same}")
    for caching in (False, True):
        per_q = [statistics.median(r[i] for r in ttft[caching]) for i in range(len(QUESTIONS))]
        later = statistics.mean(per_q[1:])
        print(f"prefix caching {'on ' if caching else 'off'}: TTFT median per question (s) "
              f"{[round(t, 3) for t in per_q]}; 1st / mean(2nd-4th) = {per_q[0] / later:.2f}x")
    on1 = [statistics.median(r[i] for r in ttft[True]) for i in range(len(QUESTIONS))]
    off1 = [statistics.median(r[i] for r in ttft[False]) for i in range(len(QUESTIONS))]
    print(f"2nd-4th TTFT, off / on: {statistics.mean(off1[1:]) / statistics.mean(on1[1:]):.2f}x")


if __name__ == "__main__":
    main()
