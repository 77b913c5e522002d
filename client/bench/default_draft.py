"""Measure training-free draft candidates for the default target (SmolLM2-135M-Instruct, fp32, CPU).

    python -m card.client.bench.default_draft agreement --out agreement.json
    python -m card.client.bench.default_draft e2e --drafts L10,int8,L10+int8 --out e2e.json

A candidate is ``int8`` (dynamic int8 copy), ``L<N>`` (first N decoder layers + final norm + head)
or ``L<N>+int8``. ``agreement`` reports greedy agreement with the target along the target's own
greedy continuation and single-thread forward times for 1 and 4 (a tree layer) tokens over a
~200-token KV cache; ``e2e`` runs the in-process engine (card with 1+1 threads vs vanilla with 2,
and vanilla with 1 thread as a control).
Candidates are interleaved round by round (A B A B) and medians reported, because the CPU is shared.
Results are written to docs/default-draft.md by hand.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from card.client.bench import data
from card.client.bench.pools import prefilled, siblings
from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.draft_variants import truncate_layers
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared import kv_pool
from card.engine.shared.config import GenerationRequest, Mode, StopParams
from card.engine.shared.kv_pool import Segment


def prompts(n: int, directory: Path | None = None) -> list[str]:
    """Half MT-Bench first turns (spread over categories), half GSM8K questions (card.client.bench.data:
    ``directory``, else $CARD_BENCH_DATA_DIR, else the packaged samples)."""
    mt = list(data.load("mt_bench", directory=directory).prompts)
    n_mt = (n + 1) // 2
    gsm = list(data.load("gsm8k", n - n_mt, directory).prompts) if n > n_mt else []
    return mt[:: max(1, len(mt) // n_mt)][:n_mt] + gsm


def make_draft(target: torch.nn.Module, name: str) -> torch.nn.Module:
    model = copy.deepcopy(target)
    for part in name.split("+"):
        if part.startswith("L"):
            truncate_layers(model, int(part[1:]))
        elif part == "int8":
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        elif part != "fp32":
            raise SystemExit(f"unknown candidate part {part!r}")
    return model.eval()


@torch.inference_mode()
def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    pool = kv_pool.KVPool(model, slots=1, max_len=len(ids) + n)
    last = torch.tensor([len(ids) - 1])
    logits = kv_pool.forward(model, pool, [Segment(0, 0, len(ids))], torch.tensor(ids), last)
    out: list[int] = []
    for _ in range(n):
        token = int(logits[-1].argmax())
        out.append(token)
        pos = len(ids) + len(out) - 1
        row = torch.zeros(1, dtype=torch.int64)
        logits = kv_pool.forward(model, pool, [Segment(0, pos, 1)], torch.tensor([token]), row)
    return out


@torch.inference_mode()
def agreement(model: torch.nn.Module, prompt: list[int], cont: list[int]) -> tuple[int, int]:
    """(positions where the draft's argmax equals the target's token, positions)."""
    full = torch.tensor(prompt + cont)
    logits = model(input_ids=full[None, :-1]).logits[0]
    pred = logits[len(prompt) - 1 :].argmax(-1)
    return int((pred == full[len(prompt) :]).sum()), len(cont)


@torch.inference_mode()
def forward_ms(model: torch.nn.Module, prefix: list[int], q: int, reps: int) -> float:
    """Median ms of one forward of ``q`` sibling tokens (tree-layer mask) over a ``prefix`` KV cache."""
    n = len(prefix)
    pool = prefilled(model, prefix, q)
    tokens, segment, rows = torch.tensor(prefix[-q:]), siblings(n, q), torch.arange(q)
    times = []
    for _ in range(reps):  # rows past the prefix are simply overwritten next time
        t0 = time.perf_counter()
        kv_pool.forward(model, pool, [segment], tokens, rows)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def run_agreement(args: argparse.Namespace) -> dict:
    target = load_model(ModelConfig(spec=args.target))
    names = args.drafts.split(",")
    drafts = {name: make_draft(target.model, name) for name in names}
    torch.set_num_threads(2)
    texts = prompts(args.prompts, args.data_dir)
    pairs = []
    for text in texts:
        ids = target.encode_prompt(text)
        pairs.append((ids, greedy(target.model, ids, args.tokens)))
    agree = {name: [0, 0] for name in names}
    for ids, cont in pairs:
        for name, model in drafts.items():
            a, n = agreement(model, ids, cont)
            agree[name][0] += a
            agree[name][1] += n
    torch.set_num_threads(1)
    prefix = (pairs[0][0] + pairs[0][1] + pairs[1][0])[: args.kv]
    timing: dict[str, dict[int, list[float]]] = {name: {1: [], 4: []} for name in ["target", *names]}
    models = {"target": target.model, **drafts}
    for _ in range(args.rounds):  # interleaved: every candidate once per round
        for name, model in models.items():
            for q in (1, 4):
                timing[name][q].append(forward_ms(model, prefix, q, args.reps))
    result = {}
    for name in ["target", *names]:
        t1 = statistics.median(timing[name][1])
        t4 = statistics.median(timing[name][4])
        row = {"ms_1": round(t1, 2), "ms_4": round(t4, 2),
               "ms_1_rounds": [round(t, 2) for t in timing[name][1]],
               "ms_4_rounds": [round(t, 2) for t in timing[name][4]]}
        if name != "target":
            row["agreement"] = round(agree[name][0] / agree[name][1], 4)
        result[name] = row
        print(f"{name:>12}: agreement {row.get('agreement', 1.0):.3f}  1-token {t1:6.2f} ms  "
              f"4-token {t4:6.2f} ms", flush=True)
    return {"prompts": len(texts), "tokens": args.tokens, "kv": len(prefix), "rounds": args.rounds,
            "reps": args.reps, "candidates": result}


def run_e2e(args: argparse.Namespace) -> dict:
    target = load_model(ModelConfig(spec=args.target))
    names = args.drafts.split(",")
    drafts = {name: dataclasses.replace(target, model=make_draft(target.model, name), name=name)
              for name in names}
    # vanilla on 1 thread is the control that separates the draft's gain from the thread split's
    configs = {"vanilla": (None, RunnerConfig(mode=Mode.VANILLA, target_threads=2)),
               "vanilla-1t": (None, RunnerConfig(mode=Mode.VANILLA, target_threads=1))}
    for name, draft in drafts.items():
        configs[name] = (draft, RunnerConfig(mode=Mode.CARD, target_threads=1, draft_threads=1))
    texts = prompts(args.prompts, args.data_dir)
    stop = StopParams(max_new_tokens=args.tokens, ignore_eos=True)
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    reference: dict[int, tuple[int, ...]] = {}
    for rnd in range(args.rounds):
        for i, text in enumerate(texts):
            ids = tuple(target.encode_prompt(text))
            for name, (draft, cfg) in configs.items():  # interleaved per prompt
                runner = InProcessRunner(target, draft, cfg)
                try:
                    gen = runner.generation(GenerationRequest(ids, stop=stop))
                    for _ in runner.stream(gen):
                        pass
                    res = gen.result
                finally:
                    runner.close()
                tokens = tuple(res.token_ids)
                if reference.setdefault(i, tokens) != tokens:
                    raise SystemExit(f"{name} output differs from vanilla on prompt {i}: exactness broken")
                s = res.stats
                rows[name].append({"round": rnd, "prompt": i, "tok_s": s.tokens_per_s,
                                   "accepted": s.mean_accepted_length, "hit_rate": s.hit_rate,
                                   "secondary_hit_rate": s.secondary_hit_rate})
                print(f"round {rnd} prompt {i} {name:>10}: {s.tokens_per_s:6.2f} tok/s  "
                      f"accepted {s.mean_accepted_length:.2f}  hit {s.hit_rate:.2f}", flush=True)
    vanilla = statistics.median(r["tok_s"] for r in rows["vanilla"])
    summary = {}
    for name, rs in rows.items():
        med = {key: statistics.median(r[key] for r in rs)
               for key in ("tok_s", "accepted", "hit_rate", "secondary_hit_rate")}
        summary[name] = {**{key: round(v, 3) for key, v in med.items()},
                         "speedup": round(med["tok_s"] / vanilla, 3)}
        print(f"{name:>10}: {summary[name]}", flush=True)
    return {"prompts": len(texts), "tokens": args.tokens, "rounds": args.rounds, "summary": summary,
            "runs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("agreement", "e2e"))
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafts", default="int8,L6,L10,L15,L20,L10+int8,L15+int8")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kv", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="mt_bench/ and gsm8k/ here "
                             "(default: $CARD_BENCH_DATA_DIR, else the packaged samples)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = run_agreement(args) if args.what == "agreement" else run_e2e(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
