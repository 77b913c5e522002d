"""GPU speed of the exact forward (``make gpu-check``, after the exactness tests in tests/gpu).

Random weights at the shapes of Qwen2.5-1.5B (target) and Qwen2.5-0.5B (draft) in bfloat16:
forward cost does not depend on the weights, and no weights can be downloaded where this runs.

    forward   one target forward of R decoding rows (R/8 sessions x 8-row chains, at most one
              session per 8 rows) against R, exact on and off: the cost of invariance per shape
    serving   plain decoding and card tokens/s with 1, 4, 8 and 32 requests in flight through the
              target engine (card: draft worker on the same GPU), exact on and off; every figure
              is also a ratio to plain decoding (the first of ``--kernels``) in the same run; card
              under each ``--speculation`` mode asked for
    roofline  each serving figure as a fraction of the device's memory-bandwidth limit: the
              target's weights read once per engine forward plus every live session's KV cache,
              over the measured time, over the bandwidth (``--bandwidth-gbs``, else a table of
              known devices, else a measured device-to-device copy; the JSON says which)
    peer      Hugging Face transformers' own ``generate`` on a plain copy of the same random
              target (SDPA attention, no card patches): greedy, static cache, ``torch.compile``
              (eager static cache, with the error recorded, where compiling fails); the same
              prompts at each in-flight count as one batch; compile seconds apart; every serving
              figure is also a ratio to it (``vs_peer``)

Random-weight drafts agree with the target at chance level, so card figures here measure what
speculation costs, not what a trained pair gains (accepted length is printed beside them). The
JSON goes to ``--out``; a table to stdout.

    python -m card.client.bench.gpu --out gpu-check.json
"""

from __future__ import annotations

import json
import math
import re
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
from card.engine.shared.static_step import STEP_MODES, DecodeRows, StaticStep
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
PROMPT_TOKENS = 128
# Peak memory bandwidth (bytes/s, the vendors' spec sheets) by torch.cuda.get_device_name(); first
# match wins. A100 80GB PCIe (1.935e12) and H100 NVL match none on purpose: they are measured.
BANDWIDTH = (
    (r"H200", "H200", 4.8e12),
    (r"H100.*PCIe", "H100 PCIe", 2.0e12),
    (r"H100.*(HBM3|SXM)", "H100 SXM", 3.35e12),
    (r"A100.*SXM.*80GB", "A100 80GB SXM", 2.04e12),
    (r"A100.*40GB", "A100 40GB", 1.555e12),
    (r"L40S", "L40S", 8.64e11),
    (r"\bL4\b", "L4", 3.0e11),
    (r"\bA10\b", "A10", 6.0e11),
    (r"RTX 4090", "RTX 4090", 1.008e12),
)


def plain_qwen(shape: dict, seed: int, device: str) -> CausalLM:
    """A Qwen2 of ``shape`` with random bf16 weights (the same weights for the same seed), SDPA
    attention, nothing of card's applied."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device(device):
        model: CausalLM = Qwen2ForCausalLM(config)
        model = model.to(torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")  # the default today; said, so the peer's attention is known
    return model


def random_qwen(shape: dict, seed: int, device: str, exact: bool) -> CausalLM:
    model = plain_qwen(shape, seed, device)
    make_exact(model, exact=exact)
    return model


def read_bytes(shape: dict) -> dict:
    """Bytes one forward of the target at ``shape`` reads at least: its weights (every parameter once:
    a tied embedding is the LM head, read whole once; an untied input embedding is left out, a step
    reads only its tokens' rows of it) and, per token of a session's history, its KV cache. Taken on
    the meta device: make_exact repacks the linears, so the engine's model no longer shows them."""
    model = plain_qwen(shape, 0, "meta")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied tensor comes once
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed is not head:
        weights -= embed.numel() * embed.element_size()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * head.element_size()  # K and V
    return {"weight_bytes": weights, "kv_bytes_per_token": kv}


def copy_bandwidth(device: str, size: int, repeats: int = 5) -> float:
    """Bytes/s of a copy of ``size`` bytes within ``device`` (each byte read once and written once),
    best of ``repeats``; timed with CUDA events on a GPU."""
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages, kernel selection
    best = math.inf
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * size / best


def bandwidth(device: str, name: str, override_gbs: float | None) -> dict:
    """The device's memory bandwidth and where the figure comes from."""
    if override_gbs is not None:
        return {"bytes_per_s": override_gbs * 1e9, "source": "--bandwidth-gbs"}
    if device.startswith("cuda"):
        for pattern, label, peak in BANDWIDTH:
            if re.search(pattern, name, re.IGNORECASE):
                return {"bytes_per_s": peak, "source": f"table: {label} spec sheet"}
    size = 1 << 30 if device.startswith("cuda") else 64 << 20
    return {"bytes_per_s": copy_bandwidth(device, size),
            "source": f"measured: copy of {size >> 20} MiB within {device}, best of 5"}


def roofline(forwards: int, session_forwards: list[int], session_new: list[int], seconds: float,
             sizes: dict, peak: float) -> dict:
    """The share of ``peak`` bytes/s a run reached if each forward read the weights once and each
    session's part of it read that session's KV cache, its history taken at its mean over the run
    (the prompt and half the new tokens)."""
    kv_tokens = sum(f * (PROMPT_TOKENS + n / 2) for f, n in zip(session_forwards, session_new, strict=True))
    read = forwards * sizes["weight_bytes"] + kv_tokens * sizes["kv_bytes_per_token"]
    return {"roofline": read / seconds / peak, "bytes_per_step": read / forwards,
            "step_ms": seconds / forwards * 1e3}


class _Ids:
    """The tokenizer of a random model: text is the token ids themselves."""

    def decode(self, token_ids: list[int], **_: object) -> str:
        return " ".join(map(str, token_ids))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_ms(model: CausalLM, rows: int, exact: bool, context: int, device: str,
               repeats: int = 20, decode_step: str = "eager") -> float:
    """Median ms of one forward of ``rows`` decoding rows at ``context`` tokens of history: the
    eager forward, or the target's static step in ``decode_step`` mode (its first runs compile or
    capture the shape, outside the timing)."""
    sessions = max(1, rows // 8)
    per = rows // sessions
    pool = KVPool(model, slots=sessions, max_len=context + per + 1)
    segments = [Segment(s, context, per, exact=exact) for s in range(sessions)]
    tokens = torch.randint(0, model.config.vocab_size, (sessions * per,))
    logit_rows = torch.arange(sessions * per)
    step = None if decode_step == "eager" else StaticStep(model, pool, rows, decode_step)
    chains = [DecodeRows(s, context, tokens[s * per:(s + 1) * per].tolist()) for s in range(sessions)]
    times = []
    for i in range(repeats + 3):
        _sync(device)
        t0 = time.perf_counter()
        if step is None:
            forward(model, pool, segments, tokens, logit_rows)
        else:
            step.run(chains).picks.tolist()  # the one read a serving step makes
        _sync(device)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _resolved(step: str, device: str) -> str:
    """What ``--decode-step`` ``step`` runs on ``device`` (auto: graphs on CUDA, eager elsewhere)."""
    if step != "auto":
        return step
    return "graphs" if device.startswith("cuda") else "eager"


def _requests(n: int, vocab: int, new_tokens: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(7)
    stop = StopParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [tuple(torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()) for _ in range(n)]
    return [GenerationRequest(p, SamplingParams(), stop) for p in prompts]


def serve_tok_s(target: CausalLM, draft: CausalLM | None, in_flight: int, exact: bool,
                new_tokens: int, device: str, speculation: str | DraftingPolicy = "auto",
                decode_step: str = "eager") -> dict:
    """Tokens/s of ``in_flight`` requests run together to their end (card when ``draft``), the
    engine's drafting policy in ``speculation`` mode (or that policy: a serving engine keeps one
    for its life, and what it measured before); the target's decoding rows by ``decode_step``
    (card.engine.shared.static_step)."""
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
        pool = KVPool(target, slots=in_flight, max_len=PROMPT_TOKENS + new_tokens + 16)
        engine = TargetEngine(target, pool, exact=exact, policy=policy, decode_step=decode_step)
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
            "speculation": policy.config.speculation, "paused_share": paused / forwards if forwards else 0.0,
            "session_forwards": [g.stats.target_forwards for g in gens],
            "session_new_tokens": [g.stats.new_tokens for g in gens],
            "decode_step": engine.static.mode if engine.static is not None else "eager"}


def peer_tok_s(model: CausalLM, in_flight: int, new_tokens: int, device: str, compiled: bool) -> dict:
    """Tokens/s of transformers' ``generate`` on ``in_flight`` prompts (those of the serving runs) as one
    batch: greedy, static cache, the decode forward compiled by generate itself (``compile_config``:
    torch.compile, reduce-overhead, fullgraph) or eager. A first call of the same shapes compiles (and
    captures the CUDA graphs) before the timed one."""
    from transformers import CompileConfig

    prompts = [list(r.prompt_ids) for r in _requests(in_flight, model.config.vocab_size, new_tokens)]
    ids = torch.tensor(prompts, device=device)
    kwargs: dict = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                        cache_implementation="static", pad_token_id=0, eos_token_id=None)
    if compiled:
        config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        # generate compiles on its own only on accelerators; this flag (there for tests) lets the CPU
        # smoke run take the same path
        if not device.startswith("cuda"):
            config._compile_all_devices = True  # type: ignore[assignment]  # typed None, read as a flag
        kwargs["compile_config"] = config
    else:
        kwargs["disable_compile"] = True
    seconds = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    if out.shape != (in_flight, PROMPT_TOKENS + new_tokens):
        raise RuntimeError(f"transformers generated {tuple(out.shape)}, not {in_flight} x {new_tokens} new")
    warmup, wall = seconds
    return {"tok_s": in_flight * new_tokens / wall, "wall_s": wall, "new_tokens": in_flight * new_tokens,
            "warmup_s": warmup, "compile_s": max(0.0, warmup - wall), "compiled": compiled,
            "forwards": new_tokens}


def run_peer(shape: dict, loads: tuple[int, ...], new_tokens: int, device: str, compiled: bool) -> dict:
    """The peer at every in-flight count that fits in memory, on a fresh plain model (the target's
    seed, so the target's weights). A compile failure is recorded and the rest runs eager."""
    import transformers

    model = plain_qwen(shape, 0, device)
    how = "static cache, torch.compile(mode='reduce-overhead', fullgraph=True)"
    peer: dict = {"what": f"transformers {transformers.__version__} generate, greedy, "
                          + (how if compiled else "static cache, eager"),
                  "attention": model.config._attn_implementation, "compile_error": None, "batches": {}}
    for n in loads:
        try:
            try:
                row = peer_tok_s(model, n, new_tokens, device, compiled)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as exc:  # whatever torch.compile raises on this device: run eager, say why
                if not compiled:
                    raise
                peer["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                peer["what"] = (f"transformers {transformers.__version__} generate, greedy, static cache, "
                                f"eager (torch.compile failed at {n} in flight)")
                compiled = False
                torch._dynamo.reset()
                row = peer_tok_s(model, n, new_tokens, device, compiled)
        except torch.cuda.OutOfMemoryError:
            row = {"skipped": "out of memory"}
            torch.cuda.empty_cache()
        peer["batches"][n] = row
    del model
    return peer


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
@click.option("--decode-steps", default="eager,auto", show_default=True,
              help="comma-separated target decoding steps to serve with (card.engine.shared.static_step: "
                   "eager, static, compiled, graphs, auto). The first keeps the historical keys "
                   "(exact/vanilla/8); the others are keyed kernel+step (exact+auto/vanilla/8)")
@click.option("--bandwidth-gbs", type=float, default=None,
              help="the device's memory bandwidth in GB/s for the roofline (default: a table of known "
                   "GPUs, else measured with a copy)")
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="run transformers' generate (static cache) on the same target beside ours")
@click.option("--peer-compile/--peer-eager", default=True, show_default=True,
              help="torch.compile the peer's decode forward (as transformers recommends) or not")
def main(device: str, new_tokens: int, context: int, out: Path, small: bool, kernels: str, in_flight: str,
         speculation: str, rounds: int, decode_steps: str, bandwidth_gbs: float | None, peer: bool,
         peer_compile: bool) -> None:
    """Forward cost against rows, and serving tokens/s, exact on and off, beside transformers."""
    loads = tuple(int(n) for n in in_flight.split(","))
    modes = tuple(speculation.split(","))
    steps = tuple(decode_steps.split(","))
    for step in steps:
        if step not in STEP_MODES:
            raise click.BadParameter(f"decode steps are {', '.join(STEP_MODES)}, not {step!r}")
    for mode in modes:
        DraftingConfig(speculation=mode)  # validates
    tshape, dshape = (TARGET, DRAFT) if not small else (
        dict(TARGET, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=2048),
        dict(DRAFT, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
             vocab_size=2048))
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    sizes = read_bytes(tshape)
    limit = bandwidth(device, gpu, bandwidth_gbs)
    report: dict = {"device": gpu, "torch": torch.__version__, "target_shape": tshape,
                    "draft_shape": dshape, "forward_ms": {}, "serving": {},
                    "bandwidth": limit, "read_bytes": dict(sizes, prompt_tokens=PROMPT_TOKENS)}
    draft = random_qwen(dshape, 1, device, exact=False)
    for key in kernels.split(","):
        if key not in ("exact", "vendor"):
            raise click.BadParameter(f"kernels are exact or vendor, not {key!r}")
        exact = key == "exact"
        target = random_qwen(tshape, 0, device, exact=exact)
        report["forward_ms"][key] = {r: forward_ms(target, r, exact, context, device) for r in ROWS}
        for step in steps[1:]:  # the static step's cost against rows, beside the eager forward's
            resolved = _resolved(step, device)
            if resolved != "eager":
                report["forward_ms"][f"{key}+{step}"] = {
                    r: forward_ms(target, r, exact, context, device, decode_step=resolved) for r in ROWS}
        for i, step in enumerate(steps):
            at = key if i == 0 else f"{key}+{step}"
            for warm in (None, draft):  # first calls pay for kernel selection and allocator growth
                serve_tok_s(target, warm, 2, exact, 4, device, decode_step=step)
            for n in loads:
                report["serving"][f"{at}/vanilla/{n}"] = serve_tok_s(
                    target, None, n, exact, new_tokens, device, decode_step=step)
                for mode in modes:
                    policy = DraftingPolicy(DraftingConfig(speculation=mode))
                    base_name = "card" if len(modes) == 1 else f"card-{mode}"
                    for r in range(rounds):
                        name = base_name + (f"-r{r + 1}" if rounds > 1 else "")
                        report["serving"][f"{at}/{name}/{n}"] = serve_tok_s(
                            target, draft, n, exact, new_tokens, device, policy, decode_step=step)
        del target
    del draft
    peer_rows: dict = {}  # in flight -> the peer's figures, where it ran
    if peer:
        report["peer"] = run_peer(tshape, loads, new_tokens, device, peer_compile)
        peer_rows = {n: row for n, row in report["peer"]["batches"].items() if "tok_s" in row}
    for n, row in peer_rows.items():
        row.update(roofline(row["forwards"], [row["forwards"]] * n, [new_tokens] * n, row["wall_s"], sizes,
                            limit["bytes_per_s"]))
        row["ours_vs_peer"] = {k: report["serving"][f"{k}/vanilla/{n}"]["tok_s"] / row["tok_s"]
                               for k in kernels.split(",")}  # plain decoding with each kernel set
    first = kernels.split(",")[0]
    base = {n: report["serving"][f"{first}/vanilla/{n}"]["tok_s"] for n in loads}
    for key, row in report["serving"].items():
        n = int(key.rsplit("/", 1)[1])
        row["vs_vanilla"] = row["tok_s"] / base[n]
        kernel_step = key.split("/", 1)[0]  # exact vs vendor on the same step: what invariance costs
        if kernel_step.startswith("exact") and "vendor" in kernels.split(","):
            vendor = report["serving"].get(key.replace("exact", "vendor", 1))
            row["vs_vendor"] = row["tok_s"] / vendor["tok_s"] if vendor else None
        row["vs_peer"] = row["tok_s"] / peer_rows[n]["tok_s"] if n in peer_rows else None
        row.update(roofline(row["engine_forwards"], row["session_forwards"], row["session_new_tokens"],
                            row["wall_s"], sizes, limit["bytes_per_s"]))
    out.write_text(json.dumps(report, indent=2))
    print_table(report, out)


def print_table(report: dict, out: Path) -> None:
    """The report as text, the device on every line that carries a figure."""
    at = f"[{report['device']}]"
    limit = report["bandwidth"]
    click.echo(f"device: {report['device']}")
    click.echo(f"bandwidth {limit['bytes_per_s'] / 1e9:.0f} GB/s ({limit['source']}); target reads "
               f"{report['read_bytes']['weight_bytes'] / 1e9:.3f} GB of weights a forward, "
               f"{report['read_bytes']['kv_bytes_per_token']} B of KV a token of history  {at}")
    click.echo("rows  " + "  ".join(f"{r:>7}" for r in ROWS))
    for key, times in report["forward_ms"].items():
        click.echo(f"{key:<6}" + "  ".join(f"{times[r]:7.2f}" for r in ROWS) + f"  ms  {at}")
    for key, row in report["serving"].items():
        vs_peer = f"x{row['vs_peer']:.2f} peer" if row["vs_peer"] is not None else "-"
        vs_vendor = f"x{row['vs_vendor']:.2f} vendor  " if row.get("vs_vendor") is not None else ""
        click.echo(f"{key:<28} {row['tok_s']:9.1f} tok/s  x{row['vs_vanilla']:.2f}  {vs_peer:<11} "
                   f"{vs_vendor}roofline {row['roofline']:6.1%}  acc {row['accepted_length']:.2f}  "
                   f"paused {row['paused_share']:.0%}  step {row['decode_step']}  {at}")
    if "peer" in report:
        peer = report["peer"]
        click.echo(f"peer: {peer['what']}, {peer['attention']} attention")
        if peer["compile_error"]:
            click.echo(f"peer: torch.compile failed: {peer['compile_error'].splitlines()[0][:200]}")
        for n, row in peer["batches"].items():
            name = f"peer/{n}"
            if "tok_s" not in row:
                click.echo(f"{name:<24} skipped: {row['skipped']}  {at}")
                continue
            ours = "  ".join(f"{k}/vanilla x{r:.2f}" for k, r in row["ours_vs_peer"].items())
            click.echo(f"{name:<24} {row['tok_s']:9.1f} tok/s  roofline {row['roofline']:6.1%}  "
                       f"compile {row['compile_s']:.1f} s  ours: {ours}  {at}")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
