"""What every front of card-target does with a request, whatever its wire: gRPC (servicer.py) and
OpenAI-compatible HTTP (openai_api.py) both come here with engine types.

    prompt_ids(prompt, chat)        text, a conversation or token ids -> validated token ids
    request(ids, sampling, stop)    -> a GenerationRequest that fits this target (context window,
                                       sampling and chain values checked)
    start(request, mode, draft)     a named draft checked against the cache's (DraftDirectory),
                                       the Generation built with its chain source (RemoteCard or
                                       NoDraft) and submitted to the engine loop, which refuses it
                                       at once past --max-waiting; its cache session opens when it
                                       is admitted to a KV slot, never before
    Running.next_event(timeout)     its events, in order; a request that is not admitted (no free
                                       KV slot) before its deadline or --queue-timeout-s gets
                                       RESOURCE_EXHAUSTED
    Running.cancel()                the client went away or its deadline passed: the generation
                                       leaves the batch at the next iteration, its cache session
                                       closes and the draft drops its tree and KV

The engine loop owns the model; fronts never touch it.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence

from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    ChainPolicy,
    GenerationRequest,
    Mode,
    SamplingParams,
    StopParams,
    TreeParams,
    Verify,
    VerifyPolicy,
)
from card.engine.shared.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from card.engine.target.chain_source import ChainSource, DraftKind, NoDraft
from card.engine.target.generation import Generation, GenerationResult, check_prompt
from card.engine.target.scheduler import Event
from card.target_service import metrics
from card.target_service.cache_link import CacheClient, CacheTarget
from card.target_service.config import TargetConfig
from card.target_service.engine_loop import EngineLoop
from card.target_service.remote_card import RemoteCard
from card.v1 import cache_pb2_grpc

log = logging.getLogger(__name__)

SERVED_MODES = (Mode.CARD, Mode.CARD_AUTO, Mode.VANILLA)

_NO_DEADLINE_S = 10 * 365 * 86400.0

Prompt = str | Sequence[dict] | Sequence[int]  # text, a conversation ({role, content}), token ids


class Running:
    """One submitted generation, seen from its front."""

    def __init__(self, gen: Generation, source: ChainSource, loop: EngineLoop,
                 sink: Callable[[Event], None] | None, queue_timeout_s: float | None = None,
                 on_admit: Callable[[], None] | None = None) -> None:
        self.gen = gen
        self.source = source
        self.loop = loop
        self.queue_timeout_s = queue_timeout_s
        self.t0 = time.monotonic()
        self._box: queue.Queue[Event] | None = None if sink else queue.Queue()
        loop.submit(gen, sink or self._box.put, on_admit)  # type: ignore[union-attr]

    @property
    def admitted(self) -> bool:
        return self.loop.admitted(self.gen)

    @property
    def result(self) -> GenerationResult | None:
        return self.gen.result

    @property
    def serving_draft(self) -> str:
        return self.source.serving_draft if isinstance(self.source, RemoteCard) else ""

    def next_event(self, deadline_s: float | None) -> Event:
        """The next event (blocking; without a sink). ``deadline_s``: seconds this request may
        still wait for a KV slot (None: as long as it takes)."""
        assert self._box is not None, "events go to the sink given at start"
        if deadline_s is not None and deadline_s > _NO_DEADLINE_S:
            deadline_s = None  # gRPC reports a call without a deadline as ~forever, past what a wait takes
        if self.queue_timeout_s is not None:
            waited = time.monotonic() - self.t0
            left = max(0.0, self.queue_timeout_s - waited)
            deadline_s = left if deadline_s is None else min(deadline_s, left)
        while True:
            try:
                return self._box.get(timeout=None if self.admitted else deadline_s)
            except queue.Empty:
                if self.admitted:
                    continue
                raise self.not_admitted() from None

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
        metrics.DRAFT_TOKENS.inc(stats.draft_tokens)
        metrics.ACCEPTED_DRAFT_TOKENS.inc(stats.accepted_draft_tokens)
        metrics.LOOSE_KEPT.inc(stats.loose_kept)
        metrics.REJECTION_FALLBACKS.inc(stats.rejection_fallbacks)
        log.info("generation done: %s", stats.summary())
        return result


class Frontend:
    """Registered before the model loads (every call is UNAVAILABLE until ``ready``)."""

    def __init__(self, config: TargetConfig, cache: cache_pb2_grpc.CacheServiceStub | None) -> None:
        self.config = config
        self.cache = cache
        self._model: LoadedModel | None = None
        self.loop: EngineLoop | None = None
        self.vocab_size = 0
        self.context_window = 0
        self.draining = False  # shutdown began: health says so, requests under way finish
        self.link: CacheClient | None = None  # at ready: the sessions need the model's facts

    def ready(self, model: LoadedModel, loop: EngineLoop) -> None:
        self.vocab_size = int(getattr(model.model.config, "vocab_size", 0) or 0)
        # a generation's keys and values live in one KV slot: its rows bound the context
        self.context_window = min(model.context_window, loop.engine.pool.max_len)
        if self.cache is not None:
            self.link = CacheClient(self.cache, CacheTarget(
                self.config.cache_addr or "", model.name, model.fingerprint, self.vocab_size,
                self.context_window, step_timeout_s=self.config.step_timeout_ms / 1000.0,
                default_pool=self.config.default_pool))
        self.loop = loop
        self._model = model

    @property
    def is_ready(self) -> bool:
        return self._model is not None

    @property
    def serving(self) -> bool:
        """Ready, not draining, and the engine's thread alive (health of both fronts)."""
        return self.is_ready and not self.draining and self.loop is not None and self.loop.alive

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise Unavailable("the target model is still loading; retry in a moment")
        return self._model

    def prompt_ids(self, prompt: Prompt, chat: bool | None) -> list[int]:
        """Token ids of a text (chat template per ``chat``: None = the model's default), a
        conversation (template on unless ``chat`` is False) or ids (checked against the vocabulary)."""
        if isinstance(prompt, str):
            return self.model.encode_prompt(prompt, chat)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return self.model.encode_prompt(items, True if chat is None else chat)
        if not items:
            raise InvalidArgument("the prompt is empty")
        self.check_length(len(items))  # before any per-id work
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise InvalidArgument("a prompt is text, a list of messages, or a list of token ids")
        bad = [t for t in items if t < 0 or (self.vocab_size and t >= self.vocab_size)]
        if bad:
            raise InvalidArgument(f"the prompt holds {len(bad)} token id(s) outside the vocabulary "
                                  f"[0, {self.vocab_size}), e.g. {bad[0]}")
        return items

    def check_length(self, tokens: int) -> None:
        """InvalidArgument when a prompt of ``tokens`` tokens leaves no room for a new one."""
        model = self.model
        if tokens >= self.context_window and self.context_window < model.context_window:
            raise InvalidArgument(
                f"the prompt has {tokens} tokens but this card-target holds {self.context_window} "
                f"tokens per request (--max-model-len; the context window of {model.name} is "
                f"{model.context_window}); room is needed for at least one new token")
        if tokens >= self.context_window:
            check_prompt(range(tokens), self.context_window, model.name)

    def verify_policy(self, mode: str = "", entropy_threshold: float | None = None,
                      window: int | None = None) -> VerifyPolicy:
        """A request's acceptance rule, the server's FLy settings where it sets none; a loose
        request is refused here when this server does not allow it (--no-allow-loose)."""
        verify = Verify.parse(mode)
        if verify is Verify.LOOSE and not self.config.allow_loose:
            raise InvalidArgument("verify loose (lossy) is not allowed on this server (--no-allow-loose); "
                                  "ask for verify exact")
        c = self.config
        threshold = c.loose_entropy_threshold if entropy_threshold is None else entropy_threshold
        return VerifyPolicy(verify, threshold, c.loose_window if window is None else window)

    def request(self, prompt_ids: Sequence[int], sampling: SamplingParams, max_new_tokens: int | None,
                stop: Sequence[str] = (), ignore_eos: bool = False, chain: ChainPolicy | None = None,
                verify: VerifyPolicy | None = None, logprobs: int | None = None) -> GenerationRequest:
        model = self.model
        self.check_length(len(prompt_ids))
        check_prompt(prompt_ids, self.context_window, model.name)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InvalidArgument(f"the token budget must be >= 1, got {max_new_tokens}")
        chain = chain or ChainPolicy()
        chain.over(TreeParams())  # refuse bad values here, not at the cache mid-request
        budget = StopParams(max_new_tokens or self.config.default_max_new_tokens, tuple(stop), ignore_eos)
        return GenerationRequest(tuple(prompt_ids), sampling, budget, chain, verify or VerifyPolicy(),
                                 logprobs)

    def start(self, request: GenerationRequest, mode: str, draft: str = "",
              sink: Callable[[Event], None] | None = None, on_admit: Callable[[], None] | None = None,
              ) -> Running:
        """Submit one generation. Events go to ``sink`` (called on the engine's thread) or,
        without one, to ``Running.next_event``; ``on_admit`` is called (on the engine's thread)
        once it has a KV slot or has ended. Its chain source opens when it is admitted."""
        parsed = Mode.parse(mode, SERVED_MODES, " (sd runs in-process only: card-client generate "
                            "--inprocess --mode sd)")
        model, loop = self.model, self.loop
        assert loop is not None
        source = self._source(parsed, draft, request)
        gen = Generation(request, source, eos_ids=model.eos_ids, decode=model.decode,
                         context_window=self.context_window, mode=parsed.value, model_name=model.name,
                         vocab_size=model.model.get_input_embeddings().num_embeddings)
        return Running(gen, source, loop, sink, self.config.queue_timeout_s, on_admit)

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
