"""TargetService: card.v1 messages <-> the front's engine types, and nothing else.

Every Generate call is parsed once into a ``GenerationRequest`` and handed to the front
(card.target_service.frontend), which submits it to the one engine loop: all live generations share
one forward per iteration. A request waits for a free KV slot until its deadline (then
RESOURCE_EXHAUSTED); a client that cancels or passes its deadline ends its generation within one
forward. The output is the target's own whatever the chain source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from card.common.convert import chain_policy_from_msg, logprobs_to_msg, sampling_from_msg, stats_to_msg
from card.common.status import grpc_errors, status_code
from card.common.tensors import ids_from_msg, ids_to_msg
from card.engine.shared.config import GenerationRequest, SamplingParams
from card.engine.shared.errors import CardError, InvalidArgument
from card.target_service import metrics
from card.target_service.frontend import Frontend, Prompt
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
                                     context_window=self.front.context_window,
                                     has_chat_template=model.has_chat_template)

    @grpc_errors
    def Generate(self, request: target_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[target_pb2.GenerateResponse]:
        try:
            running = self.front.start(self._parse(request), request.mode or "card", request.draft)
        except CardError as exc:
            metrics.REFUSED.labels(code=status_code(exc).name).inc()
            raise
        # the call ended (client cancelled, deadline passed, stream closed): stop within a forward
        context.add_callback(running.cancel)
        try:
            while True:
                event = running.next_event(context.time_remaining())
                if event.chunk is not None and (event.chunk.token_ids or event.chunk.text):
                    yield target_pb2.GenerateResponse(chunk=target_pb2.Chunk(
                        token_ids=event.chunk.token_ids, text=event.chunk.text,
                        logprobs=logprobs_to_msg(event.chunk.logprobs)))
                if event.error is not None:
                    raise event.error
                if event.done:
                    break
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
        ))

    def _parse(self, request: target_pb2.GenerateRequest) -> GenerationRequest:
        if request.chat not in _CHAT:
            raise InvalidArgument(f"unknown chat mode {request.chat}")
        which = request.WhichOneof("input")
        prompt: Prompt
        if which == "prompt":
            prompt = request.prompt
        elif which == "messages":
            prompt = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not prompt:
                raise InvalidArgument("the conversation has no messages")
        elif which == "prompt_ids":
            if request.prompt_ids.shape:  # the length first: millions of ids are never listed
                self.front.check_length(request.prompt_ids.shape[0])
            prompt = ids_from_msg(request.prompt_ids)
        else:
            raise InvalidArgument("the request has no prompt: set prompt, messages or prompt_ids")
        prompt_ids = self.front.prompt_ids(prompt, _CHAT[request.chat])
        sampling = sampling_from_msg(request.sampling) if request.HasField("sampling") else SamplingParams()
        chain = chain_policy_from_msg(request.chain) if request.HasField("chain") else None
        v = request.verify
        verify = self.front.verify_policy(
            v.mode, v.entropy_threshold if v.HasField("entropy_threshold") else None,
            v.window if v.HasField("window") else None)
        logprobs = request.logprobs if request.HasField("logprobs") else None
        return self.front.request(prompt_ids, sampling, request.max_new_tokens or None, request.stop,
                                  request.ignore_eos, chain, verify, logprobs)
