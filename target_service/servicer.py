"""TargetService: validate, tokenize, hand the generation to the engine, stream its chunks.

Every Generate call builds an ``engine.generate.Generation`` and submits it to the one engine
loop (target_service.engine_loop), which runs all live generations in one forward per iteration.
A request waits for a free KV slot until its deadline (then RESOURCE_EXHAUSTED); a client that
cancels or goes away ends its generation within one forward. The chain source is ``RemoteCard``
(mode card, cache configured) or ``NoDraft`` (mode vanilla, or no cache): the output is the
target's own either way.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator

import grpc

from card.v1 import cache_pb2_grpc, target_pb2, target_pb2_grpc
from card_common.convert import chain_policy_from_msg, sampling_from_msg, stats_to_msg
from card_common.status import grpc_errors, status_code
from card_common.tensors import ids_from_msg, ids_to_msg
from engine.chain_source import ChainSource
from engine.config import ChainPolicy, GenerationRequest, SamplingParams, StopParams, TreeParams
from engine.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from engine.generate import Generation, check_prompt
from engine.loading.models import LoadedModel
from engine.sources import NoDraft
from target_service import metrics
from target_service.config import TargetConfig
from target_service.engine_loop import EngineLoop
from target_service.remote_card import RemoteCard

log = logging.getLogger(__name__)

MODES = ("card", "vanilla")
_CHAT = {target_pb2.CHAT_AUTO: None, target_pb2.CHAT_ON: True, target_pb2.CHAT_OFF: False}


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Registered before the model loads (calls get UNAVAILABLE until ``ready``)."""

    def __init__(self, config: TargetConfig, cache: cache_pb2_grpc.CacheServiceStub | None) -> None:
        self.config = config
        self.cache = cache
        self._model: LoadedModel | None = None
        self.loop: EngineLoop | None = None
        self.vocab_size = 0
        self.context_window = 0

    def ready(self, model: LoadedModel, loop: EngineLoop) -> None:
        self.vocab_size = int(getattr(model.model.config, "vocab_size", 0) or 0)
        # a generation's keys and values live in one KV slot: its rows bound the context
        self.context_window = min(model.context_window, loop.engine.pool.max_len)
        self.loop = loop
        self._model = model

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise Unavailable("the target model is still loading; retry in a moment")
        return self._model

    # ---- RPCs --------------------------------------------------------------------------------
    @grpc_errors
    def Info(self, request: target_pb2.InfoRequest, context: grpc.ServicerContext) -> target_pb2.TargetInfo:
        return target_pb2.TargetInfo(model=self.model.name, tokenizer_fingerprint=self.model.fingerprint,
                                     context_window=self.context_window,
                                     has_chat_template=self.model.has_chat_template)

    @grpc_errors
    def Generate(self, request: target_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[target_pb2.GenerateResponse]:
        try:
            gen_request, mode = self._parse(request)
        except (InvalidArgument, Unavailable) as exc:
            metrics.REFUSED.labels(code=status_code(exc).name).inc()
            raise
        model, loop = self.model, self.loop
        assert loop is not None
        source = self._source(mode, request.draft, gen_request.chain)
        gen = Generation(model.model, gen_request, source, eos_ids=model.eos_ids, decode=model.decode,
                         context_window=self.context_window, mode=mode, model_name=model.name)
        gen.open()  # the cache session opens here, off the engine's loop (NOT_FOUND etc. raise here)
        box = loop.submit(gen)
        context.add_callback(lambda: loop.cancel(gen))  # the client went away: stop within a forward
        t0 = time.monotonic()
        try:
            while True:
                try:
                    event = box.get(timeout=None if loop.admitted(gen) else context.time_remaining())
                except queue.Empty:
                    if loop.admitted(gen):
                        continue
                    loop.cancel(gen)
                    metrics.REFUSED.labels(code="RESOURCE_EXHAUSTED").inc()
                    raise ResourceExhausted(
                        f"all {loop.engine.pool.slots} KV slots stayed busy for {time.monotonic() - t0:.1f}s "
                        "(the request's deadline); retry later, or give card-target more KV cache "
                        "(--kv-cache-gb, --max-batch-size)") from None
                if event.chunk is not None and (event.chunk.token_ids or event.chunk.text):
                    yield target_pb2.GenerateResponse(chunk=target_pb2.Chunk(
                        token_ids=event.chunk.token_ids, text=event.chunk.text))
                if event.error is not None:
                    raise event.error
                if event.done:
                    break
        finally:
            if gen.result is None:
                loop.cancel(gen)
        if not context.is_active():
            log.info("client went away; generation stopped")
            return
        result = gen.result
        assert result is not None
        stats = result.stats
        metrics.GENERATIONS.labels(mode=mode, finish_reason=result.finish_reason).inc()
        metrics.TOKENS.inc(stats.new_tokens)
        metrics.TOKENS_PER_S.observe(stats.tokens_per_s)
        log.info("generation done: %s", stats.summary())
        yield target_pb2.GenerateResponse(final=target_pb2.Final(
            finish_reason=result.finish_reason, text=result.text,
            token_ids=ids_to_msg(result.token_ids), stats=stats_to_msg(stats),
            draft=source.draft_name if isinstance(source, RemoteCard) else "",
        ))

    # ---- helpers -----------------------------------------------------------------------------
    def _parse(self, request: target_pb2.GenerateRequest) -> tuple[GenerationRequest, str]:
        mode = request.mode or "card"
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)}, got {mode!r} "
                                  "(sd runs in-process only: card-client generate --inprocess --mode sd)")
        if request.chat not in _CHAT:
            raise InvalidArgument(f"unknown chat mode {request.chat}")
        chat = _CHAT[request.chat]
        which = request.WhichOneof("input")
        if which == "prompt":
            prompt_ids = self.model.encode_prompt(request.prompt, chat)
        elif which == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not messages:
                raise InvalidArgument("the conversation has no messages")
            prompt_ids = self.model.encode_prompt(messages, True if chat is None else chat)
        elif which == "prompt_ids":
            prompt_ids = ids_from_msg(request.prompt_ids)
            bad = [t for t in prompt_ids if t < 0 or (self.vocab_size and t >= self.vocab_size)]
            if bad:
                raise InvalidArgument(f"prompt_ids holds {len(bad)} id(s) outside the vocabulary "
                                      f"[0, {self.vocab_size}), e.g. {bad[0]}")
        else:
            raise InvalidArgument("the request has no prompt: set prompt, messages or prompt_ids")
        if len(prompt_ids) >= self.context_window and self.context_window < self.model.context_window:
            raise InvalidArgument(
                f"the prompt has {len(prompt_ids)} tokens but this card-target holds {self.context_window} "
                f"tokens per request (--max-model-len; the context window of {self.model.name} is "
                f"{self.model.context_window}); room is needed for at least one new token")
        check_prompt(prompt_ids, self.context_window, self.model.name)
        sampling = sampling_from_msg(request.sampling) if request.HasField("sampling") else SamplingParams()
        stop = StopParams(request.max_new_tokens or self.config.default_max_new_tokens,
                          tuple(request.stop), request.ignore_eos)
        chain = chain_policy_from_msg(request.chain) if request.HasField("chain") else ChainPolicy()
        chain.over(TreeParams())  # refuse bad values here, not at the cache mid-request
        return GenerationRequest(tuple(prompt_ids), sampling, stop, chain), mode

    def _source(self, mode: str, draft: str, chain: ChainPolicy) -> ChainSource:
        if mode == "vanilla":
            return NoDraft()
        if self.cache is None:
            if draft:
                raise NotFound(f"draft {draft!r} is not available: this target runs without a cache "
                               "service (start it with --cache HOST:PORT)")
            return NoDraft()
        return RemoteCard(self.cache, cache_addr=self.config.cache_addr or "", target_model=self.model.name,
                          fingerprint=self.model.fingerprint, draft=draft, chain=chain,
                          step_timeout_s=self.config.step_timeout_ms / 1000.0)
