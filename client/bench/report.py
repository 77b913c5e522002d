"""Benchmark results: exactness check against vanilla, per-mode summaries, table, JSON, chart."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from card.client.bench.modes import VANILLA, BenchMode

REFERENCE = VANILLA.name


@dataclass(frozen=True)
class Mismatch:
    """Where an output first differs from the reference (a token is None past the shorter end)."""

    position: int
    expected: int | None
    got: int | None

    def to_dict(self) -> dict:
        return {"position": self.position, "expected": self.expected, "got": self.got}


def first_mismatch(reference: Sequence[int], output: Sequence[int]) -> Mismatch | None:
    """None when the two token sequences are identical."""
    for i, (a, b) in enumerate(zip(reference, output, strict=False)):
        if a != b:
            return Mismatch(i, a, b)
    if len(reference) != len(output):
        n = min(len(reference), len(output))
        return Mismatch(n, reference[n] if n < len(reference) else None,
                        output[n] if n < len(output) else None)
    return None


def check_exactness(records: list[dict]) -> list[dict]:
    """Mark each record with ``matches_vanilla`` / ``mismatch``; returns the mismatching ones.

    Records are grouped by (dataset, prompt index); the vanilla record of a group is the reference.
    """
    refs = {(r["dataset"], r["prompt_index"]): r["token_ids"] for r in records if r["mode"] == REFERENCE}
    bad = []
    for r in records:
        ref = refs.get((r["dataset"], r["prompt_index"]))
        if ref is None:
            r["matches_vanilla"], r["mismatch"] = None, None
            continue
        m = first_mismatch(ref, r["token_ids"])
        r["matches_vanilla"] = m is None
        r["mismatch"] = m.to_dict() if m else None
        # verify loose and rejection differ by the request's choice: reported, not failed
        if m and r.get("token_exact", True):
            bad.append(r)
    return bad


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def summarize(records: list[dict]) -> list[dict]:
    """One row per (dataset, mode), in the order modes first appear."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["mode"]), []).append(r)
    rows = []
    for (dataset, label), rs in groups.items():
        mode = BenchMode.parse(label)
        tokens = sum(r["new_tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        forwards = sum(r["target_forwards"] for r in rs)
        # hits are the cache's verdicts; sd's drafter classifies too, but against a chain it
        # rebuilds after every correction, so its counts mean nothing and are not reported
        corrections = (sum(r["hits"] + r["secondary_hits"] + r["misses"] for r in rs)
                       if mode.speculates else 0)
        rtts = [x for r in rs for x in r["step_rtt_ms"]]
        rows.append({
            "dataset": dataset,
            "mode": label,
            "prompts": len(rs),
            "new_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "mean_accepted_length": tokens / forwards if forwards else None,
            "hit_rate": sum(r["hits"] for r in rs) / corrections if corrections else None,
            "secondary_hit_rate": sum(r["secondary_hits"] for r in rs) / corrections if corrections else None,
            "target_idle_fraction": sum(r["target_idle_s"] for r in rs) / wall if wall > 0 else None,
            "draft_idle_fraction": (sum(r["draft_idle_s"] for r in rs) / wall
                                    if wall > 0 and mode.speculates and not mode.services else None),
            "step_rtt_p50_ms": percentile(rtts, 50),
            "step_rtt_p99_ms": percentile(rtts, 99),
            # rejection keeps the target's distribution, not its seeded tokens: no token check
            "all_match_vanilla": (all(r["matches_vanilla"] for r in rs)
                                  if all(r["matches_vanilla"] is not None and r.get("verify") != "rejection"
                                         for r in rs) else None),
            "mismatches": sum(1 for r in rs if r["matches_vanilla"] is False),
            "lossy": any(r.get("lossy") for r in rs),
            "draft_acceptance_rate": (sum(r.get("accepted_draft_tokens", 0) for r in rs) / drafted
                                      if (drafted := sum(r.get("draft_tokens", 0) for r in rs)) else None),
            # answers scored against the dataset's references (GSM8K), where it has them
            "accuracy": (sum(1 for r in scored if r["correct"]) / len(scored)
                         if (scored := [r for r in rs if r.get("correct") is not None]) else None),
        })
    for row in rows:
        ref = next((x for x in rows if x["dataset"] == row["dataset"] and x["mode"] == REFERENCE), None)
        row["speedup_vs_vanilla"] = (row["tokens_per_s"] / ref["tokens_per_s"]
                                     if ref and ref["tokens_per_s"] else None)
        row["median_speedup_vs_vanilla"] = (row["median_tokens_per_s"] / ref["median_tokens_per_s"]
                                            if ref and ref["median_tokens_per_s"] else None)
    return rows


def _fmt(value: object, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


COLUMNS = (
    ("dataset", "dataset", "s"), ("mode", "mode", "s"), ("n", "prompts", "d"), ("tok", "new_tokens", "d"),
    ("tok/s", "tokens_per_s", ".2f"), ("med tok/s", "median_tokens_per_s", ".2f"),
    ("speedup", "speedup_vs_vanilla", ".2f"), ("acc len", "mean_accepted_length", ".2f"),
    ("hit", "hit_rate", ".0%"), ("2nd hit", "secondary_hit_rate", ".0%"),
    ("tgt idle", "target_idle_fraction", ".0%"), ("drf idle", "draft_idle_fraction", ".0%"),
    ("rtt p50 ms", "step_rtt_p50_ms", ".2f"), ("rtt p99 ms", "step_rtt_p99_ms", ".2f"),
    ("exact", "all_match_vanilla", ""), ("accuracy", "accuracy", ".1%"),
)


def table(rows: list[dict], columns: tuple[tuple[str, str, str], ...] = COLUMNS) -> str:
    """A text table: (header, key, format spec) per column; the first two columns left-aligned."""
    cells = [[head for head, _, _ in columns]]
    cells += [[_fmt(row[key], spec) for _, key, spec in columns] for row in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mismatch_lines(bad: list[dict]) -> list[str]:
    return [
        f"MISMATCH {r['dataset']} prompt {r['prompt_index']} mode {r['mode']}: first differing position "
        f"{r['mismatch']['position']}, vanilla token {r['mismatch']['expected']}, "
        f"{r['mode']} token {r['mismatch']['got']}"
        for r in bad
    ]


def machine_info(threads: dict[str, dict[str, int]]) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, object] = {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": threads,
    }
    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = list(os.getloadavg())
    return info


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))


CHART_EXTRA = "card-serving[bench]"


def chart_hint(chart: Path) -> str:
    """The one line said instead of drawing ``chart`` when matplotlib is not installed."""
    return (f"card-bench: no chart {chart}: matplotlib is not installed; "
            f"pip install '{CHART_EXTRA}' and re-run card-bench to draw it")


def is_missing_matplotlib(error: ModuleNotFoundError) -> bool:
    """The import that failed is matplotlib's own (not some other module, nor one matplotlib needs)."""
    return (error.name or "").partition(".")[0] == "matplotlib"


def try_chart(draw: Callable[..., None], path: Path, *args: object) -> str | None:
    """``draw(path, *args)`` (write_chart, load.write_chart); None once drawn, or the one-line
    chart_hint when matplotlib (the optional ``bench`` extra) is not installed. Any other error,
    a missing module other than matplotlib included, propagates."""
    try:
        draw(path, *args)
    except ModuleNotFoundError as e:
        if not is_missing_matplotlib(e):
            raise
        return chart_hint(path)
    return None


def write_chart(path: Path, rows: list[dict], records: list[dict], title: str) -> None:
    """Tokens/s per mode and dataset (bars), and accepted lengths of the speculative modes.

    Imports matplotlib here, lazily (it is the optional ``bench`` extra): ModuleNotFoundError
    without it; callers go through try_chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    spec_modes = [m for m in modes if BenchMode.parse(m).decoder in ("sd", "card", "card-auto")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        values = [next((r["tokens_per_s"] for r in rows if r["dataset"] == d and r["mode"] == mode), 0.0)
                  for d in datasets]
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(datasets))]
        bars = ax.bar(xs, values, width, label=mode)
        for bar, d in zip(bars, datasets, strict=True):
            row = next((r for r in rows if r["dataset"] == d and r["mode"] == mode), None)
            if row and row["speedup_vs_vanilla"]:
                ax.annotate(f"{row['speedup_vs_vanilla']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("tokens/s (sum tokens / sum time)")
    ax.set_title("throughput per mode (speedup over vanilla on top)")
    ax.legend(fontsize=8)
    ax = axes[1]
    longest = max((n for r in records if r["mode"] in spec_modes for n in r["accepted_lengths"][1:]),
                  default=1)
    bins = [x + 0.5 for x in range(0, longest + 1)]
    for mode in spec_modes:
        lengths = [n for r in records if r["mode"] == mode for n in r["accepted_lengths"][1:]]
        if lengths:
            ax.hist(lengths, bins=bins, alpha=0.55, label=f"{mode} (mean {statistics.mean(lengths):.2f})")
    ax.set_xlabel("tokens committed per target forward")
    ax.set_ylabel("target forwards")
    ax.set_title("accepted length")
    if spec_modes:
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
