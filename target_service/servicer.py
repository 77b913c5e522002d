"""TargetService: card.v1 messages <-> the front's engine types, and nothing else.

Every Generate call is read once into ``Validator.validate`` (``valid_request``) and the proven
request handed to the front (card.target_service.frontend), which submits it to the one engine
loop: all live generations share one forward per iteration. A request waits for a free KV slot
until its deadline (then RESOURCE_EXHAUSTED); a client that cancels or passes its deadline ends
its generation within one forward. The output is the target's own whatever the chain source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from card.common.convert import chain_policy_from_msg, logprobs_to_msg, sampling_from_msg, stats_to_msg
from card.common.status import grpc_errors, status_code
from card.common.tensors import ids_array_from_msg, ids_to_msg
from card.engine.shared.errors import CardError, InvalidArgument
from card.target_service import metrics
from card.target_service.frontend import Frontend
from card.target_service.validation import Prompt, Validator, ValidRequest
from card.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

_CHAT = {target_pb2.CHAT_AUTO: None, target_pb2.CHAT_ON: True, target_pb2.CHAT_OFF: False}


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, front: Frontend) -> None:
        self.front = front

    @grpc_errors
    def Info(self, request: target_pb2.InfoRequest, context: grpc.ServicerContext) -> target_pb2.TargetInfo:
        model = self.front.model
        return target_pb2.TargetInfo(model=model.name, tokenizer_fingerprint=model.fingerprint,
                                     context_window=self.front.validator.context_window,
                                     has_chat_template=model.has_chat_template)

    @grpc_errors
    def Generate(self, request: target_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[target_pb2.GenerateResponse]:
        try:
            running = self.front.start(valid_request(request, self.front.validator))
        except CardError as exc:
            metrics.REFUSED.labels(code=status_code(exc).name).inc()
            raise
        # the call ended (client cancelled, deadline passed, stream closed): stop within a forward
        context.add_callback(running.cancel)
        try:
            running.wait_admitted(context.time_remaining())
            for chunk in running:
                if chunk.token_ids or chunk.text:
                    yield target_pb2.GenerateResponse(chunk=target_pb2.Chunk(
                        token_ids=chunk.token_ids, text=chunk.text, logprobs=logprobs_to_msg(chunk.logprobs)))
        finally:
            running.cancel()
        if not context.is_active():
            log.info("client went away; generation stopped")
            return
        result = running.finished()
        yield target_pb2.GenerateResponse(final=target_pb2.Final(
            finish_reason=result.finish_reason, text=result.text,
            token_ids=ids_to_msg(result.token_ids), stats=stats_to_msg(result.stats),
            draft=running.serving_draft, logprobs=logprobs_to_msg(result.logprobs),
            seed=running.gen.request.sampling.seed,
        ))


def valid_request(request: target_pb2.GenerateRequest, validator: Validator) -> ValidRequest:
    """A GenerateRequest's fields read into the one validation (card.target_service.validation)."""
    if request.chat not in _CHAT:
        raise InvalidArgument(f"unknown chat mode {request.chat}")
    which = request.WhichOneof("input")
    prompt: Prompt
    if which == "prompt":
        prompt = request.prompt
    elif which == "messages":
        prompt = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    elif which == "prompt_ids":
        prompt = ids_array_from_msg(request.prompt_ids)  # not listed: millions of ids are counted first
    else:
        raise InvalidArgument("the request has no prompt: set prompt, messages or prompt_ids")
    v = request.verify
    return validator.validate(
        prompt, chat=_CHAT[request.chat],
        # an unset message reads as the defaults: greedy, the cache's chain settings
        sampling=sampling_from_msg(request.sampling), chain=chain_policy_from_msg(request.chain),
        # 0: the rest of the context (within --max-tokens-cap)
        max_new_tokens=request.max_new_tokens or None, stop=request.stop, ignore_eos=request.ignore_eos,
        verify=v.mode, entropy_threshold=v.entropy_threshold if v.HasField("entropy_threshold") else None,
        window=v.window if v.HasField("window") else None,
        logprobs=request.logprobs if request.HasField("logprobs") else None,
        mode=request.mode or "card", draft=request.draft,
        seeded=request.sampling.HasField("seed"),  # unset: a fresh seed, sent back in Final.seed
        stop_token_ids=tuple(request.stop_token_ids), include_stop_str=request.include_stop_str_in_output)
