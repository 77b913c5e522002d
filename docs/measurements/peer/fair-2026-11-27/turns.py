"""Two chat turns per conversation (MT-Bench's first question, then its follow-up after the server's
own answer), streamed and greedy: the first token's delay of each turn, at 1 in flight (conversations
one after another) and at 8 (eight conversations at once). The same harness for every server."""
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from card.client.bench import data

url, model, label, out = sys.argv[1:5]
convs = data.load("mt_bench_followup", 16).prompts


def stream(client, messages):
    start = time.perf_counter()
    first = None
    text = []
    body = {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                first = first or time.perf_counter() - start
                text.append(delta[0]["delta"]["content"])
    return first, "".join(text)


def conversation(conv):
    with httpx.Client() as client:
        q1, q2 = conv[0], conv[2]
        t1, answer = stream(client, [q1])
        t2, _ = stream(client, [q1, {"role": "assistant", "content": answer}, q2])
        return t1, t2


result = {"label": label, "levels": {}}
for level, group in ((1, convs[:8]), (8, convs[8:16])):
    with ThreadPoolExecutor(level) as pool:
        times = list(pool.map(conversation, group))
    t1 = [a for a, _ in times]
    t2 = [b for _, b in times]
    result["levels"][level] = {"turn1_ttft_p50_ms": 1000 * statistics.median(t1),
                               "turn2_ttft_p50_ms": 1000 * statistics.median(t2),
                               "turn2_over_turn1": statistics.median(t2) / statistics.median(t1),
                               # the tails (since 2026-11-30): the slowest first token of each turn
                               "turn1_ttft_max_ms": 1000 * max(t1), "turn2_ttft_max_ms": 1000 * max(t2),
                               "turn1_ttft_mean_ms": 1000 * statistics.mean(t1),
                               "turn2_ttft_mean_ms": 1000 * statistics.mean(t2)}
    print(label, level, result["levels"][level], flush=True)
Path(f"{out}/turns-{label}.json").write_text(json.dumps(result, indent=2) + "\n")
