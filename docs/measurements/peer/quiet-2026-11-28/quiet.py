"""A load generator that does not spin: the AIPerf recipe's prompts (../prompts.jsonl, 16 x 64
greedy tokens, chat, streamed), 1 and 8 in flight, through plain httpx threads that sleep in
their sockets. AIPerf's timing loop spins a core, which on this 2-core VM takes one of the two
cores a server's 2 OpenMP threads need (docs/performance.md, "Adaptive threads"); this client
leaves both cores to the server. Usage: quiet.py URL MODEL LABEL OUT [EXTRA_JSON]"""
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

url, model, label, out = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
here = Path(__file__).resolve().parent
prompts = [json.loads(line)["text"] for line in (here.parent / "prompts.jsonl").read_text().splitlines()]


def one(prompt: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    text = []
    with httpx.Client(timeout=600) as client, \
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            choices = msg["choices"]
            if choices and choices[0]["delta"].get("content"):
                now = time.perf_counter() - start
                first = first if first is not None else now
                last = now
                text.append(choices[0]["delta"]["content"])
    return {"ttft": first, "last": last, "tokens": tokens, "text": "".join(text)}


result = {"label": label, "levels": {}}
for level in (1, 8):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        runs = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    result["levels"][level] = {
        "output_tok_s": sum(r["tokens"] for r in runs) / wall,
        "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in runs),
        "itl_p50_ms": 1000 * statistics.median((r["last"] - r["ttft"]) / max(1, r["tokens"] - 1)
                                               for r in runs),
        "tokens": [r["tokens"] for r in runs],
        "texts": [r["text"] for r in runs]}
    level_view = {k: v for k, v in result["levels"][level].items() if k not in ("tokens", "texts")}
    print(label, level, {k: round(v, 1) for k, v in level_view.items()}, flush=True)
Path(out, f"quiet-{label}.json").write_text(json.dumps(result, indent=1) + "\n")
