"""More conversations than the server runs at once, each in two chat turns, as many users of one
server make them: every conversation's first turn (8 in flight), then every second turn
(MT-Bench's second question after the server's own answer, 8 in flight; the packaged MT-Bench, in
order). Between a conversation's two turns the server serves all the others' first turns, so a
prefix cache that keeps only as many finished sequences as it runs at once has lost most earlier
turns by then. Per turn: TTFT p50 / p90 and the share of prompt tokens the server says it reused
(usage.prompt_tokens_details.cached_tokens).
Usage: many_turns.py URL MODEL LABEL OUT [CONVERSATIONS]"""
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

url, model, label, out = sys.argv[1:5]
n = int(sys.argv[5]) if len(sys.argv) > 5 else 32
QUESTIONS = Path(__file__).resolve().parents[4] / "client/bench/datasets/mt_bench/question.jsonl"
turns = [json.loads(line)["turns"] for line in QUESTIONS.read_text().splitlines()[:n]]
convs = [[{"role": "user", "content": t[0]}, None, {"role": "user", "content": t[1]}] for t in turns]
IN_FLIGHT = 8


def stream(messages: list[dict]) -> tuple[float, str, int, int]:
    """TTFT (s), the answer, prompt tokens and cached prompt tokens."""
    body = {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict = {}
    with httpx.Client() as client, client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                 timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk["choices"]
            if choices and choices[0]["delta"].get("content"):
                first = first or time.perf_counter() - start
                text.append(choices[0]["delta"]["content"])
    details = usage.get("prompt_tokens_details") or {}
    assert first is not None
    return first, "".join(text), usage["prompt_tokens"], details.get("cached_tokens") or 0


def summary(results: list[tuple[float, str, int, int]]) -> dict:
    ttft = sorted(r[0] for r in results)
    return {"ttft_p50_ms": round(1000 * statistics.median(ttft)),
            "ttft_p90_ms": round(1000 * ttft[int(0.9 * (len(ttft) - 1))]),
            "prompt_tokens": sum(r[2] for r in results), "cached_tokens": sum(r[3] for r in results),
            "cached_share": round(sum(r[3] for r in results) / sum(r[2] for r in results), 3)}


with ThreadPoolExecutor(IN_FLIGHT) as pool:
    stream([convs[0][0]])  # warm-up (and the chat template's system prompt cached, as a server would)
    t0 = time.perf_counter()
    ones = list(pool.map(lambda c: stream([c[0]]), convs))
    twos = list(pool.map(lambda ca: stream([ca[0][0], {"role": "assistant", "content": ca[1][1]}, ca[0][2]]),
                         zip(convs, ones, strict=True)))
    wall = time.perf_counter() - t0
result = {"label": label, "conversations": n, "in_flight": IN_FLIGHT, "wall_s": round(wall, 1),
          "turn1": summary(ones), "turn2": summary(twos)}
print(json.dumps(result), flush=True)
Path(f"{out}/many-turns-{label}.json").write_text(json.dumps(result, indent=2) + "\n")
