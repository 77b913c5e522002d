"""OpenAI's JSON shapes of a result, built as the ``openai`` package's own types (ChatCompletion,
ChatCompletionChunk, Completion): whole answers, stream chunks, usage (with the request's ``card``
object), vLLM's ``metrics.speculative_decoding``, logprobs, and errors. Beside OpenAI's fields
(extra fields the types keep): ``seed`` on every answer and chunk (the seed the request ran
with, drawn by the server where it set none: sent back, it replays the answer exactly), and
vLLM's ``stop_reason`` on each finished choice (the stop string or stop token id that ended it,
None for EOS and the budget)."""

from __future__ import annotations

import abc
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from openai import BaseModel as OpenAIModel
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from card.common.convert import stats_to_json
from card.common.status import http_status
from card.engine.shared.errors import CardError
from card.engine.shared.stats import GenerationStats
from card.engine.target.generation import GenerationResult
from card.engine.target.verify import TokenLogprob
from card.target_service.tools import CallStream, Tool, parse_calls

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _error(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None
                   ) -> JSONResponse:
    return JSONResponse(_error(status, message, code, param), status_code=status)


def error_json(exc: BaseException) -> dict:
    return _error(http_status(exc), str(exc), exc.code if isinstance(exc, CardError) else "INTERNAL")


def combined(stats: Sequence[GenerationStats]) -> GenerationStats:
    """The statistics of a request's n choices as one: counters and per-forward lists add up
    (the histogram per position), the prompt is counted once, times are the longest (the
    request's), the settings are the first choice's (every choice has the same)."""
    if len(stats) == 1:
        return stats[0]
    first, out = stats[0], dataclasses.replace(stats[0])
    for f in dataclasses.fields(GenerationStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name in ("mode", "verify", "speculation", "prompt_tokens", "cached_tokens"):
            continue
        if f.name == "exact":
            out.exact = all(values)
        elif f.name in ("wall_s", "prefill_s"):
            setattr(out, f.name, max(values))
        elif f.name == "acceptance_histogram":
            width = max(map(len, values))
            out.acceptance_histogram = [sum(h[j] for h in values if j < len(h)) for j in range(width)]
        elif isinstance(getattr(first, f.name), list):
            setattr(out, f.name, [x for v in values for x in v])
        else:
            setattr(out, f.name, sum(values))
    return out


def usage(stats: GenerationStats, draft: str, completion_tokens: int | None = None) -> dict:
    """OpenAI's usage, with ``card``: every statistic of this request (card.common.convert's
    one conversion of GenerationStats; n > 1: ``combined``) and the draft that served it."""
    new = stats.new_tokens if completion_tokens is None else completion_tokens
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": new,
            "total_tokens": stats.prompt_tokens + new,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "card": {**stats_to_json(stats), "draft": draft}}


def spec_metrics(stats: GenerationStats) -> dict:
    """vLLM's per-request ``metrics.speculative_decoding`` (what AIPerf reads): steps are the
    verifications of a drafted chain; the histogram is dense, [j] = steps that kept j drafted
    tokens. No ``num_spec_tokens``: card's chains have no fixed length."""
    steps, kept, drafted = stats.spec_steps, stats.accepted_draft_tokens, stats.draft_tokens
    return {"speculative_decoding": {
        "mean_acceptance_length": round(1.0 + kept / steps, 6) if steps else 1.0,
        "draft_acceptance_rate": round(kept / drafted, 6) if drafted else 0.0,
        "acceptance_histogram": list(stats.acceptance_histogram) or [0],
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": kept,
    }}


@dataclasses.dataclass(frozen=True)
class Finished:
    """One choice's end: its result and what stopped it (vLLM's ``stop_reason``)."""

    result: GenerationResult
    stop_reason: str | int | None = None

    @property
    def finish_reason(self) -> str:
        return FINISH.get(self.result.finish_reason, "stop")


class Shape(abc.ABC):
    """How one endpoint's responses look; ``id``, ``created`` and ``seed`` are fixed per request;
    ``n`` choices, indexed from 0."""

    whole_type: type[OpenAIModel]
    chunk_type: type[OpenAIModel]
    prefix = ""  # of its ids

    def __init__(self, model: str, decode: Callable[[list[int]], str], seed: int, n: int = 1) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seed = seed
        self.decode = decode  # a token's text, for logprobs
        self.offsets = [0] * n  # completions' text_offset runs on across a choice's chunks

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "seed": self.seed}

    @staticmethod
    def _dump(answer: OpenAIModel) -> dict:
        return answer.model_dump(mode="json", exclude_unset=True)

    def whole(self, choices: Sequence[Finished], draft: str) -> dict:
        stats = combined([c.result.stats for c in choices])
        # a choice's own shape may say why it finished (tool calls)
        body = {**self._head(self.whole_object),
                "choices": [{"index": i, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                             **self.whole_choice(i, c.result.text, c.result.logprobs)}
                            for i, c in enumerate(choices)],
                "usage": usage(stats, draft), "metrics": spec_metrics(stats)}
        return self._dump(self.whole_type.model_validate(body))

    def chunk(self, index: int, text: str, *, first: bool = False, finish: Finished | None = None,
              logprobs: Sequence[TokenLogprob] = (), extra: dict | None = None) -> dict:
        """A stream chunk of choice ``index``: ``text`` (``first``: the chunk that opens the
        answer), and with ``finish`` its end; ``extra``: fields beside the choices (usage so far,
        the acceptance object)."""
        choice: dict[str, Any] = {"index": index, **self.delta(text, first),
                                  "logprobs": self._logprobs(index, logprobs),
                                  "finish_reason": None if finish is None else finish.finish_reason}
        if finish is not None:
            choice["stop_reason"] = finish.stop_reason
        return self._dump(self.make_chunk({**self._head(self.chunk_object), "choices": [choice],
                                           **(extra or {})}))

    def usage_chunk(self, stats: GenerationStats, draft: str) -> dict:
        """The chunk after the last choice ended when the request asked for the usage
        (``stream_options.include_usage``): no choices, the usage and vLLM's acceptance object."""
        return self._dump(self.make_chunk({**self._head(self.chunk_object), "choices": [],
                                           "usage": usage(stats, draft), "metrics": spec_metrics(stats)}))

    def make_chunk(self, body: dict) -> OpenAIModel:
        return self.chunk_type.model_validate(body)

    def _logprobs(self, index: int, logprobs: Sequence[TokenLogprob]) -> dict | None:
        return self.format_logprobs(index, logprobs) if logprobs else None

    whole_object = chunk_object = ""

    @abc.abstractmethod
    def whole_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict:
        """A whole answer's choice: its text and logprobs."""

    @abc.abstractmethod
    def format_logprobs(self, index: int, logprobs: Sequence[TokenLogprob]) -> dict:
        """OpenAI's logprobs object of this endpoint for ``logprobs`` of choice ``index``."""

    @abc.abstractmethod
    def delta(self, text: str, first: bool) -> dict:
        """``text`` as this endpoint's part of a chunk's choice (``first``: the one that opens
        the answer)."""


class CompletionShape(Shape):
    whole_type = chunk_type = Completion
    whole_object = chunk_object = "text_completion"
    prefix = "cmpl"

    def whole_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict:
        return {"text": text, "logprobs": self._logprobs(index, logprobs)}

    def make_chunk(self, body: dict) -> OpenAIModel:
        # OpenAI's stream says finish_reason null until a choice ends; Completion, written for
        # whole answers, admits no null there: built as the openai client reads a chunk, unchecked
        return Completion.construct(**body)

    def format_logprobs(self, index: int, logprobs: Sequence[TokenLogprob]) -> dict:
        tokens = [self.decode([lp.token]) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.decode([t]): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def delta(self, text: str, first: bool) -> dict:
        return {"text": text}


class ChatShape(Shape):
    """Chat answers; with ``tools`` (a request whose tool_choice is not none: ``use_tools``), the
    text's Hermes call blocks come back as ``tool_calls`` (finish_reason ``tool_calls``), whole
    or as stream deltas (target_service.tools)."""

    whole_type, chunk_type = ChatCompletion, ChatCompletionChunk
    whole_object, chunk_object = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"
    def __init__(self, model: str, decode: Callable[[list[int]], str], seed: int, n: int = 1) -> None:
        super().__init__(model, decode, seed, n)
        self.tools: list[Tool] = []
        self._streams: list[CallStream] = []

    def use_tools(self, tools: list[Tool]) -> None:
        self.tools = tools
        self._streams = [CallStream(tools) for _ in self.offsets]

    def whole_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict:
        out: dict[str, Any] = {"message": {"role": "assistant", "content": text},
                               "logprobs": self._logprobs(index, logprobs)}
        if self.tools:
            content, calls = parse_calls(text, self.tools)
            if calls:
                out["message"] = {"role": "assistant", "content": content,
                                  "tool_calls": [c.as_json() for c in calls]}
                out["finish_reason"] = "tool_calls"
        return out

    def chunk(self, index: int, text: str, *, first: bool = False, finish: Finished | None = None,
              logprobs: Sequence[TokenLogprob] = (), extra: dict | None = None) -> dict:
        if not self.tools:
            return super().chunk(index, text, first=first, finish=finish, logprobs=logprobs, extra=extra)
        stream = self._streams[index]
        content, calls = stream.feed(text)
        if finish is not None:
            content += stream.finish()
        delta: dict[str, Any] = self.delta(content, first)["delta"]
        if calls:
            delta["tool_calls"] = calls
        reason = None
        if finish is not None:
            reason = "tool_calls" if stream.calls else finish.finish_reason
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": self._logprobs(index, logprobs),
                                  "finish_reason": reason}
        if finish is not None:
            choice["stop_reason"] = finish.stop_reason
        return self._dump(self.make_chunk({**self._head(self.chunk_object), "choices": [choice],
                                           **(extra or {})}))

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def format_logprobs(self, index: int, logprobs: Sequence[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(lp.token, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs],
                "refusal": None}

    def delta(self, text: str, first: bool) -> dict:
        return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
