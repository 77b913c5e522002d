"""card-target's metrics in vLLM's shape (card.target_service.metrics, docs/services.md "Metrics").

In process, on a tiny model: the engine loop's request histograms, token counters and spec-decode
counters against each generation's own stats, with a draft that is right for a varying number of
tokens (so every chain position is exercised), one request that queues and one that is cancelled.
End to end (slow): redis-server, card-cache, card-draft and card-target as subprocesses, requests
over HTTP (streaming and not) and gRPC, the page read with prometheus_client's parser (what AIPerf
and Prometheus read): counts, TTFT <= end to end, tokens, spec-decode counters equal the sums of
each answer's ``metrics.speculative_decoding``, the served name as ``model_name``, HTTP requests by
route template. Every wait is on a counter or an event, bounded."""

from __future__ import annotations

import json
import queue
import uuid
from collections import Counter as Tally
from collections.abc import Sequence

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from card.client.trio import LocalTrio
from card.common.channels import channel
from card.engine.shared.config import GenerationRequest, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.session import StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import NO_NODE, Chain, Correction
from card.engine.target.chain_source import DraftKind, NoDraft, SourceStats
from card.engine.target.generation import Generation
from card.engine.target.scheduler import Event, TargetEngine
from card.target_service.engine_loop import EngineLoop
from card.v1 import target_pb2, target_pb2_grpc
from tests.services.e2e_support import wait_until
from tests.tiny_models import save_tiny_checkpoint, tiny_model

PROMPT = (5, 17, 42, 8, 3, 61)
VOCAB = 97


# ---- in process -----------------------------------------------------------------------------
class Replay:
    """A draft that knows the answer (the reference continuation) and is wrong at one position of
    each chain, a different one each step (``CHAIN`` is never wrong: the whole chain is kept)."""

    CHAIN = 4
    drafters = (DraftKind.WORKER,)

    def __init__(self, reference: Sequence[int], first_wrong: int) -> None:
        self.reference = list(reference)
        self.wrong = first_wrong
        self.committed: Sequence[int] = ()

    def draft_with(self, kind: DraftKind | None) -> None:
        pass

    def open(self, committed: Sequence[int]) -> None:
        self.committed = committed

    def step(self, correction: Correction) -> StepResult:
        done = len(self.committed) - len(PROMPT)  # tokens generated so far, t_next included
        tokens = self.reference[done:done + self.CHAIN]
        if self.wrong < len(tokens):
            tokens[self.wrong] = (tokens[self.wrong] + 1) % VOCAB
        self.wrong = (self.wrong + 1) % (self.CHAIN + 1)
        return StepResult(Chain(tuple(tokens), (NO_NODE,) * len(tokens), correction.epoch))

    def close(self, stats: GenerationStats) -> SourceStats:
        return SourceStats()


def _generation(source, tokens: int) -> Generation:
    request = GenerationRequest(PROMPT, stop=StopParams(tokens, ignore_eos=True))
    return Generation(request, source, eos_ids=frozenset(), decode=lambda ids: "", context_window=256,
                      mode="card" if isinstance(source, Replay) else "vanilla")


def _events(box: queue.Queue, timeout_s: float = 60.0) -> list[Event]:
    events = [box.get(timeout=timeout_s)]
    while not events[-1].done:
        events.append(box.get(timeout=timeout_s))
    return events


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_engine_loop_counts_requests_tokens_and_drafts_as_vllm_does():
    name = f"inproc-{uuid.uuid4().hex[:8]}"  # a label of its own: other tests' samples stay apart
    model = tiny_model(vocab=VOCAB)
    # adaptive off: every chain is verified whole (no cut by measured cost, no pause)
    engine = TargetEngine(model, KVPool(model, slots=2, max_len=256), adaptive=False)
    loop = EngineLoop(engine, model_name=name)
    loop.start()
    try:
        box: queue.Queue = queue.Queue()
        reference = _generation(NoDraft(), 40)
        loop.submit(reference, box.put)
        _events(box)
        assert reference.result is not None
        answer = reference.result.token_ids
        # three at once on two slots: one waits; a fourth is cancelled after its first token
        gens = [_generation(Replay(answer, first_wrong=w), 40) for w in (0, 2, 4)]
        boxes: list[queue.Queue] = [queue.Queue() for _ in gens]
        for gen, b in zip(gens, boxes, strict=True):
            loop.submit(gen, b.put)
        runs = [_events(b) for b in boxes]
        cancelled, cbox = _generation(Replay(answer, 1), 200), queue.Queue()
        loop.submit(cancelled, cbox.put)
        first = cbox.get(timeout=60)  # its first token (a budget of 200 cannot end in one event)
        loop.cancel(cancelled)
        crun = [first, *_events(cbox)]
    finally:
        loop.stop()
    finished = [reference, *gens]
    results = [g.result for g in finished]
    assert all(r is not None and r.token_ids == answer and r.finish_reason == "length" for r in results)
    assert cancelled.result is not None and cancelled.result.finish_reason == "aborted"
    n = len(finished)
    # one TTFT per generation that committed a token (the cancelled one too), the rest per finished one
    assert _sample("card_target_time_to_first_token_seconds_count", model_name=name) == n + 1
    for hist in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time", "request_time_per_output_token"):
        assert _sample(f"card_target_{hist}_seconds_count", model_name=name) == n, hist
    assert _sample("card_target_request_success_total", model_name=name, finished_reason="length") == n
    assert _sample("card_target_request_queue_time_seconds_sum", model_name=name) > 0  # one waited
    # one inter-token gap per commit after the first: every forward after the prefill's
    commits = sum(len(g.stats.accepted_lengths) - 1 for g in [*finished, cancelled])
    assert _sample("card_target_inter_token_latency_seconds_count", model_name=name) == commits
    streamed = sum(len(e.chunk.token_ids) for run in [*runs, crun] for e in run if e.chunk is not None)
    assert streamed == sum(len(g.result.token_ids) for g in [*gens, cancelled] if g.result is not None)
    assert _sample("card_target_generation_tokens_total", model_name=name) == streamed + len(answer)
    assert _sample("card_target_prompt_tokens_total", model_name=name) == len(PROMPT) * (n + 1)
    # spec decode: the sums of the per-request stats, per position from the acceptance histograms
    stats = [g.stats for g in [*gens, cancelled]]
    drafts = sum(s.spec_steps for s in stats)
    assert drafts > 0 and sum(s.accepted_draft_tokens for s in stats) > 0
    assert _sample("card_target_spec_decode_num_drafts_total", model_name=name) == drafts
    assert _sample("card_target_spec_decode_num_draft_tokens_total", model_name=name) == sum(
        s.draft_tokens for s in stats)
    accepted = _sample("card_target_spec_decode_num_accepted_tokens_total", model_name=name)
    assert accepted == sum(s.accepted_draft_tokens for s in stats)
    per_pos = [_sample("card_target_spec_decode_num_accepted_tokens_per_pos_total", model_name=name,
                       position=str(p)) for p in range(Replay.CHAIN + 1)]
    want = [sum(c for s in stats for kept, c in enumerate(s.acceptance_histogram) if kept > p)
            for p in range(Replay.CHAIN + 1)]
    assert per_pos == want and sum(per_pos) == accepted
    assert all(v > 0 for v in per_pos[:Replay.CHAIN]) and per_pos[Replay.CHAIN] == 0
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    # the scheduler's gauges, idle now
    assert _sample("card_target_num_requests_running", model_name=name) == 0
    assert _sample("card_target_kv_cache_usage_perc", model_name=name) == 0.0


# ---- end to end -----------------------------------------------------------------------------
KEY = "sk-test-" + uuid.uuid4().hex
TEXT = "Write a haiku about the sea."


@pytest.fixture(scope="module")
def trio(redis_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-models")
    # the draft is the target's own weights, the target dearer (idle layers): chains get accepted
    target = str(save_tiny_checkpoint(root / "target", seed=0, idle_layers=8))
    draft = str(save_tiny_checkpoint(root / "draft", seed=0))
    with LocalTrio(speculation="always", target_model=target, draft_model=draft, draft_name="same",
                   target_threads=1, draft_threads=1, dtype="float64", redis_url=redis_server.url,
                   log_dir=tmp_path_factory.mktemp("metrics-logs"), metrics=True, http_port=0,
                   start_timeout_s=240,
                   extra_args={"cache": ["--redis-prefix", f"metrics-{uuid.uuid4().hex[:8]}:"],
                               "target": ["--max-model-len", "480", "--api-key", KEY]}) as trio:
        yield trio


Samples = dict[tuple[str, frozenset], float]


def scrape(trio) -> Samples:
    """The target's /metrics on its HTTP port (where AIPerf reads it), parsed as Prometheus does."""
    reply = httpx.get(f"http://{trio.http_addr}/metrics", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=10)
    reply.raise_for_status()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def _stream(url: str, body: dict) -> dict:
    """A streamed completion's usage chunk (it carries ``metrics`` and ``usage.card``)."""
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    (last,) = [e for e in events if "metrics" in e]
    return last


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_metrics_page_adds_up_over_http_and_grpc(trio):
    headers = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(f"http://{trio.http_addr}/v1/models", headers=headers, timeout=10).json()
    served = models["data"][0]["id"]
    before = scrape(trio)
    base = f"http://{trio.http_addr}/v1"
    # (tokens, prompt tokens, speculative_decoding, forwards) of each answer
    answers: list[tuple[int, int, dict, int]] = []
    for n in (24, 40):
        body = {"model": served, "prompt": TEXT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "draft": "same"}
        reply = httpx.post(f"{base}/completions", json=body, headers=headers, timeout=120).json()
        usage = reply["usage"]
        answers.append((usage["completion_tokens"], usage["prompt_tokens"],
                        reply["metrics"]["speculative_decoding"], usage["card"]["target_forwards"]))
    chat = _stream(f"{base}/chat/completions", {"model": served, "max_tokens": 32, "temperature": 0,
                                               "ignore_eos": True,
                                               "messages": [{"role": "user", "content": TEXT}]})
    answers.append((chat["usage"]["completion_tokens"], chat["usage"]["prompt_tokens"],
                    chat["metrics"]["speculative_decoding"], chat["usage"]["card"]["target_forwards"]))
    with channel(trio.target_addr, KEY) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        for mode in ("card", "vanilla"):
            request = target_pb2.GenerateRequest(prompt=TEXT, max_new_tokens=20, ignore_eos=True, mode=mode,
                                                 draft="same" if mode == "card" else "")
            replies = list(stub.Generate(request, timeout=120))
            s = replies[-1].final.stats
            hist = list(s.acceptance_histogram)
            answers.append((s.new_tokens, s.prompt_tokens, {
                "num_spec_steps": sum(hist), "num_draft_tokens": s.draft_tokens,
                "num_accepted_draft_tokens": s.accepted_draft_tokens, "acceptance_histogram": hist or [0]},
                s.target_forwards))
    requests = len(answers)
    label = {"model_name": served}

    def counted() -> bool:
        done = delta(scrape(trio), before, "card_target_e2e_request_latency_seconds_count", **label)
        return done >= requests

    wait_until(counted, timeout_s=30, what="every request in the end-to-end histogram")
    after = scrape(trio)
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(after, before, f"card_target_{hist}_seconds_count", **label) == requests, hist
    # TTFT <= end to end for each request, so below every bound at least as many TTFTs as totals
    for le in ("0.5", "1.0", "2.5", "5.0", "10.0", "20.0", "40.0", "80.0", "+Inf"):
        assert (delta(after, before, "card_target_time_to_first_token_seconds_bucket", **label, le=le)
                >= delta(after, before, "card_target_e2e_request_latency_seconds_bucket", **label, le=le)), le
    assert (delta(after, before, "card_target_time_to_first_token_seconds_sum", **label)
            <= delta(after, before, "card_target_e2e_request_latency_seconds_sum", **label))
    assert delta(after, before, "card_target_generation_tokens_total", **label) == sum(a[0] for a in answers)
    assert delta(after, before, "card_target_prompt_tokens_total", **label) == sum(a[1] for a in answers)
    assert delta(after, before, "card_target_request_success_total", **label,
                 finished_reason="length") == requests
    # short prompts: one prefill forward each, then one inter-token gap per forward
    assert delta(after, before, "card_target_inter_token_latency_seconds_count", **label) == sum(
        a[3] - 1 for a in answers)
    # spec decode: the sums of the answers' own objects (what AIPerf reads per request)
    specs = [a[2] for a in answers]
    drafts = delta(after, before, "card_target_spec_decode_num_drafts_total", **label)
    drafted = delta(after, before, "card_target_spec_decode_num_draft_tokens_total", **label)
    accepted = delta(after, before, "card_target_spec_decode_num_accepted_tokens_total", **label)
    assert drafts == sum(s["num_spec_steps"] for s in specs)
    assert drafted == sum(s["num_draft_tokens"] for s in specs)
    assert accepted == sum(s["num_accepted_draft_tokens"] for s in specs) <= drafted
    per_pos = [delta(after, before, "card_target_spec_decode_num_accepted_tokens_per_pos_total", **label,
                     position=str(p)) for p in range(64)]
    want = [sum(c for s in specs for kept, c in enumerate(s["acceptance_histogram"]) if kept > p)
            for p in range(64)]
    assert per_pos == want and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    # one label value: the served name, on every request-level series
    names = {dict(labels)["model_name"] for (name, labels), _ in after.items()
             if name.startswith("card_target_") and "model_name" in dict(labels)}
    assert names == {served}
    assert 0.0 <= value(after, "card_target_kv_cache_usage_perc", **label) <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_http_requests_are_counted_by_route_template(trio):
    headers = {"Authorization": f"Bearer {KEY}"}
    base = f"http://{trio.http_addr}"
    before = scrape(trio)
    calls = Tally()
    for _ in range(2):
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=10).status_code == 200
        calls["/v1/models", "GET", "200"] += 1
    assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401  # the Guard's refusal counts
    calls["/v1/models", "GET", "401"] += 1
    odd = f"/no/such/{uuid.uuid4().hex}"
    assert httpx.get(base + odd, headers=headers, timeout=10).status_code == 404
    calls["none", "GET", "404"] += 1
    assert httpx.get(f"{base}/v1/completions", headers=headers, timeout=10).status_code == 405
    calls["/v1/completions", "GET", "405"] += 1
    bad = httpx.post(f"{base}/v1/completions", headers=headers, timeout=10,
                     json={"prompt": "hi", "max_tokens": 0})  # a budget below 1 is refused
    assert bad.status_code == 400
    calls["/v1/completions", "POST", "400"] += 1
    ok = httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                    json={"model": "x", "prompt": "hi", "max_tokens": 2, "mode": "vanilla"})
    calls["/v1/completions", "POST", str(ok.status_code)] += 1  # 404: no model "x"
    assert ok.status_code == 404
    httpx.get(f"{base}/health", timeout=10)  # probes and scrapes are not counted (as in vLLM)
    after = scrape(trio)
    for (handler, method, status), n in calls.items():
        got = delta(after, before, "card_target_http_requests_total", handler=handler, method=method,
                    status=status)
        assert got == n, (handler, method, status)
    by_handler = Tally()
    for (handler, method, _), n in calls.items():
        by_handler[handler, method] += n
    for (handler, method), n in by_handler.items():
        assert delta(after, before, "card_target_http_request_duration_seconds_count", handler=handler,
                     method=method) == n
    handlers = {dict(labels)["handler"] for (name, labels), _ in after.items()
                if name == "card_target_http_requests_total"}
    assert odd not in handlers
    assert handlers <= {"/v1/models", "/v1/completions", "/v1/chat/completions", "none"}
    assert not any(dict(labels).get("handler") in ("/health", "/metrics") for (_, labels) in after)


def test_the_prefix_cache_past_the_live_slots_shows_its_slots_bytes_and_evictions():
    """Three prompts one after another on one live slot and three cached ones, bounded to about
    one finished sequence: the gauges say 3 cached slots, what free slots keep stays within the
    bound, and the slots given back to keep it are counted."""
    model = tiny_model(vocab=VOCAB)
    pool = KVPool(model, slots=1, max_len=256, prefix_caching=True, cached_slots=3,
                  cache_bytes=KVPool(model, slots=1, max_len=256).bytes_per_row * 150)
    assert pool.cache_bytes is not None
    loop = EngineLoop(TargetEngine(model, pool), model_name=f"inproc-{uuid.uuid4().hex[:8]}")
    loop.start()
    try:
        for i in range(3):
            request = GenerationRequest(tuple((PROMPT[0] + i + j) % VOCAB for j in range(90)),
                                        stop=StopParams(4, ignore_eos=True))
            box: queue.Queue = queue.Queue()
            loop.submit(Generation(request, NoDraft(), eos_ids=frozenset(), decode=lambda ids: "",
                                   context_window=256, mode="vanilla"), box.put)
            _events(box)
        assert _sample("card_target_kv_cached_slots") == 3
        assert 0 < _sample("card_target_prefix_cache_kept_bytes") <= pool.cache_bytes
        assert _sample("card_target_prefix_cache_evictions") == pool.evictions >= 1
    finally:
        loop.stop()
