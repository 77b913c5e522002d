"""Redis out for a while under load, measured from outside (issue 35's target: "Redis stopped for
60 s under load: 0 failed requests, the cache stays ready, speculation goes on").

A real trio on loopback (card-cache, card-draft, card-target as subprocesses, started by
client/trio.py's LocalTrio; a tiny 2-layer model with the SmolLM2 tokenizer as target and draft,
so that a served session commits several tokens per target forward), a private redis-server this script
SIGSTOPs (``--mode stop``: Redis accepts connections and never answers) or SIGKILLs and starts
again empty on the same port after the outage (``--mode kill``), and ``--clients`` threads
streaming greedy generations the whole time. Reported per phase (before / during / after the
outage, by each request's end): requests and failures, tokens per target forward (accepted
length) and the share of requests a draft served; the cache's own health ("") and Redis's health
name, polled every 0.5 s; the draft's registrations and link losses; the records the cache kept.

    .venv/bin/python docs/measurements/redis-outage/measure.py --mode stop --outage-s 60 \\
        --out docs/measurements/redis-outage/stop-60s.json

Run from the repository root (it imports tests.tiny_models for the checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from card.client.remote import generate_remote
from card.client.trio import LocalTrio, free_port
from card.common.channels import health_status
from card.engine.shared.config import SamplingParams, StopParams
from tests.tiny_models import save_tiny_checkpoint

PROMPTS = ("Write a haiku about the sea.", "What is two plus two?", "Name three colours.",
           "Tell me a story about a cache.")
REDIS_HEALTH = "card.v1.CacheService.redis"  # card.cache_service.server.REDIS_HEALTH_NAME


def start_redis(port: int, log: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=log.open("ab"), stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            if client.ping():
                return proc
        except redis.ConnectionError:
            time.sleep(0.05)
        assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("card_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def phase_of(t: float, start: float, end: float) -> str:
    return "before" if t < start else "during" if t < end else "after"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("stop", "kill"), default="stop")
    ap.add_argument("--outage-s", type=float, default=60.0)
    ap.add_argument("--before-s", type=float, default=30.0)
    ap.add_argument("--after-s", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="redis-outage-"))
    target = save_tiny_checkpoint(root / "target", seed=0)
    port = free_port()
    redis_proc = start_redis(port, root / "redis.log")
    trio = LocalTrio(speculation="always", target_model=str(target), draft_model=str(target), draft_name="d",
                     target_threads=1, draft_threads=1, dtype="float32", log_dir=root / "logs",
                     redis_url=f"redis://127.0.0.1:{port}/0", metrics=True, start_timeout_s=300)
    results: list[dict] = []
    health: list[tuple[float, str, str]] = []  # (t, cache "", redis name) when either is not SERVING
    polls = 0
    stop = threading.Event()
    try:
        with trio:
            def client(n: int) -> None:
                i = n
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        r = generate_remote(trio.target_addr, PROMPTS[i % len(PROMPTS)],
                                            sampling=SamplingParams(), timeout_s=120,
                                            stop=StopParams(args.new_tokens, ignore_eos=True))
                        results.append({"t0": t0, "t1": time.monotonic(), "ok": True, "draft": r.draft,
                                        "new_tokens": r.stats.new_tokens, "forwards": r.stats.target_forwards,
                                        "hits": r.stats.hits})
                    except Exception as exc:  # every failure is counted: that is the measurement
                        results.append({"t0": t0, "t1": time.monotonic(), "ok": False,
                                        "error": repr(exc)[:300]})
                    i += args.clients

            def poller() -> None:
                nonlocal polls
                while not stop.wait(0.5):
                    states = []
                    for name in ("", REDIS_HEALTH):
                        try:
                            states.append(health_status(trio.cache_addr, name, timeout_s=2.0))
                        except Exception as exc:
                            states.append(type(exc).__name__)
                    polls += 1
                    if states != ["SERVING", "SERVING"]:
                        health.append((time.monotonic(), *states))

            threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(args.clients)]
            threads.append(threading.Thread(target=poller, daemon=True))
            for t in threads:
                t.start()
            t_begin = time.monotonic()
            time.sleep(args.before_s)
            metrics_before = {name: scrape(p) for name, p in trio.metrics_ports.items()}
            out_start = time.monotonic()
            if args.mode == "stop":
                os.kill(redis_proc.pid, signal.SIGSTOP)
            else:
                redis_proc.kill()
                redis_proc.wait(10)
            time.sleep(args.outage_s)
            if args.mode == "stop":
                os.kill(redis_proc.pid, signal.SIGCONT)
            else:
                redis_proc = start_redis(port, root / "redis.log")
            out_end = time.monotonic()
            time.sleep(args.after_s)
            stop.set()
            for t in threads:
                t.join(150)
            metrics_after = {name: scrape(p) for name, p in trio.metrics_ports.items()}
    finally:
        stop.set()
        if redis_proc.poll() is None:
            os.kill(redis_proc.pid, signal.SIGCONT)
            redis_proc.terminate()
            redis_proc.wait(10)

    phases = {}
    for phase in ("before", "during", "after"):
        rs = [r for r in results if phase_of(r["t1"], out_start, out_end) == phase]
        ok = [r for r in rs if r["ok"]]
        lengths = [r["new_tokens"] / r["forwards"] for r in ok if r["forwards"]]
        phases[phase] = {
            "requests": len(rs), "failed": len(rs) - len(ok),
            "accepted_length_mean": round(statistics.mean(lengths), 3) if lengths else None,
            "served_by_draft": sum(bool(r["draft"]) for r in ok),
            "tokens_per_s": round(sum(r["new_tokens"] for r in ok) / max(1e-9, (
                out_start - t_begin if phase == "before" else out_end - out_start if phase == "during"
                else max(r["t1"] for r in rs) - out_end if rs else 1.0)), 1),
        }
    cache_name = next(n for n in metrics_after if n.startswith("card-cache"))
    draft_name = next(n for n in metrics_after if n.startswith("card-draft"))

    def delta(proc: str, metric: str) -> float:
        return metrics_after[proc].get(metric, 0.0) - metrics_before[proc].get(metric, 0.0)

    summary = {
        "mode": args.mode, "outage_s": args.outage_s, "before_s": args.before_s, "after_s": args.after_s,
        "clients": args.clients, "new_tokens": args.new_tokens, "phases": phases,
        "failures": [r["error"] for r in results if not r["ok"]][:10],
        "health_polls": polls,
        "cache_not_serving_polls": sum(1 for _, own, _ in health if own != "SERVING"),
        "redis_not_serving_polls": sum(1 for _, _, rs in health if rs != "SERVING"),
        "redis_not_serving_s": round(max((t for t, _, rs in health if rs != "SERVING"), default=0)
                                     - min((t for t, _, rs in health if rs != "SERVING"), default=0), 1),
        "draft_registrations_during_and_after": delta(draft_name, "card_draft_registrations_total"),
        "draft_disconnects_during_and_after": delta(draft_name, "card_draft_disconnects_total"),
        "cache_records_written": delta(cache_name, "card_cache_records_written_total"),
        "cache_records_dropped": delta(cache_name, "card_cache_records_dropped_total"),
        "cache_records_pending_at_end": metrics_after[cache_name].get("card_cache_records_pending", 0.0),
        "machine": f"{os.cpu_count()} cores, {sys.platform}",
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
