"""The same four questions through card-target's OpenAI API (the default model, plain decoding, no
cache service): a card-target with prefix caching on and one with it off
(``--no-enable-prefix-caching``), started in turn, the questions asked in turn with the official
``openai`` client, streamed; TTFT measured at the client (request sent to first text). Two rounds
alternating which server goes first; each server starts cold. Output in four-questions-http-cpu.txt.

    .venv/bin/python docs/measurements/prefix-cache/four_questions_http.py [rounds] [threads]
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from card.client.trio import console_script

sys.path.insert(0, str(Path(__file__).resolve().parent))
from four_questions import DOC_TOKENS, NEW, QUESTIONS

READY = re.compile(r"^card-target: OpenAI API on (\S+) \(model (\S+)\)$", re.MULTILINE)


def document(url: str) -> str:
    """The first DOC_TOKENS tokens of docs/architecture.md, cut by the server's own tokenizer
    (vLLM's /tokenize and /detokenize)."""
    import httpx

    text = (Path(__file__).resolve().parents[2] / "architecture.md").read_text()
    root = url.removesuffix("/v1")
    models = httpx.get(f"{url}/models", timeout=60).json()["data"][0]["id"]
    ids = httpx.post(f"{root}/tokenize", json={"model": models, "prompt": text}, timeout=60).json()["tokens"]
    return httpx.post(f"{root}/detokenize", json={"model": models, "tokens": ids[:DOC_TOKENS]},
                      timeout=60).json()["prompt"]


def serve(caching: bool, threads: int, logs: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    cmd = [console_script("card-target"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
           "--threads", str(threads), flag]
    with open(logs / f"out-{caching}.log", "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        match = READY.search((logs / f"out-{caching}.log").read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit((logs / f"out-{caching}.log").read_text()[-3000:])
        time.sleep(0.2)
    raise SystemExit("card-target did not start")


def ask(url: str, doc: str) -> list[tuple[float, str, int]]:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    out = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]
        t0 = time.perf_counter()
        first, text, cached = None, "", 0
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=NEW,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            delta = "".join(c.delta.content or "" for c in chunk.choices)
            if delta and first is None:
                first = time.perf_counter() - t0
            text += delta
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        out.append((first or float("nan"), text, cached))
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    doc = ""
    ttft: dict[bool, list[list[float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            texts = {}
            for caching in ((False, True) if r % 2 == 0 else (True, False)):
                proc, url = serve(caching, threads, Path(tmp))
                try:
                    doc = doc or document(url)
                    got = ask(url, doc)
                finally:
                    proc.terminate()
                    proc.wait(60)
                ttft[caching].append([t for t, _, _ in got])
                texts[caching] = [t for _, t, _ in got]
                if caching:
                    print(f"round {r + 1}: cached tokens {[c for _, _, c in got]}")
            print(f"round {r + 1}: greedy answers equal on/off: "
                  f"{[a == b for a, b in zip(texts[True], texts[False], strict=True)]}")
    print(f"card-target, default model, {threads} torch thread(s), streamed chat completions, {NEW} tokens")
    for caching in (False, True):
        per_q = [statistics.median(r[i] for r in ttft[caching]) for i in range(len(QUESTIONS))]
        ratio = per_q[0] / statistics.mean(per_q[1:])
        print(f"prefix caching {'on ' if caching else 'off'}: client TTFT median per question (s) "
              f"{[round(t, 3) for t in per_q]}; 1st / mean(2nd-4th) = {ratio:.2f}x")
    on = [statistics.median(r[i] for r in ttft[True]) for i in range(len(QUESTIONS))]
    off = [statistics.median(r[i] for r in ttft[False]) for i in range(len(QUESTIONS))]
    print(f"2nd-4th TTFT, off / on: {statistics.mean(off[1:]) / statistics.mean(on[1:]):.2f}x")


if __name__ == "__main__":
    main()
