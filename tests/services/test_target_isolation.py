"""No user waits on someone else's trouble (a running trio, entry points as subprocesses, the
default pair):

- a cache that hangs (SIGSTOPped, not killed) while card and plain streams run costs each stream
  at most one Step deadline, not the whole hang; every output stays exact, and a request that
  starts while the cache hangs speculates once it answers again (its first open failing does not
  leave it without a draft for good);
- 200 HTTP requests against 8 KV slots with a 5 s queue timeout (the real `openai` client): every
  one is answered, 200 or 429 with Retry-After, none hangs, and no cache session is left behind
  (a request's session opens only once it has a slot).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from card.client.remote import RemoteGenerationResult, generate_remote
from card.client.trio import LocalTrio
from card.engine.shared.config import SamplingParams, StopParams
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.e2e_support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "List ten fruits and describe each.", "Describe the water cycle in detail."]
STEP_TIMEOUT_S = 1.0
HANG_S = 7.0  # longer than the open deadline (5 s): the old code dropped a new request's draft
TOKENS = 120
LATE_TOKENS = 600  # still running well after the cache answers again (240 ended inside the hang
# once the CPU attention kernel made decoding faster: checked below, not assumed)


@pytest.fixture(scope="module")
def trio(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTrio]:
    tmp = tmp_path_factory.mktemp("isolation")
    with LocalTrio(speculation="always",
                   draft_name="same", log_dir=tmp / "logs", redis_url=redis_server.url, http_port=0,
                   start_timeout_s=240,
                   extra_args={"cache": ["--redis-prefix", f"isolation-{uuid.uuid4().hex[:8]}:"],
                               "target": ["--queue-timeout-s", "5", "--max-batch-size", "8",
                                          "--step-timeout-ms", str(int(STEP_TIMEOUT_S * 1000))]}) as t:
        yield t


def cache_sessions(trio: LocalTrio) -> int:
    with grpc.insecure_channel(trio.cache_addr) as ch:
        return len(cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=5).sessions)


class Timed:
    """One streamed generation on its own thread, with the arrival time of every piece of text."""

    def __init__(self, trio: LocalTrio, prompt: str, mode: str, sampling: SamplingParams,
                 tokens: int) -> None:
        self.arrivals: list[float] = []
        self.result: RemoteGenerationResult | None = None
        self.error: BaseException | None = None
        self.args = (trio.target_addr, prompt, mode, sampling, tokens)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        addr, prompt, mode, sampling, tokens = self.args
        try:
            self.result = generate_remote(addr, prompt, sampling=sampling, mode=mode, timeout_s=300,
                                          stop=StopParams(tokens, ignore_eos=True),
                                          on_text=lambda _: self.arrivals.append(time.monotonic()))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)), default=0.0)


def test_a_hung_cache_costs_each_stream_one_step_deadline_not_the_hang(trio):
    cache = next(p for p in trio.processes if p.name == "card-cache")
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, seed=7)
    cases = [(PROMPTS[0], greedy), (PROMPTS[1], greedy), (PROMPTS[2], sampled), (PROMPTS[3], greedy)]
    streams = [Timed(trio, p, "card", s, TOKENS) for p, s in cases]
    plain = Timed(trio, PROMPTS[0], "vanilla", greedy, TOKENS)
    wait_until(lambda: all(len(s.arrivals) >= 5 for s in [*streams, plain]), timeout_s=120,
               what="every stream to be under way")
    os.kill(cache.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)
        late = Timed(trio, PROMPTS[1], "card", greedy, LATE_TOKENS)  # its first open meets the hung cache
        time.sleep(HANG_S - 1.0)
    finally:
        os.kill(cache.proc.pid, signal.SIGCONT)
    # the premise of the last assertion: the late request outlives the hang
    assert late.thread.is_alive(), "the late request ended inside the hang: raise LATE_TOKENS"
    for s in [*streams, plain, late]:
        s.thread.join(300)
        assert s.error is None, s.error
    gaps = {i: round(s.longest_gap(), 2) for i, s in enumerate([*streams, plain, late])}
    # one failed StepBatch deadline plus an iteration, not the hang (the old code: the whole hang)
    assert max(gaps.values()) < 2 * STEP_TIMEOUT_S, gaps
    # exact: each card output equals plain decoding of the same request through the same target
    # (the references run together: the target's batched forward is batch-invariant, --exact)
    runs = list(zip([*streams, late], [*cases, (PROMPTS[1], greedy)], [TOKENS] * 4 + [LATE_TOKENS],
                    strict=True))
    with ThreadPoolExecutor(len(runs)) as pool:
        references = list(pool.map(lambda run: generate_remote(
            trio.target_addr, run[1][0], sampling=run[1][1], mode="vanilla",
            stop=StopParams(run[2], ignore_eos=True), timeout_s=300), runs))
    for (s, _, _), reference in zip(runs, references, strict=True):
        assert s.result.token_ids == reference.token_ids
    assert plain.result.token_ids == streams[0].result.token_ids
    # the request that started during the hang got a session once the cache answered again and
    # stepped it (the old code gave up on its first open: no Step at all); how much its draft then
    # wins depends on the load, not on this
    assert late.result.stats.step_rtt_ms, late.result.stats


def test_requests_past_the_queue_are_answered_429_and_leave_no_session(trio):
    model = openai.OpenAI(base_url=f"http://{trio.http_addr}/v1", api_key="none").models.list().data[0].id

    async def run() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"http://{trio.http_addr}/v1", api_key="none", max_retries=0,
                                    timeout=120)

        async def one(i: int) -> tuple[int, str | None]:
            try:
                await client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                                temperature=0, extra_body={"ignore_eos": True})
                return 200, None
            except openai.RateLimitError as err:
                assert err.body and err.body["message"], err.body  # OpenAI's error shape
                return 429, err.response.headers.get("retry-after")

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 240)
        finally:
            await client.close()

    answers = asyncio.run(run())
    codes = [code for code, _ in answers]
    assert set(codes) <= {200, 429} and len(codes) == 200
    assert codes.count(200) >= 8 and codes.count(429) >= 1, codes
    assert all(after and float(after) > 0 for code, after in answers if code == 429)
    wait_until(lambda: cache_sessions(trio) == 0, timeout_s=15, what="every cache session to close")
