"""OpenAI's JSON shapes of a result: whole answers, stream chunks, usage (with the request's
``card`` object), vLLM's ``metrics.speculative_decoding``, logprobs, and errors."""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from card.common.convert import stats_to_json
from card.common.status import http_status
from card.engine.shared.errors import CardError
from card.engine.shared.stats import GenerationStats
from card.engine.target.generation import GenerationResult
from card.engine.target.verify import TokenLogprob

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _error(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None
                   ) -> JSONResponse:
    return JSONResponse(_error(status, message, code, param), status_code=status)


def error_json(exc: BaseException) -> dict:
    return _error(http_status(exc), str(exc), exc.code if isinstance(exc, CardError) else "INTERNAL")


def usage(stats: GenerationStats, draft: str) -> dict:
    """OpenAI's usage, with ``card``: every statistic of this request (card.common.convert's
    one conversion of GenerationStats) and the draft that served it."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
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


class Shape(abc.ABC):
    """How one endpoint's responses look; ``id`` and ``created`` are fixed per request."""

    object_whole = object_chunk = prefix = ""  # prefix: of its ids
    delta_key = whole_key = ""  # where a chunk's delta and a whole answer go in a choice

    def __init__(self, model: str, decode: Callable[[list[int]], str]) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.decode = decode  # a token's text, for logprobs

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: Any, finish: str | None, logprobs: Sequence[TokenLogprob] = ()) -> dict:
        if delta is None:
            return {**self._head(self.object_chunk), "choices": []}
        lp = self._logprobs(logprobs)
        return {**self._head(self.object_chunk),
                "choices": [{"index": 0, self.delta_key: delta, "logprobs": lp, "finish_reason": finish}]}

    def whole(self, result: GenerationResult, draft: str) -> dict:
        return {**self._head(self.object_whole),
                "choices": [{"index": 0, self.whole_key: self.delta(result.text, first=True),
                             "logprobs": self._logprobs(result.logprobs),
                             "finish_reason": FINISH.get(result.finish_reason, "stop")}],
                "usage": usage(result.stats, draft), "metrics": spec_metrics(result.stats)}

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict | None:
        return self.format_logprobs(logprobs) if logprobs else None

    @abc.abstractmethod
    def format_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """OpenAI's logprobs object of this endpoint for ``logprobs``."""

    @abc.abstractmethod
    def delta(self, text: str | None, first: bool = False) -> Any:
        """``text`` as this endpoint's delta (``first``: the one that opens the answer; None:
        the last, which carries only the finish reason)."""


class CompletionShape(Shape):
    object_whole = object_chunk = "text_completion"
    prefix = "cmpl"
    delta_key = whole_key = "text"

    def __init__(self, model: str, decode: Callable[[list[int]], str]) -> None:
        super().__init__(model, decode)
        self.offset = 0  # text_offset runs on across a stream's chunks

    def format_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        tokens = [self.decode([lp.token]) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.decode([t]): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def delta(self, text: str | None, first: bool = False) -> str:
        return text or ""


class ChatShape(Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    prefix = "chatcmpl"
    delta_key, whole_key = "delta", "message"

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def format_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(lp.token, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs],
                "refusal": None}

    def delta(self, text: str | None, first: bool = False) -> dict:
        if text is None:
            return {}
        return {"role": "assistant", "content": text} if first else {"content": text}
