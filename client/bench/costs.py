"""Forward costs that decide the tree shape on a machine: ``python -m card.client.bench.costs``.

Measures, with the engine's own forwards on a real prompt's KV cache:
    target  one verification of ``[next_token, *chain]`` for chain lengths 0..N, per thread count
            (engine/shared/kv_pool.py: the forward card-target and every in-process mode run)
    draft   one tree layer of K nodes (tree-attention mask) for K in the given widths
            (engine/shared/kv_pool.py)
    --beside-draft: the target's verifies on one thread again, while a thread forwards the draft
            on the other core, as in-process card runs them (the two share caches, memory
            bandwidth and the GIL)
Each number is the minimum and median over repetitions (minimum: the machine may be shared).
The ratio cost(L tokens) / cost(1 token) is what CARD's chain must beat: a chain of L drafted
tokens pays off only if its expected accepted length exceeds that ratio.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import click
import torch

from card.client.bench.pools import prefilled, siblings
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared import kv_pool
from card.engine.shared.kv_pool import Segment


def _time(fn, reps: int) -> tuple[float, float]:
    fn()  # warm-up (oneDNN / MKL pick their kernels per shape)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3, statistics.median(ts) * 1e3


def verify_costs(model: torch.nn.Module, prompt: list[int], lengths: range, threads: int,
                 reps: int) -> dict[int, tuple[float, float]]:
    """ms (min, median) of one target verification of 1 + L tokens on top of ``prompt``."""
    torch.set_num_threads(threads)
    n = len(prompt)
    pool = prefilled(model, prompt, max(lengths, default=0) + 1)
    out = {}
    for length in lengths:
        tokens = torch.tensor(prompt[-(length + 1):])
        rows = torch.arange(tokens.numel())

        def once(tokens=tokens, rows=rows):  # rows past the prompt are simply overwritten next time
            kv_pool.forward(model, pool, [Segment(0, n, tokens.numel())], tokens, rows)

        out[length] = _time(once, reps)
    return out


def layer_costs(model: torch.nn.Module, prompt: list[int], widths: tuple[int, ...], threads: int,
                reps: int) -> dict[int, tuple[float, float]]:
    torch.set_num_threads(threads)
    n = len(prompt)
    pool = prefilled(model, prompt, max(widths, default=1))
    out = {}
    for k in widths:
        tokens, segment, rows = torch.tensor(prompt[-k:]), siblings(n, k), torch.arange(k)

        def once(tokens=tokens, segment=segment, rows=rows):  # rows past the prompt: overwritten
            kv_pool.forward(model, pool, [segment], tokens, rows)

        out[k] = _time(once, reps)
    return out


@contextlib.contextmanager
def draft_beside(model: torch.nn.Module, prompt: list[int]) -> Iterator[list[float]]:
    """A thread forwarding ``model`` one token at a time on one torch thread, as card's draft
    worker does, for as long as the block runs; yields the list of its forward times (s)."""
    times: list[float] = []
    stop = threading.Event()
    pool = prefilled(model, prompt, 1)
    n, token, row = len(prompt), torch.tensor(prompt[-1:]), torch.zeros(1, dtype=torch.int64)

    def loop() -> None:
        torch.set_num_threads(1)
        while not stop.is_set():
            t = time.perf_counter()
            kv_pool.forward(model, pool, [Segment(0, n, 1)], token, row)
            times.append(time.perf_counter() - t)

    worker = threading.Thread(target=loop, name="draft-beside", daemon=True)
    worker.start()
    try:
        yield times
    finally:
        stop.set()
        worker.join()


@click.command()
@click.option("--target-model", required=True)
@click.option("--draft-model", default=None)
@click.option("--draft-quantize", type=click.Choice(["none", "int8"]), default="none")
@click.option("--prepack/--no-prepack", default=True, show_default=True)
@click.option("--max-chain", default=6, show_default=True)
@click.option("--widths", default="1,2,4", show_default=True)
@click.option("--threads", default="1,2", show_default=True)
@click.option("--reps", default=5, show_default=True)
@click.option("--beside-draft", is_flag=True,
              help="also time the target's verifies on 1 thread while a thread forwards the draft on "
                   "the other (the contention in-process card lives with)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(target_model: str, draft_model: str | None, draft_quantize: str, prepack: bool, max_chain: int,
         widths: str,
         threads: str, reps: int, beside_draft: bool, out: Path | None) -> None:
    """Print target verify and draft layer costs (ms, min / median)."""
    thread_counts = [int(t) for t in threads.split(",")]
    target = load_model(ModelConfig(spec=target_model, prepack=prepack, exact=True))  # as served
    prompt = target.encode_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half "
                                  "as many clips in May. How many clips did Natalia sell altogether?")
    result: dict = {"target": {}, "draft": {}}
    for t in thread_counts:
        costs = verify_costs(target.model, prompt, range(max_chain + 1), t, reps)
        base = costs[0][0]
        result["target"][t] = costs
        for length, (lo, med) in costs.items():
            click.echo(f"target threads={t} chain={length}: {lo:8.1f} ms min {med:8.1f} ms median "
                       f"({lo / base:.2f}x one token)")
    if draft_model:
        draft = load_model(ModelConfig(spec=draft_model, quantize=draft_quantize, prepack=prepack))
        for t in thread_counts:
            costs = layer_costs(draft.model, prompt, tuple(int(k) for k in widths.split(",")), t, reps)
            result["draft"][t] = costs
            for k, (lo, med) in costs.items():
                click.echo(f"draft threads={t} K={k}: {lo:8.1f} ms min {med:8.1f} ms median")
        if beside_draft:
            with draft_beside(draft.model, prompt) as draft_times:
                costs = verify_costs(target.model, prompt, range(max_chain + 1), 1, reps)
            result["target_beside_draft"] = costs
            result["draft_beside_target_ms"] = statistics.median(draft_times) * 1e3
            for length, (lo, med) in costs.items():
                alone = result["target"].get(1, {}).get(length)
                vs = f" ({med / alone[1]:.2f}x alone)" if alone else ""
                click.echo(f"target threads=1 chain={length} beside the draft: {lo:8.1f} ms min "
                           f"{med:8.1f} ms median{vs}")
            click.echo(f"draft forward beside the target: {result['draft_beside_target_ms']:.1f} ms median")
    if out:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
