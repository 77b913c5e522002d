"""TTFT of fresh prompts of 50, 200 and 400 words (69, 251 and 512 SmolLM2 tokens) through an OpenAI
completions endpoint, one at a time, 2 greedy tokens; the first streamed chunk with text counts.
Usage: probe_ttft.py URL MODEL SEED_OFFSET"""

import json
import random
import sys
import time

import httpx

url, model, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
         "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon"]


def prompt(n: int, seed: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n))


def ttft(text: str) -> float:
    body = {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("text"):
                    return time.perf_counter() - t0
    raise RuntimeError("no token came")


for n in (50, 200, 400):
    for seed in range(3):
        print(n, "words", round(ttft(prompt(n, 1000 * n + seed + offset)) * 1000), "ms", flush=True)
