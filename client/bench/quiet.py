"""A load generator that leaves the server its cores: ``peer run --client quiet``.

AIPerf's timing loop spins a core. On a machine with few cores that core is one a server's
OpenMP team needs, and a fixed 2-thread team beside a spinning thread collapses (measured in
process for card-target's forwards, docs/performance.md, "Adaptive threads"). On the 2-core VM
vLLM's inter-token latency was 83 ms under AIPerf one day and 38-47 ms beside this client the
next, which reversed the side-by-side verdict (docs/performance.md, "With a client that does not
spin"; two days, so the VM's own drift is in that figure too). Here each of ``level``
closed-loop clients is a thread that sleeps in its socket (httpx, streamed chat completions);
nothing polls. The figures are AIPerf's, computed the same way: output tokens/s over the level's
wall time, requests/s, TTFT (to the first content chunk) and inter-token latency ((last - first
content chunk) / (output tokens - 1), per request) at p50 and p90, the output tokens from the
stream's ``usage``. The server's own view comes from
its ``/metrics`` page read before and after the level (``server_view``), as AIPerf scrapes it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from card.client.bench.peer import SERVER_LATENCIES, SPEC_COUNTERS

WARMUP_REQUESTS = 2  # as peer's AIPerf runs: the first requests pay for lazy set-up
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Reply:
    ttft_s: float
    last_s: float  # the last content chunk, from the request's start
    tokens: int  # output tokens, from the stream's usage
    text: str


def chat(client: httpx.Client, url: str, model: str, prompt: str, tokens: int, inputs: dict) -> Reply:
    """One streamed chat completion of ``prompt``; ``inputs`` merged into the body."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}, **inputs}
    start = time.perf_counter()
    first = last = None
    used = 0
    parts: list[str] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            message = json.loads(line[len("data: "):])
            if message.get("usage"):
                used = int(message["usage"]["completion_tokens"])
            choices = message.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                last = time.perf_counter() - start
                first = last if first is None else first
                parts.append(choices[0]["delta"]["content"])
    if first is None or last is None:
        raise ValueError(f"the server streamed no content for a prompt of {len(prompt)} characters")
    return Reply(first, last, used, "".join(parts))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0-1) by linear interpolation, numpy's default."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def scrape(client: httpx.Client, url: str) -> str | None:
    """The server's /metrics page, or None where it has none."""
    try:
        response = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def _samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page) for s in family.samples}


def _p50(buckets: dict[float, float]) -> float | None:
    """The median of a histogram's bucket increments (cumulative counts by upper bound), by linear
    interpolation inside its bucket, as Prometheus' histogram_quantile."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = total / 2, 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower
            span = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / span if span else 0.0)
        lower, below = bound, buckets[bound]
    return lower


def server_view(before: str, after: str) -> dict:
    """What the server measured between two /metrics pages: TTFT and ITL p50 (card-target's
    card_target_* and vLLM's vllm:* families alike) and speculation as vLLM defines it (acceptance
    rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts). Families the
    server does not export are left out."""
    old, new = _samples(before), _samples(after)
    delta = {key: value - old.get(key, 0.0) for key, value in new.items()}
    row: dict = {}
    for suffix, ours in SERVER_LATENCIES.items():
        buckets: dict[float, float] = {}
        for (name, labels), value in delta.items():
            if name.endswith(f"{suffix}_bucket"):
                bound = float(dict(labels)["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
        p50 = _p50(buckets)
        if p50 is not None:
            row[ours] = 1000.0 * p50
    accepted, drafted, drafts = (sum(v for (name, _), v in delta.items()
                                     if name.removesuffix("_total").endswith(c)) for c in SPEC_COUNTERS)
    if drafted:
        row["acceptance_rate"] = accepted / drafted
    if drafts:
        row["mean_acceptance_length"] = 1.0 + accepted / drafts
    return row


def measure(url: str, model: str, texts: Sequence[str], level: int, tokens: int, rounds: int,
            inputs: dict, api_key: str | None = None) -> tuple[dict, list[str]]:
    """One concurrency level: every prompt ``rounds`` times through ``level`` closed-loop clients,
    after WARMUP_REQUESTS; the level's row (peer's keys) and each request's text, in prompt order."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = list(texts) * rounds
    local = httpx.Client(timeout=TIMEOUT_S, headers=headers)
    clients = [httpx.Client(timeout=TIMEOUT_S, headers=headers) for _ in range(level)]
    try:
        for prompt in prompts[:WARMUP_REQUESTS]:
            chat(local, url, model, prompt, tokens, inputs)
        before = scrape(local, url)

        def worker(index: int) -> list[tuple[int, Reply | BaseException]]:
            done: list[tuple[int, Reply | BaseException]] = []
            for i in range(index, len(prompts), level):  # closed loop: the next once one ends
                try:
                    done.append((i, chat(clients[index], url, model, prompts[i], tokens, inputs)))
                except (httpx.HTTPError, ValueError) as exc:
                    done.append((i, exc))
            return done

        start = time.perf_counter()
        with ThreadPoolExecutor(level) as pool:
            results = dict(item for part in pool.map(worker, range(level)) for item in part)
        wall = time.perf_counter() - start
        after = scrape(local, url)
    finally:
        local.close()
        for client in clients:
            client.close()
    replies = [r for r in results.values() if isinstance(r, Reply)]
    row: dict = {"requests": len(replies), "errors": len(results) - len(replies)}
    if replies:
        ttft = [1000.0 * r.ttft_s for r in replies]
        itl = [1000.0 * (r.last_s - r.ttft_s) / (r.tokens - 1) for r in replies if r.tokens > 1]
        row.update(output_tok_s=sum(r.tokens for r in replies) / wall, requests_s=len(replies) / wall,
                   ttft_ms=statistics.median(ttft), ttft_p90_ms=percentile(ttft, 0.9),
                   itl_ms=statistics.median(itl) if itl else None,
                   itl_p90_ms=percentile(itl, 0.9) if itl else None)
    if before is not None and after is not None:
        row.update(server_view(before, after))
    texts_out = [r.text if isinstance(r, Reply) else "" for _, r in sorted(results.items())]
    return row, texts_out
