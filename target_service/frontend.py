"""What every front of card-target does with a request, whatever its wire: gRPC (servicer.py) and
OpenAI-compatible HTTP (openai_api.py) both come here with a ``ValidRequest`` (validation.py).
``Frontend.start`` checks a named draft against the cache's (DraftDirectory), builds the
Generation with its chain source (RemoteCard or NoDraft) and submits it to the engine loop (refused
at once past --max-waiting; its cache session opens when it is admitted to a KV slot). ``Running``
waits for that slot within the call's deadline and --queue-timeout-s (else RESOURCE_EXHAUSTED),
pumps its events to the front, and cancels it when the client goes away (it leaves the batch at the
next iteration; its cache session closes, the draft drops its tree and KV). The engine loop owns
the model; fronts never touch it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator

from card.engine.loading.models import LoadedModel
from card.engine.shared.config import GenerationRequest, Mode
from card.engine.shared.errors import NotFound, ResourceExhausted, Unavailable
from card.engine.target.chain_source import ChainSource, DraftKind, NoDraft
from card.engine.target.generation import Chunk, Generation, GenerationResult
from card.engine.target.scheduler import Event
from card.target_service import metrics
from card.target_service.cache_link import CacheClient, CacheTarget
from card.target_service.config import TargetConfig
from card.target_service.engine_loop import EngineLoop, LoopSink
from card.target_service.remote_card import RemoteCard
from card.target_service.validation import Validator, ValidRequest, check_choices, choice_seed
from card.v1 import cache_pb2_grpc

log = logging.getLogger(__name__)


def merged(chunks: list[Chunk]) -> Chunk | None:
    """Consecutive chunks of one generation as one (None for none)."""
    if len(chunks) <= 1:
        return chunks[0] if chunks else None
    return Chunk(tuple(t for c in chunks for t in c.token_ids), "".join(c.text for c in chunks),
                 tuple(lp for c in chunks for lp in c.logprobs))


class Running:
    """One submitted generation, seen from its front, and the one pump of its events: iterate it
    (a gRPC thread blocks on a queue) or ``async for`` it (the event loop ``aio``, fed by
    ``call_soon_threadsafe``: no thread parked per stream) for its chunks; ``_ended`` is the rule."""

    def __init__(self, gen: Generation, source: ChainSource, loop: EngineLoop, queue_timeout_s: float,
                 aio: asyncio.AbstractEventLoop | None = None) -> None:
        self.gen = gen
        self.source = source
        self.loop = loop
        self.queue_timeout_s = queue_timeout_s
        self.t0 = time.monotonic()
        self._box: queue.Queue[Event] = queue.Queue()
        self._slot = threading.Event()
        self._abox: asyncio.Queue[Event] = asyncio.Queue()
        self._aslot = asyncio.Event()
        if aio is None:
            loop.submit(gen, self._box.put, self._slot.set)
            return

        def admit() -> None:  # on the engine's thread
            aio.call_soon_threadsafe(self._aslot.set)

        # the engine hands every stream of this loop an iteration's events at once (LoopSink)
        loop.submit(gen, LoopSink(aio, self._abox.put_nowait), admit)

    @property
    def admitted(self) -> bool:
        return self.loop.admitted(self.gen)

    @property
    def result(self) -> GenerationResult | None:
        return self.gen.result

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string or stop token id that ended it (None: EOS, the budget, or running)."""
        return self.gen.tracker.stop_reason

    @property
    def serving_draft(self) -> str:
        return self.source.serving_draft if isinstance(self.source, RemoteCard) else ""

    def _wait_s(self, deadline_s: float | None) -> float:
        """How long it may still wait for a KV slot: the call's deadline, --queue-timeout-s."""
        left = max(0.0, self.queue_timeout_s - (time.monotonic() - self.t0))
        return left if deadline_s is None else min(deadline_s, left)

    def wait_admitted(self, deadline_s: float | None) -> None:
        """Block (a gRPC thread) until it has a KV slot or has ended; ``deadline_s``: seconds the
        call may still wait (None: as long as --queue-timeout-s)."""
        if not self._slot.wait(self._wait_s(deadline_s)) and not self.admitted:
            raise self.not_admitted()

    async def admission(self) -> None:
        """``wait_admitted`` on the event loop."""
        try:
            await asyncio.wait_for(self._aslot.wait(), self._wait_s(None))
        except TimeoutError:
            if not self.admitted:
                raise self.not_admitted() from None

    def _ended(self, event: Event) -> bool:
        """The pump's rule, after an event's chunk: an engine error is raised; ``done`` ends it."""
        if event.error is not None:
            raise event.error
        return event.done

    def __iter__(self) -> Iterator[Chunk]:
        """Chunks as they come; a gRPC thread that fell behind the engine (its events waiting in
        the box) sends what waits as one chunk: the same tokens, text and logprobs in order, one
        message and one wake-up instead of several (``merged``)."""
        while True:
            events = [self._box.get()]
            while not (events[-1].done or events[-1].error is not None):
                try:
                    events.append(self._box.get_nowait())
                except queue.Empty:
                    break
            chunk = merged([e.chunk for e in events if e.chunk is not None])
            if chunk is not None:
                yield chunk
            if self._ended(events[-1]):
                return

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        """``__iter__`` on the event loop, waiting events merged alike."""
        while True:
            events = [await self._abox.get()]
            while not (events[-1].done or events[-1].error is not None):
                try:
                    events.append(self._abox.get_nowait())
                except asyncio.QueueEmpty:
                    break
            chunk = merged([e.chunk for e in events if e.chunk is not None])
            if chunk is not None:
                yield chunk
            if self._ended(events[-1]):
                return

    def not_admitted(self) -> ResourceExhausted:
        """The request waited for a KV slot as long as it may: it leaves the queue."""
        self.cancel()
        metrics.REFUSED.labels(code="RESOURCE_EXHAUSTED").inc()
        return ResourceExhausted(
            f"all {self.loop.engine.pool.slots} KV slots stayed busy for {time.monotonic() - self.t0:.1f}s "
            "(the request's deadline or --queue-timeout-s); retry later, or give card-target more KV "
            "cache (--kv-cache-gb, --max-batch-size)")

    def cancel(self) -> None:
        if self.gen.result is None:
            self.loop.cancel(self.gen)

    def finished(self) -> GenerationResult:
        """Count a generation that ended normally in the metrics; its result."""
        result = self.gen.result
        assert result is not None
        stats = result.stats
        metrics.GENERATIONS.labels(mode=stats.mode, finish_reason=result.finish_reason).inc()
        metrics.TOKENS.inc(stats.new_tokens)
        metrics.TOKENS_PER_S.observe(stats.tokens_per_s)
        metrics.LOOSE_KEPT.inc(stats.loose_kept)
        metrics.REJECTION_FALLBACKS.inc(stats.rejection_fallbacks)
        log.info("generation done: %s", stats.summary())
        return result


class Frontend:
    """Registered before the model loads (every call is UNAVAILABLE until ``ready``)."""

    def __init__(self, config: TargetConfig, cache: cache_pb2_grpc.CacheServiceStub | None) -> None:
        self.config = config
        self.cache = cache
        self._validator: Validator | None = None  # at ready: the model and the limits it sets
        self.loop: EngineLoop | None = None
        self.draining = False  # shutdown began: health says so, requests under way finish
        self.link: CacheClient | None = None  # at ready: the sessions need the model's facts

    def ready(self, model: LoadedModel, loop: EngineLoop) -> None:
        template = self.config.chat_template_text
        if template is not None:  # --chat-template over the model's own, before any request reads it
            model.tokenizer.chat_template = template
            log.info("chat template: --chat-template's (%d characters)", len(template))
        # a generation's keys and values live in one KV slot: its rows bound the context
        limits = Validator(model, min(model.context_window, loop.engine.pool.max_len), self.config)
        if self.cache is not None:
            self.link = CacheClient(self.cache, CacheTarget(
                self.config.cache_addr or "", model.name, model.fingerprint, limits.vocab_size,
                limits.context_window, step_timeout_s=self.config.step_timeout_ms / 1000.0,
                default_pool=self.config.default_pool, open_after_prefill=self.config.draft_after_prefill))
        self.loop = loop
        self._validator = limits

    @property
    def is_ready(self) -> bool:
        return self._validator is not None

    @property
    def serving(self) -> bool:
        """Ready, not draining, and the engine's thread alive (health of both fronts)."""
        return self.is_ready and not self.draining and self.loop is not None and self.loop.alive

    @property
    def validator(self) -> Validator:
        """The model and the one check of a request against this target (``Validator.validate``)."""
        if self._validator is None:
            raise Unavailable("the target model is still loading; retry in a moment")
        return self._validator

    @property
    def model(self) -> LoadedModel:
        return self.validator.model

    def start(self, valid: ValidRequest, aio: asyncio.AbstractEventLoop | None = None) -> Running:
        """Submit one generation; its events go to a gRPC thread or, with ``aio``, to that event
        loop (``Running``). Its chain source opens when it is admitted."""
        model, loop, request = self.model, self.loop, valid.generation
        assert loop is not None
        source = self._source(valid.mode, valid.draft, request)
        gen = Generation(request, source, eos_ids=model.eos_ids, decode=model.decode,
                         context_window=self.validator.context_window, mode=valid.mode.value,
                         model_name=model.name,
                         vocab_size=model.model.get_input_embeddings().num_embeddings,
                         grammars=self.validator.grammars,
                         grammar_drafts=valid.mode is not Mode.VANILLA)
        return Running(gen, source, loop, self.config.queue_timeout_s, aio)

    def start_choices(self, valid: ValidRequest, n: int,
                      aio: asyncio.AbstractEventLoop | None = None) -> list[Running]:
        """``n`` independent samples of one request (OpenAI's ``n``): choice i runs with seed
        ``choice_seed(seed, i)``, its own KV slot and cache session; all or none are submitted."""
        check_choices(n)
        started: list[Running] = []
        try:
            for i in range(n):
                request = valid.generation
                sampling = dataclasses.replace(request.sampling, seed=choice_seed(request.sampling.seed, i))
                request = dataclasses.replace(request, sampling=sampling)
                started.append(self.start(dataclasses.replace(valid, generation=request), aio))
        except BaseException:
            for running in started:
                running.cancel()
            raise
        return started

    def _source(self, mode: Mode, draft: str, request: GenerationRequest) -> ChainSource:
        if mode is Mode.VANILLA:
            return NoDraft()
        if self.cache is None:
            if draft:
                raise NotFound(f"draft {draft!r} is not available: this target runs without a cache "
                               "service (start it with --cache HOST:PORT)")
            return NoDraft()
        assert self.link is not None
        if draft:  # refused here, in one line, before it waits for a slot
            self.link.directory.check(draft, self.model.fingerprint, self.model.name)
        # card-auto: the engine's policy chooses between the cache's model-free lookup alone and its
        # worker by measured pace; a drawn chain needs the draft's distributions: its worker only
        auto = mode is Mode.CARD_AUTO and request.chain_draw is None
        drafters = (DraftKind.LOOKUP, DraftKind.WORKER) if auto else (DraftKind.WORKER,)
        return RemoteCard(self.link, draft, request.chain, request.chain_draw, drafters)
