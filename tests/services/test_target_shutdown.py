"""SIGTERM of card-target with streams in flight: they finish, nothing is left behind. The trio is
started from the entry points (subprocesses on loopback), tiny float64 checkpoints."""

from __future__ import annotations

import signal
import threading
import uuid

import grpc
import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio
from card.engine.shared.config import SamplingParams, StopParams
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.e2e_support import metric, scrape, wait_until
from tests.tiny_models import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ("Write a haiku about the sea.", "What is two plus two?", "Name three colours.",
           "Tell me a story about a fox.")


@pytest.mark.parametrize("grace", [60, 0])
def test_sigterm_lets_four_streams_finish_and_leaves_nothing(redis_server, tmp_path, grace):
    """grace 60: the four finish, exact. grace 0: they are cut at once, and still no session, key or
    draft KV is left (the engine ends them and closes their sessions before the channel goes)."""
    model = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    prefix = f"term-{uuid.uuid4().hex[:8]}:"
    trio = LocalTrio(speculation="always",
                     target_model=model, draft_model=model, draft_name="same", target_threads=1,
                     draft_threads=1, dtype="float64", log_dir=tmp_path / "logs", redis_url=redis_server.url,
                     metrics=True, start_timeout_s=240, extra_args={"cache": ["--redis-prefix", prefix],
                                                      "target": ["--max-model-len", "480",
                                                                 "--shutdown-grace-s", str(grace)]})
    stop = StopParams(400, ignore_eos=True)
    with trio:
        # the reference only matters where the streams must finish (grace 0 cuts them)
        want = [generate_remote(trio.target_addr, p, sampling=SamplingParams(), stop=stop, mode="vanilla",
                                timeout_s=120).token_ids for p in PROMPTS] if grace else []
        started = threading.Semaphore(0)
        results: dict[int, object] = {}

        def run(i: int) -> None:
            first = [True]

            def on_text(_: str) -> None:
                if first[0]:
                    first[0] = False
                    started.release()

            try:
                results[i] = generate_remote(trio.target_addr, PROMPTS[i], sampling=SamplingParams(),
                                             stop=stop, draft="same", timeout_s=120, on_text=on_text)
            except Exception as exc:  # recorded, asserted below
                results[i] = exc
                started.release()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in range(4):
            assert started.acquire(timeout=60)
        target = next(p for p in trio.processes if p.name == "card-target")
        target.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert target.proc.wait(90) == 0
        if grace:
            for i in range(4):
                result = results[i]
                assert not isinstance(result, Exception), result
                assert result.token_ids == want[i] and result.finish_reason == "length"
        else:
            assert any(isinstance(r, Exception) for r in results.values()), "no stream was cut"

        def cache_empty() -> bool:
            with grpc.insecure_channel(trio.cache_addr) as ch:
                status = cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=5)
            return not status.sessions

        wait_until(cache_empty, what="no session left in the cache")
        wait_until(lambda: metric(scrape(trio.drafts[0].metrics_port), "card_draft_kv_slots") == 0,
                   what="the draft to hold no KV")
        assert list(redis_server.client().scan_iter(f"{prefix}session:*")) == []
        trio.processes.remove(target)  # already stopped
