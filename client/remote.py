"""Generate through a running card-target, with the same result type as in-process generation.

    result = generate_remote("localhost:50051", "Hello", sampling=SamplingParams(), stop=StopParams())

Failures arrive as ``card.engine.shared.errors`` classes (the one gRPC status table in card.common.status), so
the CLI prints them the same way as local errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from card.common.channels import channel
from card.common.convert import (
    chain_policy_to_msg,
    logprobs_from_msg,
    sampling_to_msg,
    stats_from_msg,
)
from card.common.status import error_from_rpc
from card.common.tensors import ids_from_msg, ids_to_msg
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.config import ChainPolicy, SamplingParams, StopParams
from card.engine.shared.errors import InvalidArgument, Unavailable
from card.engine.target.generation import GenerationResult
from card.v1 import target_pb2, target_pb2_grpc

START_HINT = ("start the services with `card-client up` "
              "(or point --target / CARD_CLIENT_TARGET_ADDR at a running card-target)")
DEFAULT_TIMEOUT_S = 600.0  # a generation's deadline (card-client generate --timeout)


@dataclass
class RemoteGenerationResult(GenerationResult):
    """A GenerationResult plus the draft worker that served the session ("" if none did) and the
    seed the target ran it with (the request's, or the one it drew for a sampled request that set
    none: sent again, it replays the generation)."""

    draft: str = ""
    seed: int = 0

    def to_dict(self) -> dict:
        return {**super().to_dict(), "draft": self.draft, "seed": self.seed}


def build_request(prompt: str | Sequence[int], *, chat: bool | None, sampling: SamplingParams,
                  stop: StopParams, draft: str | None, mode: str, chain: ChainPolicy | None = None,
                  verify: target_pb2.VerifyPolicy | None = None,
                  logprobs: int | None = None) -> target_pb2.GenerateRequest:
    request = target_pb2.GenerateRequest(
        sampling=sampling_to_msg(sampling),
        max_new_tokens=stop.max_new_tokens,
        stop=list(stop.stop),
        ignore_eos=stop.ignore_eos,
        stop_token_ids=list(stop.stop_token_ids),
        include_stop_str_in_output=stop.include_stop_str,
        draft=draft or "",
        mode=mode,
        chat={None: target_pb2.CHAT_AUTO, True: target_pb2.CHAT_ON, False: target_pb2.CHAT_OFF}[chat],
    )
    if chain is not None and not chain.empty:
        request.chain.CopyFrom(chain_policy_to_msg(chain))
    if verify is not None:
        request.verify.CopyFrom(verify)
    if logprobs is not None:
        request.logprobs = logprobs
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_ids.CopyFrom(ids_to_msg(list(prompt)))
    return request


def generate_remote(addr: str, prompt: str | Sequence[int], *, chat: bool | None = None,
                    sampling: SamplingParams | None = None, stop: StopParams | None = None,
                    draft: str | None = None, mode: str = "card", chain: ChainPolicy | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, on_text: Callable[[str], None] | None = None,
                    tls: TlsConfig = PLAINTEXT, api_key: str | None = None,
                    verify: target_pb2.VerifyPolicy | None = None,
                    logprobs: int | None = None) -> RemoteGenerationResult:
    """Stream one generation from the target at ``addr``; ``prompt`` is text or token ids.
    ``api_key``: presented on the call (``authorization: Bearer``), where card-target has one.
    ``verify``: the acceptance rule (``convert.verify_to_msg``; None: exact); ``logprobs``:
    alternatives per token to report in the result's ``logprobs`` (None: none).

    ``on_text`` gets each piece of text as the target commits it. Raises ``card.engine.shared.errors``
    subclasses: Unavailable when the target cannot be reached (naming ``addr``) or misses the
    ``timeout_s`` deadline, InvalidArgument / NotFound / FailedPrecondition as the target says.
    """
    if timeout_s <= 0:
        raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout_s}")
    request = build_request(prompt, chat=chat, sampling=sampling or SamplingParams(),
                            stop=stop or StopParams(), draft=draft, mode=mode, chain=chain,
                            verify=verify, logprobs=logprobs)
    received = False
    try:
        with channel(addr, api_key, tls) as ch:
            stream = target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=timeout_s)
            for message in stream:
                received = True
                if message.WhichOneof("kind") == "chunk":
                    if on_text is not None and message.chunk.text:
                        on_text(message.chunk.text)
                    continue
                final = message.final
                return RemoteGenerationResult(final.text, ids_from_msg(final.token_ids), final.finish_reason,
                                              stats_from_msg(final.stats), logprobs_from_msg(final.logprobs),
                                              draft=final.draft, seed=final.seed)
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.Call) else None
        if code is grpc.StatusCode.UNAVAILABLE and not received:
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            raise Unavailable(f"cannot reach card-target at {addr} ({details}); {START_HINT}") from None
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Unavailable(f"card-target at {addr} did not finish within the {timeout_s:g}s deadline "
                              "(card-client generate --timeout / CARD_CLIENT_TIMEOUT raises it; or ask "
                              "for fewer tokens)") from None
        raise error_from_rpc(err, addr) from None
    raise Unavailable(f"card-target at {addr} ended the stream without a final message")
