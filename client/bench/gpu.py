"""GPU speed of the exact forward (``make gpu-check``, after the exactness tests in tests/gpu).

Random weights at the shapes of Qwen2.5-1.5B (target) and Qwen2.5-0.5B (draft) in bfloat16:
forward cost does not depend on the weights, and no weights can be downloaded where this runs.

    forward   one target forward of R decoding rows (R/8 sessions x 8-row chains, at most one
              session per 8 rows) against R, exact on and off: the cost of invariance per shape
    serving   plain decoding and card tokens/s with 1, 4, 8 and 32 requests in flight through the
              target engine (card: draft worker on the same GPU), exact on and off; every figure
              is also a ratio to plain decoding (the first of ``--kernels``) in the same run; card
              under each ``--speculation`` mode asked for

Random-weight drafts agree with the target at chance level, so card figures here measure what
speculation costs, not what a trained pair gains (accepted length is printed beside them). The
JSON goes to ``--out``; a table to stdout.

    python -m card.client.bench.gpu --out gpu-check.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.invariant import make_exact
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import GenerationRequest, Mode, SamplingParams, StopParams, TreeParams
from card.engine.shared.hf import CausalLM
from card.engine.shared.kv_pool import KVPool, Segment, forward
from card.engine.target.chain_source import NoDraft
from card.engine.target.drafting_policy import DraftingConfig, DraftingPolicy
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

TARGET = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
              num_key_value_heads=2, vocab_size=151936)
DRAFT = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
IN_FLIGHT = (1, 4, 8, 32)


def random_qwen(shape: dict, seed: int, device: str, exact: bool) -> CausalLM:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device(device):
        model: CausalLM = Qwen2ForCausalLM(config)
        model = model.to(torch.bfloat16).eval()
    make_exact(model, exact=exact)
    return model


class _Ids:
    """The tokenizer of a random model: text is the token ids themselves."""

    def decode(self, token_ids: list[int], **_: object) -> str:
        return " ".join(map(str, token_ids))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_ms(model: CausalLM, rows: int, exact: bool, context: int, device: str,
               repeats: int = 20) -> float:
    """Median ms of one forward of ``rows`` decoding rows at ``context`` tokens of history."""
    sessions = max(1, rows // 8)
    per = rows // sessions
    pool = KVPool(model, slots=sessions, max_len=context + per + 1)
    segments = [Segment(s, context, per, exact=exact) for s in range(sessions)]
    tokens = torch.randint(0, model.config.vocab_size, (sessions * per,))
    logit_rows = torch.arange(sessions * per)
    times = []
    for i in range(repeats + 3):
        _sync(device)
        t0 = time.perf_counter()
        forward(model, pool, segments, tokens, logit_rows)
        _sync(device)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _requests(n: int, vocab: int, new_tokens: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(7)
    stop = StopParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [tuple(torch.randint(0, vocab, (128,), generator=gen).tolist()) for _ in range(n)]
    return [GenerationRequest(p, SamplingParams(), stop) for p in prompts]


def serve_tok_s(target: CausalLM, draft: CausalLM | None, in_flight: int, exact: bool,
                new_tokens: int, device: str, speculation: str | DraftingPolicy = "auto") -> dict:
    """Tokens/s of ``in_flight`` requests run together to their end (card when ``draft``), the
    engine's drafting policy in ``speculation`` mode (or that policy: a serving engine keeps one
    for its life, and what it measured before)."""
    policy = (speculation if isinstance(speculation, DraftingPolicy)
              else DraftingPolicy(DraftingConfig(speculation=speculation)))
    vocab = target.config.vocab_size
    requests = _requests(in_flight, vocab, new_tokens)
    runner = None
    if draft is not None:
        loaded = [LoadedModel("random", m, _Ids(), "fp", frozenset(), 4096, exact=exact)
                  for m in (target, draft)]
        tree = TreeParams(width=4, max_depth=6, max_chain=6)
        runner = InProcessRunner(loaded[0], loaded[1], RunnerConfig(
            mode=Mode.CARD, tree=tree, cache_device=device, backoff=False, draft_slots=max(in_flight, 1)))
    try:
        pool = KVPool(target, slots=in_flight, max_len=128 + new_tokens + 16)
        engine = TargetEngine(target, pool, exact=exact,
                              policy=policy)
        gens = [runner.generation(r) if runner else
                Generation(r, NoDraft(), eos_ids=frozenset(), decode=lambda ids: "", context_window=4096,
                           mode="vanilla", vocab_size=vocab) for r in requests]
        for g in gens:
            engine.add(g)
        _sync(device)
        t0 = time.perf_counter()
        while not engine.idle:
            engine.step()
        _sync(device)
        wall = time.perf_counter() - t0
    finally:
        if runner is not None:
            runner.close()
    new = sum(g.stats.new_tokens for g in gens)
    forwards = sum(g.stats.target_forwards for g in gens)
    paused = sum(g.stats.drafting_paused_steps for g in gens)
    return {"tok_s": new / wall, "wall_s": wall, "new_tokens": new,
            "accepted_length": new / forwards if forwards else 0.0, "engine_forwards": engine.forwards,
            "speculation": policy.config.speculation, "paused_share": paused / forwards if forwards else 0.0}


@click.command()
@click.option("--device", default="cuda", show_default=True)
@click.option("--new-tokens", default=64, show_default=True, type=int)
@click.option("--context", default=512, show_default=True, type=int, help="history of the forward sweep")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("gpu-check.json"),
              show_default=True)
@click.option("--small", is_flag=True, help="tiny shapes (a smoke run on any machine)")
@click.option("--kernels", default="exact,vendor", show_default=True,
              help="comma-separated: exact (invariant kernels), vendor")
@click.option("--in-flight", "in_flight", default=",".join(map(str, IN_FLIGHT)), show_default=True,
              help="comma-separated requests in flight")
@click.option("--speculation", default="auto", show_default=True,
              help="comma-separated speculation controller modes card runs under (auto, always, never); "
                   "the random draft never agrees with the target, so auto shows what the controller "
                   "saves and always what speculation costs")
@click.option("--rounds", default=1, show_default=True, type=int,
              help="serve each card load this many times with one controller (a serving engine keeps "
                   "its controller: round 2 on shows what it has learned)")
def main(device: str, new_tokens: int, context: int, out: Path, small: bool, kernels: str, in_flight: str,
         speculation: str, rounds: int) -> None:
    """Forward cost against rows, and serving tokens/s, exact on and off."""
    loads = tuple(int(n) for n in in_flight.split(","))
    modes = tuple(speculation.split(","))
    for mode in modes:
        DraftingConfig(speculation=mode)  # validates
    tshape, dshape = (TARGET, DRAFT) if not small else (
        dict(TARGET, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=2048),
        dict(DRAFT, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
             vocab_size=2048))
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    report: dict = {"device": gpu, "torch": torch.__version__, "target_shape": tshape,
                    "draft_shape": dshape, "forward_ms": {}, "serving": {}}
    draft = random_qwen(dshape, 1, device, exact=False)
    for key in kernels.split(","):
        if key not in ("exact", "vendor"):
            raise click.BadParameter(f"kernels are exact or vendor, not {key!r}")
        exact = key == "exact"
        target = random_qwen(tshape, 0, device, exact=exact)
        report["forward_ms"][key] = {r: forward_ms(target, r, exact, context, device) for r in ROWS}
        for warm in (None, draft):  # first calls pay for kernel selection and allocator growth
            serve_tok_s(target, warm, 2, exact, 4, device)
        for n in loads:
            report["serving"][f"{key}/vanilla/{n}"] = serve_tok_s(target, None, n, exact, new_tokens, device)
            for mode in modes:
                policy = DraftingPolicy(DraftingConfig(speculation=mode))
                base_name = "card" if len(modes) == 1 else f"card-{mode}"
                for r in range(rounds):
                    name = base_name + (f"-r{r + 1}" if rounds > 1 else "")
                    report["serving"][f"{key}/{name}/{n}"] = serve_tok_s(target, draft, n, exact, new_tokens,
                                                                         device, policy)
        del target
    first = kernels.split(",")[0]
    base = {n: report["serving"][f"{first}/vanilla/{n}"]["tok_s"] for n in loads}
    for key, row in report["serving"].items():
        row["vs_vanilla"] = row["tok_s"] / base[int(key.rsplit("/", 1)[1])]
    out.write_text(json.dumps(report, indent=2))
    click.echo(f"device: {gpu}")
    click.echo("rows  " + "  ".join(f"{r:>7}" for r in ROWS))
    for key, times in report["forward_ms"].items():
        click.echo(f"{key:<6}" + "  ".join(f"{times[r]:7.2f}" for r in ROWS) + "  ms")
    for key, row in report["serving"].items():
        click.echo(f"{key:<24} {row['tok_s']:9.1f} tok/s  x{row['vs_vanilla']:.2f}  "
                   f"acc {row['accepted_length']:.2f}  paused {row['paused_share']:.0%}")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
