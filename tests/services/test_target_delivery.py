"""How card-target's engine loop hands tokens to its fronts (card.target_service.engine_loop,
frontend.Running), in process on a tiny model: the HTTP front's streams on one event loop get an
iteration's events in one hand-off (one wake-up of the loop per iteration, not one per stream),
and a stream whose thread or loop fell behind gets the chunks that wait as one; either way every
token, its text and its logprobs arrive once, in order, and equal the same request run alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from card.engine.shared.config import GenerationRequest, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Chunk, Generation
from card.engine.target.scheduler import Event, TargetEngine, finish_alone
from card.target_service.engine_loop import EngineLoop, LoopSink
from card.target_service.frontend import Running, merged
from tests.tiny_models import tiny_model


def _text(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _gen(prompt: tuple[int, ...], tokens: int) -> Generation:
    request = GenerationRequest(prompt, stop=StopParams(tokens, ignore_eos=True))
    return Generation(request, NoDraft(), eos_ids=frozenset(), decode=_text, context_window=256,
                      mode="vanilla")


class CountingLoop:
    """An event loop seen through its ``call_soon_threadsafe`` calls (each one a wake-up)."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self.calls = 0

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> object:
        self.calls += 1
        return self.aio.call_soon_threadsafe(fn, *args)


@pytest.fixture
def aio():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


PROMPTS = [(1, 2, 3), (4, 5), (6, 7, 8, 9), (10,)]


def _run_streams(aio: asyncio.AbstractEventLoop, batched: bool) -> tuple[list[list[Event]], list[Generation],
                                                                          CountingLoop, int]:
    """Four generations at once through an engine loop, each sink on ``aio`` (a LoopSink, or a
    plain callable scheduling each event alone); their events as the loop received them, the
    generations, the loop's wake-ups for events and the engine's iterations."""
    model = tiny_model()
    engine = TargetEngine(model, KVPool(model, slots=4, max_len=256))
    steps = [0]
    step = engine.step

    def counted() -> list[Event]:
        steps[0] += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    counting = CountingLoop(aio)
    received: list[list[Event]] = [[] for _ in PROMPTS]
    ended = [threading.Event() for _ in PROMPTS]

    def put_for(i: int) -> Callable[[Event], None]:
        def put(event: Event) -> None:  # on the event loop's thread
            assert threading.current_thread() is not threading.main_thread()
            received[i].append(event)
            if event.done:
                ended[i].set()
        return put

    gens = [_gen(p, 12) for p in PROMPTS]
    loop = EngineLoop(engine)
    for i, gen in enumerate(gens):  # all queued before the thread starts: they share iterations
        if batched:
            sink: Callable[[Event], None] = LoopSink(counting, put_for(i))  # type: ignore[arg-type]
        else:
            sink = (lambda put: lambda event: counting.call_soon_threadsafe(put, event))(put_for(i))
        loop.submit(gen, sink)
    loop.start()
    try:
        for flag in ended:
            assert flag.wait(60)
    finally:
        loop.stop()
    return received, gens, counting, steps[0]


@pytest.mark.parametrize("batched", [True, False])
def test_streams_on_one_loop_get_every_token_in_order(aio, batched):
    received, gens, counting, steps = _run_streams(aio, batched)
    model = tiny_model()
    events = sum(len(r) for r in received)
    for prompt, events_of, gen in zip(PROMPTS, received, gens, strict=True):
        tokens = [t for e in events_of if e.chunk is not None for t in e.chunk.token_ids]
        alone = finish_alone(model, _gen(prompt, 12))
        assert tokens == gen.result.token_ids == alone.token_ids and len(tokens) == 12
        assert "".join(e.chunk.text for e in events_of if e.chunk is not None) == _text(tokens)
        assert [e.done for e in events_of] == [False] * (len(events_of) - 1) + [True]
    if batched:  # one wake-up per iteration that had events, whatever the streams
        assert counting.calls <= steps < events
    else:  # the control: one per event
        assert counting.calls == events > steps


class _Loop:
    """What Running needs of the engine loop: the sink it submits, and nothing run."""

    def __init__(self) -> None:
        self.sink: Callable[[Event], None] | None = None
        self.admit: Callable[[], None] | None = None

    def submit(self, gen: Generation, sink: Callable[[Event], None], on_admit: Callable[[], None]) -> None:
        self.sink, self.admit = sink, on_admit

    def admitted(self, gen: Generation) -> bool:
        return True

    def cancel(self, gen: Generation) -> None:
        pass


def _events(gen: Generation) -> list[Event]:
    lp = [("lp", i) for i in range(5)]  # stand-ins: merged carries them, never reads them
    return [Event(gen, Chunk((10,), "<10>", (lp[0],))), Event(gen, None),
            Event(gen, Chunk((11, 12), "<11><12>", (lp[1], lp[2]))),
            Event(gen, Chunk((13,), "", (lp[3],))), Event(gen, Chunk((14,), "<13><14>", (lp[4],)), done=True)]


def test_a_lagging_grpc_stream_gets_what_waits_as_one_chunk():
    gen, loop = _gen((1,), 4), _Loop()
    running = Running(gen, NoDraft(), loop, 30.0)  # type: ignore[arg-type]
    for event in _events(gen):  # the engine ran ahead of the stream's thread
        loop.sink(event)
    chunks = list(running)
    assert chunks == [Chunk((10, 11, 12, 13, 14), "<10><11><12><13><14>",
                            tuple(("lp", i) for i in range(5)))]  # type: ignore[arg-type]
    # the control: a stream that keeps up gets each chunk as it comes
    gen, loop = _gen((1,), 4), _Loop()
    running = Running(gen, NoDraft(), loop, 30.0)  # type: ignore[arg-type]
    stream = iter(running)
    kept_up = []
    for event in _events(gen):
        loop.sink(event)
        if event.chunk is not None:
            kept_up.append(next(stream))
    assert next(stream, None) is None
    assert [c.token_ids for c in kept_up] == [(10,), (11, 12), (13,), (14,)]
    assert merged(kept_up) == chunks[0]


def test_an_error_after_waiting_chunks_comes_after_them():
    gen, loop = _gen((1,), 4), _Loop()
    running = Running(gen, NoDraft(), loop, 30.0)  # type: ignore[arg-type]
    loop.sink(Event(gen, Chunk((10,), "<10>")))
    loop.sink(Event(gen, Chunk((11,), "<11>")))
    loop.sink(Event(gen, None, done=True, error=RuntimeError("forward failed")))
    stream = iter(running)
    assert next(stream) == Chunk((10, 11), "<10><11>")
    with pytest.raises(RuntimeError, match="forward failed"):
        next(stream)


def test_a_lagging_http_stream_gets_what_waits_as_one_chunk(aio):
    async def collect(running: Running, loop: _Loop, gen: Generation) -> list[Chunk]:
        for event in _events(gen):  # all delivered before the stream reads: it lags
            loop.sink(event)
        await asyncio.sleep(0)  # the LoopSinks' callbacks run (they were scheduled first)
        return [chunk async for chunk in running]

    async def main() -> list[Chunk]:
        gen, loop = _gen((1,), 4), _Loop()
        running = Running(gen, NoDraft(), loop, 30.0, asyncio.get_running_loop())  # type: ignore[arg-type]
        return await collect(running, loop, gen)

    chunks = asyncio.run_coroutine_threadsafe(main(), aio).result(30)
    assert [c.token_ids for c in chunks] == [(10, 11, 12, 13, 14)]
    assert chunks[0].text == "<10><11><12><13><14>"


def test_merged_keeps_one_or_none_as_is():
    one = Chunk((1,), "a")
    assert merged([one]) is one and merged([]) is None
