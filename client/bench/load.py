"""Closed-loop load through a running card-target: ``card-bench --services --concurrency 1,4,8``.

N clients, each sending every prompt back to back (client i starts at prompt i, so the clients do
not ask for the same prompt at the same moment), streaming each answer. Per mode and concurrency:
aggregate tokens/s (every token over the whole load's wall time), per-request tokens/s, time to
first token and inter-token latency (p50/p99, the gaps between streamed commits per token), and
exactness: every output must equal the same prompt's output at concurrency 1 in svc-vanilla.
Levels run in increasing order; at each level the modes take turns.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from card.client.bench import report
from card.client.bench.modes import SERVICE_POOLS, SVC_VANILLA, BenchMode, service_request
from card.client.bench.report import percentile
from card.common.channels import channel
from card.common.convert import stats_from_msg
from card.common.tensors import ids_from_msg, ids_to_msg
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.config import DrafterKind
from card.engine.shared.stats import GenerationStats
from card.v1 import target_pb2, target_pb2_grpc

# text (with the target's chat template), a conversation's role/content messages, or token ids
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
REFERENCE = SVC_VANILLA


def one_request(addr: str, prompt: Prompt, mode: str,
                max_new_tokens: int, ignore_eos: bool, timeout_s: float = 600.0, tls: TlsConfig = PLAINTEXT,
                api_key: str | None = None, draft: str | None = None) -> dict:
    """Stream one generation of ``prompt`` (text, with the target's chat template; a conversation,
    role/content messages, ditto; or token ids): the target's stats, its tokens and timings
    (seconds from the call, measured here). ``api_key``: the target's, where it has one;
    ``draft``: the pool to speculate with (None: the target's routing)."""
    request = target_pb2.GenerateRequest(mode=mode, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                         draft=draft or "")
    if isinstance(prompt, str):
        request.prompt = prompt
    elif all(isinstance(t, int) for t in prompt):
        request.prompt_ids.CopyFrom(ids_to_msg([t for t in prompt if isinstance(t, int)]))
    else:
        request.messages.messages.extend(target_pb2.ChatMessage(role=m["role"], content=m["content"])
                                         for m in prompt if isinstance(m, Mapping))
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    tokens: list[int] = []
    stats = GenerationStats()
    with channel(addr, api_key, tls) as ch:
        for msg in target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=timeout_s):
            if msg.WhichOneof("kind") == "chunk":
                if msg.chunk.token_ids:
                    stamps.append((time.perf_counter() - t0, len(msg.chunk.token_ids)))
            else:
                tokens = ids_from_msg(msg.final.token_ids)
                stats = stats_from_msg(msg.final.stats)
    wall = time.perf_counter() - t0
    gaps = [(b - a) / n for (a, _), (b, n) in itertools.pairwise(stamps)]
    return {**stats.to_dict(), "token_ids": tokens, "wall_s": wall, "new_tokens": len(tokens),
            "ttft_s": stamps[0][0] if stamps else wall, "itl_s": gaps}


def closed_loop(prompts: int, clients: int, one: Callable[[int, int], dict],
                ramp_s: float = 0.0) -> tuple[list[dict], float]:
    """``clients`` threads, client c sending every prompt index from c on (``one(c, i)``, a record),
    starting ``c * ramp_s`` after the first (so that equal requests do not arrive, and end, in
    waves); the records and the load's wall time. The first error ends its client and is raised."""
    records: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        time.sleep(c * ramp_s)
        for k in range(prompts):
            i = (c + k) % prompts
            try:
                rec = one(c, i)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records, time.perf_counter() - t0


def run_level(addr: str, mode: BenchMode, prompts: Sequence[Prompt], concurrency: int,
              max_new_tokens: int, ignore_eos: bool, ramp_s: float = 0.0,
              tls: TlsConfig = PLAINTEXT, api_key: str | None = None,
              pools: Mapping[DrafterKind, str] = SERVICE_POOLS) -> tuple[list[dict], float]:
    """Every one of ``concurrency`` clients sends every prompt (``closed_loop``); records and the
    load's wall time."""
    remote_mode, draft = service_request(mode, pools)

    def one(c: int, i: int) -> dict:
        rec = one_request(addr, prompts[i], remote_mode, max_new_tokens, ignore_eos, tls=tls,
                          api_key=api_key, draft=draft)
        rec.update(mode=mode.name, concurrency=concurrency, client=c, prompt_index=i)
        return rec

    return closed_loop(len(prompts), concurrency, one, ramp_s)


def run_load(addr: str, modes: Sequence[BenchMode], prompts: Sequence[Prompt],
             levels: Sequence[int], max_new_tokens: int, ignore_eos: bool, log=print,
             tls: TlsConfig = PLAINTEXT, api_key: str | None = None,
             pools: Mapping[DrafterKind, str] = SERVICE_POOLS) -> tuple[list[dict], list[dict]]:
    records: list[dict] = []
    walls: dict[tuple[str, int], float] = {}
    alone: dict[BenchMode, float] = {}
    for level in sorted(levels):
        for mode in modes:
            # clients start spread over one request's time alone (measured at the lowest level)
            ramp = alone.get(mode, 0.0) / level
            recs, wall = run_level(addr, mode, prompts, level, max_new_tokens, ignore_eos, ramp, tls,
                                   api_key, pools)
            alone.setdefault(mode, statistics.median(r["wall_s"] for r in recs))
            records += recs
            walls[(mode.name, level)] = wall
            log(f"load: {mode} x{level}: {sum(r['new_tokens'] for r in recs) / wall:.2f} tok/s")
    reference = {r["prompt_index"]: r["token_ids"] for r in records
                 if r["mode"] == REFERENCE.name and r["concurrency"] == min(levels)}
    for r in records:
        want = reference.get(r["prompt_index"])
        r["matches_reference"] = None if want is None else r["token_ids"] == want
    return records, summarize(records, walls)


def summarize(records: list[dict], walls: dict[tuple[str, int], float]) -> list[dict]:
    rows = []
    for (mode, level), wall in walls.items():
        rs = [r for r in records if r["mode"] == mode and r["concurrency"] == level]
        tokens = sum(r["new_tokens"] for r in rs)
        ttft = [r["ttft_s"] * 1e3 for r in rs]
        itl = [g * 1e3 for r in rs for g in r["itl_s"]]
        forwards = sum(r["target_forwards"] for r in rs)
        corrections = sum(r["hits"] + r["secondary_hits"] + r["misses"] for r in rs)
        rows.append({
            "mode": mode, "concurrency": level, "requests": len(rs), "new_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "request_tokens_per_s_p50": statistics.median(r["new_tokens"] / r["wall_s"] for r in rs),
            "mean_accepted_length": tokens / forwards if forwards else None,
            "hit_rate": sum(r["hits"] for r in rs) / corrections if corrections else None,
            # decoding steps whose drafting the speculation controller had paused
            "paused_share": (sum(r["drafting_paused_steps"] for r in rs) / steps
                             if (steps := sum(max(r["target_forwards"] - 1, 0) for r in rs)) else None),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "exact": all(r["matches_reference"] is not False for r in rs),
        })
    lowest = min((r["concurrency"] for r in rows), default=1)
    for row in rows:
        one = next((x for x in rows if x["mode"] == row["mode"] and x["concurrency"] == lowest), None)
        same_load = next((x for x in rows
                          if x["mode"] == REFERENCE.name and x["concurrency"] == row["concurrency"]), None)
        row["x_vs_one_at_a_time"] = row["tokens_per_s"] / one["tokens_per_s"] if one else None
        row["x_vs_vanilla_same_load"] = (row["tokens_per_s"] / same_load["tokens_per_s"]
                                         if same_load else None)
    return rows


_COLUMNS = (("mode", "mode", "s"), ("conc", "concurrency", "d"), ("reqs", "requests", "d"),
            ("tok/s", "tokens_per_s", ".2f"), ("x vs 1", "x_vs_one_at_a_time", ".2f"),
            ("x vs vanilla", "x_vs_vanilla_same_load", ".2f"),
            ("req tok/s", "request_tokens_per_s_p50", ".2f"), ("acc len", "mean_accepted_length", ".2f"),
            ("hit", "hit_rate", ".0%"), ("paused", "paused_share", ".0%"),
            ("ttft p50", "ttft_p50_ms", ".0f"), ("ttft p99", "ttft_p99_ms", ".0f"),
            ("itl p50", "itl_p50_ms", ".1f"), ("itl p99", "itl_p99_ms", ".1f"), ("exact", "exact", "s"))


def table(rows: list[dict]) -> str:
    return report.table(rows, _COLUMNS) + "\n(ms columns: time to first token and inter-token latency)"


def write_chart(path: Path, rows: list[dict], title: str) -> None:
    """Aggregate tokens/s against concurrency, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xlabel("requests in flight (closed loop)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
