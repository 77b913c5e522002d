"""card-target's engine loop and cache link, in process, on a tiny model: bounded admission
(--max-waiting), a submit during shutdown or after the engine's thread died refused at once (never
a handler left waiting), admission callbacks, and the circuit breaker over the cache."""

from __future__ import annotations

import queue
import threading

import pytest

from card.engine.shared.config import GenerationRequest, StopParams
from card.engine.shared.errors import ResourceExhausted, Unavailable
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import Event, TargetEngine
from card.target_service.cache_link import Breaker
from card.target_service.engine_loop import EngineLoop
from tests.tiny_models import tiny_model


def _gen(tokens: int = 8) -> Generation:
    request = GenerationRequest((1, 2, 3), stop=StopParams(tokens, ignore_eos=True))
    return Generation(request, NoDraft(), eos_ids=frozenset(), decode=lambda ids: "", context_window=256,
                      mode="vanilla")


@pytest.fixture
def engine() -> TargetEngine:
    model = tiny_model()
    return TargetEngine(model, KVPool(model, slots=1, max_len=256))


def _drain(box: queue.Queue, timeout_s: float = 30.0) -> Event:
    while True:
        event = box.get(timeout=timeout_s)
        if event.done:
            return event


def test_waiting_queue_is_bounded_and_refuses_at_once(engine):
    loop = EngineLoop(engine, max_waiting=1)  # not started: nothing is admitted
    loop.submit(_gen(), queue.Queue().put)  # takes the free slot at the first iteration
    loop.submit(_gen(), queue.Queue().put)  # waits
    with pytest.raises(ResourceExhausted, match="--max-waiting 1"):
        loop.submit(_gen(), queue.Queue().put)
    unbounded = EngineLoop(engine)
    for _ in range(5):
        unbounded.submit(_gen(), queue.Queue().put)  # control: without a bound all are queued


def test_admission_callback_fires_once_for_admitted_and_for_ended(engine):
    loop = EngineLoop(engine)
    admitted = [threading.Event(), threading.Event()]
    boxes = [queue.Queue(), queue.Queue()]
    gens = [_gen(64), _gen(4)]
    loop.start()
    try:
        loop.submit(gens[0], boxes[0].put, admitted[0].set)
        assert admitted[0].wait(10)
        loop.submit(gens[1], boxes[1].put, admitted[1].set)  # waits: the one slot is busy
        assert not admitted[1].wait(0.05) or gens[1].slot is not None or gens[0].result is not None
        loop.cancel(gens[0])
        assert admitted[1].wait(10)
        assert _drain(boxes[1]).error is None and gens[1].result.finish_reason == "length"
    finally:
        loop.stop()


def test_a_submit_after_stop_is_refused_not_left_waiting(engine):
    loop = EngineLoop(engine)
    loop.start()
    box: queue.Queue = queue.Queue()
    loop.submit(_gen(2), box.put)
    assert _drain(box).error is None
    loop.stop()
    with pytest.raises(Unavailable, match="shutting down"):
        loop.submit(_gen(), queue.Queue().put)


class EngineBug(BaseException):
    """Stands for a bug that escapes the engine's own error handling."""


def test_a_dead_engine_thread_ends_every_request_and_reports_itself(engine, monkeypatch):
    died: list[BaseException] = []
    loop = EngineLoop(engine, on_death=died.append)
    box: queue.Queue = queue.Queue()
    waiting: queue.Queue = queue.Queue()
    loop.submit(_gen(64), box.put)
    loop.submit(_gen(64), waiting.put)

    def broken() -> list[Event]:
        raise EngineBug("boom")

    monkeypatch.setattr(engine, "step", broken)  # fault injection: the loop itself must survive it
    loop.start()
    for sink in (box, waiting):
        event = _drain(sink)
        assert isinstance(event.error, Unavailable)
    loop._thread.join(10)
    assert not loop.alive and isinstance(died[0], EngineBug)
    with pytest.raises(Unavailable, match="engine stopped"):
        loop.submit(_gen(), queue.Queue().put)


# ---- the breaker ---------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_failures_in_a_row_and_probes_back():
    clock = Clock()
    b = Breaker(threshold=3, cooldown_s=1.0, max_cooldown_s=4.0, clock=clock)
    b.failure()
    b.failure()
    b.success()  # an answer in between: not "in a row"
    b.failure()
    b.failure()
    assert b.allow() and b.state == Breaker.CLOSED
    b.failure()
    assert b.state == Breaker.OPEN and not b.allow() and b.retry_in() == pytest.approx(1.0)
    clock.now += 1.0
    assert b.allow() and b.state == Breaker.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open again, twice as long
    assert b.state == Breaker.OPEN and b.retry_in() == pytest.approx(2.0)
    clock.now += 2.0
    assert b.allow()
    b.failure()
    clock.now += 4.0
    assert b.allow()
    b.failure()
    assert b.retry_in() == pytest.approx(4.0)  # capped
    clock.now += 4.0
    assert b.allow()
    b.success()
    assert b.state == Breaker.CLOSED and b.allow() and b.allow()
