"""Where one engine iteration's time goes: ``python -m card.client.bench.host_cost``.

Runs card-target's own loop (card.engine.target.scheduler.TargetEngine) in process on ``c``
generations at once for each concurrency ``c``, every one greedy for ``--tokens`` tokens, and
reports per iteration (medians over the decoding iterations, prefill excluded):

    plan      admission, the chain sources' steps, the chain cut, the forward's index tensors
    forward   the model: embeddings, every layer, the LM head
    commit    sampling / acceptance, stop checks, detokenizing, finishing
    host      plan + commit, and its share of the iteration (the issue's budget: <= 10%)

``--breakdown`` splits the forward too, with the engine's own functions timed around their calls
(a second, separate pass, since the timers cost a little themselves): linear layers (projections
and MLP), attention (the per-session core: card.engine.shared.exact_attention or SDPA), the LM
head, and the rest of the forward (norms, rotary, residuals, Python between them).

The figures are what a user's card-target pays per iteration on this machine; through the
services, card-target's ``card_target_iteration_seconds{phase}`` histogram reports the same phases.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import torch

from card.client.bench import data
from card.client.options import DEFAULT_MODEL
from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared import exact_attention, kv_pool
from card.engine.shared.config import GenerationRequest, Mode, SamplingParams, StopParams
from card.engine.target.scheduler import IterationTimes, TargetEngine


def run_batch(target: LoadedModel, runner: InProcessRunner, prompts: list[list[int]], tokens: int,
              exact: bool, timers: Timers | None = None) -> tuple[list[IterationTimes], list[list[int]]]:
    """Every prompt as one generation, all at once in one engine: each decoding iteration's
    times (and, given ``timers``, each one's split in ``timers.splits``), and each generation's
    tokens."""
    gens = [runner.generation(GenerationRequest(p, SamplingParams(), StopParams(tokens, ignore_eos=True)))
            for p in prompts]
    pool = kv_pool.KVPool(target.model, slots=len(gens), max_len=max(g.kv_len for g in gens))
    engine = TargetEngine(target.model, pool, exact=exact)
    for gen in gens:
        engine.add(gen)
    times = []
    while not engine.idle:
        decoding = all(not g.prefilling for g in engine.running) and len(engine.running) == len(gens)
        if timers is not None:
            timers.seconds.clear()
        engine.step()
        if decoding and engine.last is not None:
            times.append(engine.last)
            if timers is not None:
                timers.splits.append(dict(timers.seconds))
    return times, [g.result.token_ids for g in gens]


class Timers:
    """Seconds spent in named calls, summed, while ``patched`` is active."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.splits: list[dict[str, float]] = []  # one per decoding iteration (run_batch)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed

    @contextlib.contextmanager
    def patched(self, model: torch.nn.Module) -> Iterator[None]:
        """Time the attention cores, every Linear of the layers, and the LM head."""
        saved = []

        def swap(owner: object, attr: str, name: str) -> None:
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, self.wrap(name, getattr(owner, attr)))

        swap(kv_pool, "attend_rows", "attention")
        swap(exact_attention.RowPlan, "attend", "attention")
        swap(kv_pool, "sdpa_attention_forward", "attention")
        swap(torch.nn.functional, "scaled_dot_product_attention", "attention")
        for layer in model.model.layers:  # the supported families' projections (kv_pool.enable)
            for block, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    swap(getattr(block, name), "forward", "linear")
        swap(model.lm_head, "forward", "lm_head")
        try:
            yield
        finally:
            for owner, attr, fn in reversed(saved):
                if attr == "forward" and isinstance(owner, torch.nn.Module):
                    del owner.forward  # back to the class's method
                else:
                    setattr(owner, attr, fn)


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 3) if xs else 0.0


def summarize(times: list[IterationTimes]) -> dict:
    total = _ms([t.total for t in times])
    host = _ms([t.plan + t.commit for t in times])
    return {"iterations": len(times), "iteration_ms": total, "plan_ms": _ms([t.plan for t in times]),
            "forward_ms": _ms([t.forward for t in times]), "commit_ms": _ms([t.commit for t in times]),
            "host_ms": host, "host_share": round(host / total, 4) if total else 0.0,
            "rows": statistics.median(t.rows for t in times) if times else 0}


@click.command(context_settings={"auto_envvar_prefix": "CARD_BENCH", "show_default": True})
@click.option("--target-model", default=DEFAULT_MODEL, help="A checkpoint folder, a .gguf or 'default'.")
@click.option("--target-dtype", default="auto")
@click.option("--draft-model", default=None, help="With --mode card: the draft (in process).")
@click.option("--mode", type=click.Choice(["vanilla", "card"]), default="vanilla")
@click.option("--concurrency", default="1,8", help="Generations at once, comma-separated.")
@click.option("--tokens", default=64, help="New tokens per generation.")
@click.option("--dataset", default="gsm8k", help="Prompts (card-bench's datasets).")
@click.option("--threads", type=int, default=None, help="torch threads (default: all cores).")
@click.option("--exact/--inexact", default=True, help="The target's batch-invariant forward.")
@click.option("--breakdown/--no-breakdown", default=True, help="A second pass that splits the forward.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSON report.")
def main(target_model: str, target_dtype: str, draft_model: str | None, mode: str, concurrency: str,
         tokens: int, dataset: str, threads: int | None, exact: bool, breakdown: bool,
         out: Path | None) -> None:
    """Print each concurrency's iteration time by phase (ms, medians) and the host's share."""
    if threads:
        torch.set_num_threads(threads)
    target = load_model(ModelConfig(spec=target_model, dtype=target_dtype, exact=exact))
    draft = load_model(ModelConfig(spec=draft_model)) if mode == "card" and draft_model else None
    runner = InProcessRunner(target, draft if mode == "card" else None, RunnerConfig(mode=Mode(mode)))
    levels = [int(c) for c in concurrency.split(",")]
    texts = data.load(dataset, max(levels)).prompts
    prompts = [target.encode_prompt(t) for t in texts]
    report: dict = {"target": target.name, "mode": mode, "tokens": tokens, "exact": exact,
                    "threads": torch.get_num_threads(), "levels": {}}
    try:
        run_batch(target, runner, prompts[:1], 8, exact)  # warm the kernels up
        for c in levels:
            times, outputs = run_batch(target, runner, prompts[:c], tokens, exact)
            row = summarize(times)
            if breakdown:
                timers = Timers()
                with timers.patched(target.model):
                    split, again = run_batch(target, runner, prompts[:c], tokens, exact, timers)
                assert again == outputs, "the timed pass changed the outputs"
                parts = {k: [s.get(k, 0.0) for s in timers.splits]
                         for k in ("linear", "attention", "lm_head")}
                parts["forward_rest"] = [t.forward - sum(s.values()) for t, s in zip(split, timers.splits,
                                                                                       strict=True)]
                row["forward_split_ms"] = {k: _ms(v) for k, v in parts.items()}
            report["levels"][c] = row
            click.echo(f"{c} in flight: {json.dumps(row)}")
    finally:
        runner.close()
    if out:
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
