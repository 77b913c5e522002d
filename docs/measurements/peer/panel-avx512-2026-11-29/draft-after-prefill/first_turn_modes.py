"""First-turn TTFT by mode on one server (card-client up): the 16 MT-Bench first questions and 16
follow-ups, each as a first turn, one at a time, modes alternating in pairs. Usage: first_turn_modes.py URL"""
import json
import statistics
import sys
import time

import httpx

from card.client.bench import data

url = sys.argv[1]
convs = data.load("mt_bench_followup", 16).prompts
msgs = [c[0] for c in convs] + [c[2] for c in convs]
res = {"vanilla": [], "card": []}
def ttft(msg, mode):
    body = {"model": "default", "messages": [msg], "max_tokens": 8, "temperature": 0, "stream": True,
            "ignore_eos": True, "mode": mode}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["delta"].get("content") and first is None:
                    first = time.perf_counter() - t0
    return first
for i, m in enumerate(msgs):
    mode = ("vanilla", "card")[(i + (i // 2)) % 2]
    res[mode].append(1000 * ttft(m, mode))
    time.sleep(0.5)
for m, v in res.items():
    print(m, "p50", round(statistics.median(v)), "all", [round(x) for x in v])
