"""Constrained decoding on the embedded model (SmolLM2-135M-Instruct, float32, CPU), in process:
plain constrained decoding vs card (the model-free drafter, with and without grammar drafts, and
the int8 draft of the same model with grammar drafts), same run, same prompts; and the grammar's
own cost per token (mask + commit time inside llguidance and the row's masking).

    PYTHONPATH=. .venv/bin/python docs/measurements/structured/grammar_drafts.py [--tokens 96]

Every card run must equal plain decoding token for token (asserted); the JSON must parse.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import (
    CPU_TREE,
    Constraint,
    DrafterKind,
    GenerationRequest,
    Mode,
    SamplingParams,
    StopParams,
    tree_params,
)
from card.engine.target import grammar as grammar_mod
from card.engine.target import logits_processors
from card.engine.target.scheduler import finish_alone
from card.target_service.tools import calls_constraint, read_tools
from tests.tiny_models import default_gguf

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "city": {"type": "string"}, "is_student": {"type": "boolean"}},
    "required": ["name", "age", "email", "city", "is_student"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "rating": {"type": "number"}},
    "required": ["title", "author", "year", "genres", "rating"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "location": {"type": "string"}, "temperature_celsius": {"type": "number"},
    "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
    "humidity_percent": {"type": "integer"}, "wind": {"type": "object", "properties": {
        "speed_kmh": {"type": "number"}, "direction": {"enum": ["N", "E", "S", "W"]}},
        "required": ["speed_kmh", "direction"], "additionalProperties": False}},
    "required": ["location", "temperature_celsius", "condition", "humidity_percent", "wind"],
    "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
FLIGHT_TOOL = {"type": "function", "function": {"name": "book_flight", "parameters": {
    "type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                                     "date": {"type": "string", "pattern": "^2026-[0-1][0-9]-[0-3][0-9]$"},
                                     "passengers": {"type": "integer"}},
    "required": ["origin", "destination", "date", "passengers"]}}}
TOOL_PROMPTS = ["What is the weather like in Madrid?",
                "Book a flight from Oslo to Rome on 2026-05-02 for two.",
                "Is it cold in Helsinki today?",
                "I need a flight from Lima to Quito for 3 people next month."]
CASES = [
    ("Give me a JSON record for a fictional university student living in Lyon.", PERSON),
    ("Describe the novel Dune as a JSON object.", BOOK),
    ("Report today's weather in Oslo as JSON.", WEATHER),
    ("Create a JSON profile for a retired teacher named Maria.", PERSON),
    ("Describe the book Pride and Prejudice as JSON.", BOOK),
    ("Weather report for Cairo in July, as JSON.", WEATHER),
]


class Timed(grammar_mod.GrammarState):
    spent = 0.0

    def mask(self, prefix):  # type: ignore[override]
        t = time.perf_counter()
        try:
            return super().mask(prefix)
        finally:
            Timed.spent += time.perf_counter() - t

    def commit(self, tokens):  # type: ignore[override]
        t = time.perf_counter()
        try:
            super().commit(tokens)
        finally:
            Timed.spent += time.perf_counter() - t


_process = logits_processors.LogitsProcessors.process


class TimedRows:
    """The rows' whole processing: the float64 copy to the host, then the mask."""

    spent = 0.0

    @staticmethod
    def process(self, row, prefix):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return _process(self, row, prefix)
        finally:
            TimedRows.spent += time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tools", action="store_true", help="required tool calls instead of JSON schemas")
    ap.add_argument("--no-neural", action="store_true", help="skip the int8 draft's rows")
    args = ap.parse_args()
    if args.tools:
        tools = read_tools([WEATHER_TOOL, FLIGHT_TOOL])
        cases = [(p, calls_constraint(tools, parallel=False)) for p in TOOL_PROMPTS]
    else:
        cases = [(p, Constraint("json_schema", json.dumps(schema))) for p, schema in CASES]
    torch.set_num_threads(args.threads)
    grammar_mod.GrammarState = Timed  # type: ignore[misc]  # the compiler builds Timed states
    logits_processors.LogitsProcessors.process = TimedRows.process  # type: ignore[method-assign]
    target = load_model(ModelConfig(spec=str(default_gguf()), device="cpu", exact=True))
    draft = None if args.no_neural else load_model(ModelConfig(spec=str(default_gguf()), device="cpu",
                                                               quantize="int8"))
    ngram_tree = tree_params("cpu", DrafterKind.NGRAM)
    plain = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA))
    lookup = InProcessRunner(target, None, RunnerConfig(mode=Mode.CARD, drafter=DrafterKind.NGRAM,
                                                        tree=ngram_tree, backoff=False))
    neural = None if draft is None else InProcessRunner(
        target, draft, RunnerConfig(mode=Mode.CARD, tree=CPU_TREE, draft_threads=1, target_threads=1))
    # (runner, grammar drafts): the vanilla runner's source drafts nothing, so with grammar drafts
    # on, every chain it verifies is one the grammar forced
    runners: dict[str, tuple[InProcessRunner | None, bool]] = {
        "plain constrained": (plain, False),
        "grammar drafts alone": (plain, True),
        "lookup": (lookup, False),
        "lookup + grammar": (lookup, True),
        "int8 draft": (neural, False),
        "int8 draft + grammar": (neural, True),
    }
    runnable = {name: (r, d) for name, (r, d) in runners.items() if r is not None}

    def request(prompt: str, constraint: Constraint | None) -> GenerationRequest:
        return GenerationRequest(tuple(target.encode_prompt(prompt)), SamplingParams(constraint=constraint),
                                 StopParams(max_new_tokens=args.tokens))

    # warm up: the tokenizer's grammar view (~1 s, once per model) and each runner
    for runner, _ in runnable.values():
        runner.run(request(*cases[0]))
    rows: dict[str, dict[str, list[float]]] = {}
    reference: dict[str, list[int]] = {}
    for prompt, constraint in cases:
        for name, (runner, drafts) in runnable.items():
            Timed.spent = TimedRows.spent = 0.0
            gen = runner.generation(request(prompt, constraint))
            gen.grammar_drafts = drafts
            t = time.perf_counter()
            result = finish_alone(runner.target.model, gen, exact=True, policy=runner.policy)
            wall = time.perf_counter() - t
            n = len(result.token_ids)
            if name == "plain constrained":
                reference[prompt] = result.token_ids
                if result.finish_reason == "eos" and not args.tools:
                    json.loads(result.text)
            else:
                assert result.token_ids == reference[prompt], (name, prompt)
            r = rows.setdefault(name, {"tok_s": [], "acc": [], "mask_ms_tok": [], "row_ms_tok": [],
                                            "drafted": [], "n": []})
            r["tok_s"].append(n / wall)
            lengths = result.stats.accepted_lengths[1:] or [1]
            r["acc"].append(statistics.mean(lengths))
            r["mask_ms_tok"].append(1000 * Timed.spent / n)
            r["row_ms_tok"].append(1000 * TimedRows.spent / n)
            r["drafted"].append(gen.grammar_drafted)
            r["n"].append(n)
        print(prompt[:40], {k: round(v["tok_s"][-1], 1) for k, v in rows.items()}, result.text[:60],
              flush=True)
    base = statistics.mean(rows["plain constrained"]["tok_s"])
    for name, r in rows.items():
        tok_s = statistics.mean(r["tok_s"])
        print(f"{name:22s} tok/s {tok_s:6.2f}  x{tok_s / base:4.2f}  "
              f"accepted {statistics.mean(r['acc']):4.2f}  "
              f"grammar ms/token {statistics.mean(r['mask_ms_tok']):5.2f}  "
              f"processed rows ms/token {statistics.mean(r['row_ms_tok']):5.2f}  "
              f"grammar-drafted tokens {sum(r['drafted'])} of {sum(r['n'])}", flush=True)

    # unconstrained plain decoding of as many tokens: the plain step's own cost
    steps = []
    for prompt, _ in cases:
        req = GenerationRequest(tuple(target.encode_prompt(prompt)), SamplingParams(),
                                StopParams(max_new_tokens=args.tokens, ignore_eos=True))
        t = time.perf_counter()
        res = plain.run(req)
        steps.append((time.perf_counter() - t) / len(res.token_ids))
    print(f"unconstrained plain step: {1000 * statistics.mean(steps):.1f} ms/token")

if __name__ == "__main__":
    main()
