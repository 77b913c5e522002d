"""A prompt near the model's whole context beside four short streams, through card-target's OpenAI
API (default model SmolLM2-135M, default flags but the ports and ``--threads``; plain decoding, no
cache service). Each round runs the four short streams alone, then the same four with a
LONG-token prompt submitted once their first tokens arrived (so it prefills, in PREFILL_CHUNK-token
chunks, while they decode); which case goes first alternates by round. Inter-token latency (ITL)
is measured at the client between consecutive streamed tokens (``ignore_eos``, one token per
chunk); the long request's TTFT from its submission. Every round's long prompt starts with its own
words, so the prefix cache holds none of it. Output in long-context-cpu.txt.

    .venv/bin/python docs/measurements/long-context/long_context_http.py [rounds] [threads] [extra flags...]
"""

from __future__ import annotations

import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from card.client.trio import console_script

READY = re.compile(r"^card-target: OpenAI API on (\S+) \(model (\S+)\)$", re.MULTILINE)
KV_LINE = re.compile(r"KV cache: .*$", re.MULTILINE)
LONG = 7500  # prompt tokens of the long request (SmolLM2's window: 8192)
SHORT_NEW = 64  # tokens each short stream generates
SHORTS = ["The history of the printing press", "A recipe for bread:", "def fibonacci(n):",
          "Photosynthesis is the process"]


def serve(threads: int, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    cmd = [console_script("card-target"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
           "--threads", str(threads), *extra]
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(log.read_text()[-3000:])
        time.sleep(0.2)
    raise SystemExit("card-target did not start")


def long_prompt(client: httpx.Client, model: str, round_: int) -> tuple[str, int]:
    """LONG tokens of the project's docs, cut by the server's tokenizer, opened by words of this
    round's own (no cached prefix)."""
    docs = Path(__file__).resolve().parents[2]
    text = f"Round {round_} notes, read them all. " + "\n\n".join(
        p.read_text() for p in sorted(docs.glob("*.md")))
    ids = client.post("/tokenize", json={"model": model, "prompt": text}).json()["tokens"][:LONG]
    prompt = client.post("/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]
    n = len(client.post("/tokenize", json={"model": model, "prompt": prompt}).json()["tokens"])
    return prompt, n


def stream(client: httpx.Client, model: str, prompt: str, new: int, times: list[float],
           started: threading.Event | None = None) -> None:
    """One streamed completion: the arrival time of each token (``times``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            empty = '"text":""' in line.replace(" ", "")
            if line.startswith("data: ") and line != "data: [DONE]" and not empty:
                times.append(time.perf_counter())
                if started is not None:
                    started.set()


def one_case(client: httpx.Client, model: str, long: str | None) -> tuple[list[float], float | None]:
    """The four short streams, with ``long`` submitted beside them once each has its first token:
    their ITLs, and the long request's TTFT."""
    times: list[list[float]] = [[] for _ in SHORTS]
    firsts = [threading.Event() for _ in SHORTS]
    threads = [threading.Thread(target=stream, args=(client, model, p, SHORT_NEW, t, e))
               for p, t, e in zip(SHORTS, times, firsts, strict=True)]
    for t in threads:
        t.start()
    ttft = None
    long_times: list[float] = []
    if long is not None:
        for e in firsts:
            e.wait(600)
        t0 = time.perf_counter()
        stream(client, model, long, 4, long_times)
        ttft = long_times[0] - t0
    for t in threads:
        t.join()
    itl = [b - a for ts in times for a, b in itertools.pairwise(ts)]
    if long is not None:  # only the gaps while the long prompt was in flight
        end = long_times[0]
        itl = [b - a for ts in times for a, b in itertools.pairwise(ts) if a >= t0 and b <= end]
    return itl, ttft


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    extra = sys.argv[3:]
    alone: list[float] = []
    beside: list[float] = []
    ttfts: list[float] = []
    ttfts_alone: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "target.log"
        proc, url = serve(threads, extra, log)
        try:
            root = url.removesuffix("/v1")
            with httpx.Client(base_url=root, timeout=900) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                print(KV_LINE.search(log.read_text()).group(0))
                stream(client, model, "warm up", 8, [])
                for r in range(rounds):
                    prompt, n = long_prompt(client, model, r)
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for with_long in order:
                        itl, ttft = one_case(client, model, prompt if with_long else None)
                        (beside if with_long else alone).extend(itl)
                        case = f"beside a {n}-token prompt" if with_long else "alone"
                        line = (f"round {r + 1} {case}: {len(itl)} gaps, ITL p50 {pct(itl, .5) * 1e3:.1f} ms "
                                f"p90 {pct(itl, .9) * 1e3:.1f} ms mean {statistics.mean(itl) * 1e3:.1f} ms")
                        if ttft is not None:
                            ttfts.append(ttft)
                            line += f"; long TTFT {ttft:.2f} s"
                        print(line, flush=True)
                    t0, times = time.perf_counter(), []
                    stream(client, model, prompt.replace("notes", "notes again", 1), 4, times)
                    ttfts_alone.append(times[0] - t0)
                    print(f"round {r + 1} the long prompt alone: TTFT {ttfts_alone[-1]:.2f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"card-target {' '.join(extra) or '(default flags)'}, --threads {threads}, 4 streams x {SHORT_NEW} "
          f"tokens, greedy, ignore_eos")
    for name, xs in (("alone", alone), ("beside", beside)):
        print(f"{name:7s} ITL p50 {pct(xs, .5) * 1e3:.1f} ms  p90 {pct(xs, .9) * 1e3:.1f} ms  "
              f"mean {statistics.mean(xs) * 1e3:.1f} ms  max {max(xs) * 1e3:.1f} ms  ({len(xs)} gaps)")
    print(f"beside / alone: p50 {pct(beside, .5) / pct(alone, .5):.2f}x  "
          f"p90 {pct(beside, .9) / pct(alone, .9):.2f}x  "
          f"mean {statistics.mean(beside) / statistics.mean(alone):.2f}x")
    print(f"long request TTFT median {statistics.median(ttfts):.2f} s beside the streams, "
          f"{statistics.median(ttfts_alone):.2f} s alone, over {len(ttfts)} rounds")


if __name__ == "__main__":
    main()
