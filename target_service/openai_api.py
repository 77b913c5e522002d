"""OpenAI-compatible HTTP front of card-target (``--http-port``): FastAPI on uvicorn.

    GET  /v1/models              the served model
    POST /v1/completions         raw text (or token ids) in, text out
    POST /v1/chat/completions    a conversation through the model's chat template
    GET  /health                 200 once the model serves; 503 before, and once shutdown begins
    GET  /metrics                Prometheus, the same registry as --metrics-port (--no-http-metrics: off)

The door (``Guard``) comes before FastAPI reads a byte of a body: with ``--api-key``, every path
but /health needs ``Authorization: Bearer <key>`` (401 otherwise), and a body over
``--max-body-mb`` gets 413 (at once by its Content-Length, or as soon as a chunked body passes
it). ``--http-tls-cert/--http-tls-key`` serve HTTPS, renewed files within a second.

``stream: true`` answers with server-sent events in OpenAI's chunk shapes, then ``data: [DONE]``;
``stream_options.include_usage`` adds the usage chunk. Every request's ``usage`` carries a ``card``
object (this request's mode, draft, target forwards, drafted and accepted tokens, mean accepted
length, hit rate, its acceptance rule and whether it is lossy), and every answer vLLM's per-request
``metrics.speculative_decoding`` (on the usage chunk when streaming, else on the last chunk), the
object AIPerf reads. ``logprobs`` (completions: 0-20 alternatives; chat: ``logprobs`` with
``top_logprobs`` <= 20) come in OpenAI's shapes, streaming or not: the target's own log-probabilities
of each token, the same in every mode. Fields that would change the output and are not served here
(``n > 1``, tools, penalties, ``logit_bias``, ...) are refused with 400 in OpenAI's error shape,
never ignored; so is any field this server does not know.
Extensions: ``mode`` ("card", "card-auto": the model-free lookup or the draft, whichever is faster for
the request, or "vanilla"), ``draft`` (a draft pool, or a worker name), ``top_k``,
``ignore_eos``, ``verify`` ("exact", the default; "rejection": speculative sampling, the target's
distribution but not plain decoding's tokens for the seed; or "loose": FLy, lossy) with
``verify_entropy_threshold`` and ``verify_window``.

Defaults follow OpenAI's API, not card-client's: ``temperature`` 1.0 and ``top_p`` 1.0; ``seed``
makes sampling reproducible (default 0). A client that disconnects ends its generation within one
target forward, prefill included; its cache session and draft state go with it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from card.common.auth import bearer_matches
from card.common.status import http_status
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.config import GenerationRequest, SamplingParams
from card.engine.shared.errors import CardError, InvalidArgument, NotFound
from card.engine.shared.stats import GenerationStats
from card.engine.target.generation import GenerationResult
from card.engine.target.scheduler import Event
from card.engine.target.verify import TokenLogprob
from card.target_service import metrics
from card.target_service.frontend import Frontend, Running

log = logging.getLogger(__name__)

_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


# ---- request bodies -------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take; unknown fields are an error (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; never changes output
    # extensions
    mode: Literal["card", "card-auto", "vanilla"] = "card"
    draft: str = ""
    top_k: int | None = None
    ignore_eos: bool = False
    verify: Literal["exact", "rejection", "loose"] = "exact"
    verify_entropy_threshold: float | None = None  # loose: FLy's gate (the server's by default)
    verify_window: int | None = None  # loose: FLy's deferred window (the server's by default)

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to report, or None for no logprobs."""
        return None

    def refusals(self) -> list[str]:
        out = []
        if self.n not in (None, 1):
            out.append("n > 1")
        if self.presence_penalty:
            out.append("presence_penalty")
        if self.frequency_penalty:
            out.append("frequency_penalty")
        if self.logit_bias:
            out.append("logit_bias")
        return out


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def refusals(self) -> list[str]:
        out = super().refusals()
        if self.echo:
            out.append("echo")
        if self.best_of not in (None, 1):
            out.append("best_of > 1")
        if self.suffix:
            out.append("suffix")
        return out

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 alone asks for nothing, as vLLM reads it
            raise InvalidArgument("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusals(self) -> list[str]:
        out = super().refusals()
        if self.tools or self.tool_choice not in (None, "none"):
            out.append("tools")
        if self.response_format and self.response_format.get("type") != "text":
            out.append("response_format")
        return out


# ---- errors in OpenAI's shape ---------------------------------------------------------------
def _error(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None
                   ) -> JSONResponse:
    return JSONResponse(_error(status, message, code, param), status_code=status)


def _error_json(exc: BaseException) -> dict:
    return _error(http_status(exc), str(exc), exc.code if isinstance(exc, CardError) else "INTERNAL")


def _unauthorized() -> JSONResponse:
    return error_response(401, "a valid API key is required (Authorization: Bearer <key>)",
                          code="invalid_api_key")


# ---- the door: the key and the body limit, before the body is read ---------------------------
OPEN_PATHS = frozenset({"/health"})  # probes: no key
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
RETRY_AFTER_S = 1  # what a 429 (no KV slot) or a 503 (draining, loading) asks a client to wait


class _BodyTooLarge(Exception):
    """A chunked body passed the limit while the app read it."""


class Guard:
    """A pure ASGI middleware in front of the app: with ``api_key``, a request to any path but
    ``OPEN_PATHS`` without ``Authorization: Bearer <key>`` is answered 401 from its headers alone;
    a body over ``max_body_bytes`` is answered 413, at once when its Content-Length says so, or as
    soon as a chunked body passes the limit while the app reads it (never more than the limit is
    held). Neither response reads the rest of the body: uvicorn drains and drops it."""

    def __init__(self, app: Any, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> JSONResponse:
        return error_response(413, f"request body over {self.max_body_bytes / 2**20:g} MB, the most this "
                                   "server takes (card-target --max-body-mb)", code="request_too_large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())  # the last of a repeated header wins
        if self.api_key and scope["path"] not in OPEN_PATHS \
                and not bearer_matches(headers.get(b"authorization", b""), self.api_key):
            await _unauthorized()(scope, receive, send)
            return
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = 0  # uvicorn refuses a malformed Content-Length before an app sees it
        if length > self.max_body_bytes:
            await self._too_large()(scope, receive, send)
            return
        received, over, started = 0, False, False

        async def counted() -> dict:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    over = True
                    raise _BodyTooLarge
            return message

        async def guarded(message: dict) -> None:
            nonlocal started
            if over:
                return  # whatever the app makes of the cut body; the 413 goes below
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(_BodyTooLarge):  # FastAPI makes it a 400 first: dropped above
            await self.app(scope, counted, guarded)
        if over and not started:
            await self._too_large()(scope, receive, send)


# ---- the app --------------------------------------------------------------------------------
def create_app(front: Frontend, api_key: str | None = None, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, serve_metrics: bool = True) -> FastAPI:
    """The OpenAI-compatible app behind its ``Guard`` (``api_key``, ``max_body_bytes``);
    ``serve_metrics``: /metrics (behind the key when there is one)."""
    app = FastAPI(title="card-target", description="OpenAI-compatible API of a CARD target",
                  docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        if first.get("type") == "extra_forbidden":
            message = f"unsupported field {where!r}: card-target does not serve it"
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, code="invalid_request", param=where or None)

    @app.exception_handler(CardError)
    async def _card_error(request: Request, exc: CardError) -> JSONResponse:
        metrics.REFUSED.labels(code=exc.code).inc()
        status = http_status(exc)
        # refused for load (no KV slot: 429) or not serving now (503): a client may come back
        retry = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
        return JSONResponse(_error_json(exc), status_code=status, headers=retry)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # a bug, not the caller's fault: logged with its traceback, answered in OpenAI's shape
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return JSONResponse(_error_json(exc), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if front.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if front.is_ready and not front.serving:  # the engine's thread died
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if front.is_ready:
            return JSONResponse({"status": "ok", "model": front.model.name})
        return JSONResponse({"status": "loading"}, status_code=503)

    if serve_metrics:
        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        model = front.model
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": _STARTED,
                                            "owned_by": "card", "max_model_len": front.context_window}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument("one prompt per request (a batch of prompts is n requests)")
            prompt = prompt[0]
        gen_request = await asyncio.to_thread(_request, front, body, prompt, False, body.max_tokens)
        shape = _CompletionShape(front.model.name, front.model.decode)
        return await _serve(front, body, gen_request, request, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                    for m in body.messages]
        budget = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        gen_request = await asyncio.to_thread(_request, front, body, messages, True, budget)
        shape = _ChatShape(front.model.name, front.model.decode)
        return await _serve(front, body, gen_request, request, shape)

    return app


_STARTED = int(time.time())


def _request(front: Frontend, body: _Common, prompt: Any, chat: bool,
             budget: int | None) -> GenerationRequest:
    refused = body.refusals()
    if refused:
        raise InvalidArgument(f"{', '.join(refused)}: not served by card-target (it would change the output)")
    if body.model != front.model.name:
        raise NotFound(f"model {body.model!r} is not served here; GET /v1/models lists {front.model.name!r}")
    if isinstance(body.stop, str):
        stop: tuple[str, ...] = (body.stop,)
    else:
        stop = tuple(body.stop or ())
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed or 0,
    )
    logprobs = body.logprobs_wanted()
    verify = front.verify_policy(body.verify, body.verify_entropy_threshold, body.verify_window)
    ids = front.prompt_ids(prompt, chat)
    return front.request(ids, sampling, budget, stop, body.ignore_eos, verify=verify, logprobs=logprobs)


async def _serve(front: Frontend, body: _Common, gen_request: GenerationRequest, request: Request,
                 shape: _Shape) -> Any:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:  # on the engine's thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    admitted = loop.create_future()

    def on_admit() -> None:  # on the engine's thread: it has a KV slot, or it ended
        loop.call_soon_threadsafe(lambda: admitted.done() or admitted.set_result(None))

    running = await asyncio.to_thread(front.start, gen_request, body.mode, body.draft, sink, on_admit)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, running))
    # no response starts before the request has a slot: past --queue-timeout-s it is a 429 with
    # Retry-After, streaming or not, and leaves nothing behind (its session opens at admission)
    try:
        await asyncio.wait_for(asyncio.shield(admitted), front.config.queue_timeout_s)
    except TimeoutError:
        if not running.admitted:
            watcher.cancel()
            raise running.not_admitted() from None
    except BaseException:
        watcher.cancel()
        running.cancel()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(running, events, watcher, shape, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        while True:
            event = await events.get()
            if event.error is not None:
                raise event.error
            if event.done:
                break
    finally:
        watcher.cancel()
        running.cancel()
    if running.result is None:  # cancelled: the client is gone, nobody reads this
        return error_response(499, "client closed the request")
    result = running.finished()
    return shape.whole(result, running.serving_draft)


async def _cancel_on_disconnect(request: Request, running: Running) -> None:
    """The client went away: end the generation now (between two forwards), not at its next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            running.cancel()
            return


async def _sse(running: Running, events: asyncio.Queue[Event], watcher: asyncio.Task, shape: _Shape,
               include_usage: bool) -> AsyncIterator[str]:
    logprobs: list[TokenLogprob] = []  # of tokens whose text is held back (a possible stop string)
    try:
        yield _data(shape.chunk(shape.first_delta(), None))
        while True:
            event = await events.get()
            if event.chunk is not None:
                logprobs += event.chunk.logprobs
                if event.chunk.text:
                    yield _data(shape.chunk(shape.delta(event.chunk.text), None, logprobs))
                    logprobs = []
            if event.error is not None:
                yield _data(_error_json(event.error))
                break
            if event.done:
                if running.result is None:
                    return  # cancelled
                result = running.finished()
                # the acceptance object rides once: on the usage chunk, else on the last chunk
                last = shape.chunk(shape.last_delta(), _FINISH.get(result.finish_reason, "stop"), logprobs)
                if not include_usage:
                    last["metrics"] = spec_metrics(result.stats)
                yield _data(last)
                if include_usage:
                    yield _data({**shape.chunk(None, None), "choices": [],
                                 "usage": usage(result.stats, running.serving_draft),
                                 "metrics": spec_metrics(result.stats)})
                break
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        running.cancel()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(stats: GenerationStats, draft: str) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "card": {  # speculation, visible per request
            "mode": stats.mode,
            "draft": draft,
            "target_forwards": stats.target_forwards,
            "draft_tokens": stats.draft_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "hit_rate": round(stats.hit_rate, 4),
            "verify": stats.verify,
            # loose: the tokens are not plain decoding's, by this request's choice
            "lossy": stats.lossy,
            "loose_kept_tokens": stats.loose_kept,
            # rejection: chains verified exactly for want of the draft's distributions
            "rejection_fallbacks": stats.rejection_fallbacks,
            # the speculation controller: steps decoded with this request's drafting paused
            "speculation": stats.speculation,
            "drafting_paused_steps": stats.drafting_paused_steps,
            "drafting_pauses": stats.drafting_pauses,
        },
    }


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


# ---- response shapes ------------------------------------------------------------------------
class _Shape(abc.ABC):
    """How one endpoint's responses look; ``id`` and ``created`` are fixed per request."""

    object_whole = ""
    object_chunk = ""

    def __init__(self, model: str, prefix: str, decode: Callable[[list[int]], str]) -> None:
        self.model = model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.decode = decode  # a token's text, for logprobs

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: Any, finish: str | None, logprobs: Sequence[TokenLogprob] = ()) -> dict:
        choices = [] if delta is None else [self.choice_chunk(delta, finish, self._logprobs(logprobs))]
        return {**self._head(self.object_chunk), "choices": choices}

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict | None:
        return self.format_logprobs(logprobs) if logprobs else None

    @abc.abstractmethod
    def format_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """OpenAI's logprobs object of this endpoint for ``logprobs``."""

    @abc.abstractmethod
    def choice_chunk(self, delta: Any, finish: str | None, logprobs: dict | None) -> dict: ...

    @abc.abstractmethod
    def first_delta(self) -> Any: ...

    @abc.abstractmethod
    def delta(self, text: str) -> Any: ...

    @abc.abstractmethod
    def last_delta(self) -> Any: ...

    @abc.abstractmethod
    def whole(self, result: GenerationResult, draft: str) -> dict: ...


class _CompletionShape(_Shape):
    object_whole = object_chunk = "text_completion"

    def __init__(self, model: str, decode: Callable[[list[int]], str]) -> None:
        super().__init__(model, "cmpl", decode)
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

    def choice_chunk(self, delta: str, finish: str | None, logprobs: dict | None) -> dict:
        return {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}

    def first_delta(self) -> str:
        return ""

    def delta(self, text: str) -> str:
        return text

    def last_delta(self) -> str:
        return ""

    def whole(self, result: GenerationResult, draft: str) -> dict:
        return {**self._head(self.object_whole),
                "choices": [{"index": 0, "text": result.text, "logprobs": self._logprobs(result.logprobs),
                             "finish_reason": _FINISH.get(result.finish_reason, "stop")}],
                "usage": usage(result.stats, draft), "metrics": spec_metrics(result.stats)}


class _ChatShape(_Shape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, model: str, decode: Callable[[list[int]], str]) -> None:
        super().__init__(model, "chatcmpl", decode)

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def format_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(lp.token, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs],
                "refusal": None}

    def choice_chunk(self, delta: dict, finish: str | None, logprobs: dict | None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def first_delta(self) -> dict:
        return {"role": "assistant", "content": ""}

    def delta(self, text: str) -> dict:
        return {"content": text}

    def last_delta(self) -> dict:
        return {}

    def whole(self, result: GenerationResult, draft: str) -> dict:
        return {**self._head(self.object_whole),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": self._logprobs(result.logprobs),
                             "finish_reason": _FINISH.get(result.finish_reason, "stop")}],
                "usage": usage(result.stats, draft), "metrics": spec_metrics(result.stats)}


# ---- the listener ---------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn, plus a look at the TLS files once a second (on the event loop's thread, which runs
    every handshake)."""

    def __init__(self, config: uvicorn.Config, reload_tls: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.reload_tls = reload_tls

    async def on_tick(self, counter: int) -> bool:
        if self.reload_tls is not None and counter % 10 == 0:
            self.reload_tls()
        return await super().on_tick(counter)


class HttpServer:
    """uvicorn on its own thread, on a socket bound here (so port 0 gives the OS-chosen port);
    HTTPS when ``tls`` serves (its certificate and key, followed when they are renewed)."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float,
                 tls: TlsConfig = PLAINTEXT) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(2048)  # connections queue from now on, not refused until uvicorn runs
        except OSError as exc:
            self.sock.close()
            raise InvalidArgument(f"cannot serve HTTP on {host}:{port} ({exc.strerror or exc}); choose "
                                  "another --http-port") from None
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=int(grace_s), ssl_certfile=tls.cert,
                                ssl_keyfile=tls.key)
        config.load()  # builds the ssl context here, so that the reloader holds the one uvicorn serves
        reload_tls = tls.reloader(config.ssl) if config.ssl is not None else None
        self.server = _Server(config, reload_tls)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop accepting; requests under way get ``grace_s`` to finish."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
