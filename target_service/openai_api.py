"""OpenAI-compatible HTTP front of card-target (``--http-port``): the routes of its FastAPI app.
Request bodies: openai_schemas.py; answers: openai_shapes.py; streaming: openai_stream.py; the
door (--api-key, --max-body-mb) and the listener (uvicorn, TLS): http_listener.py.

    GET  /v1/models              the served model
    POST /v1/completions         raw text (or token ids) in, text out
    POST /v1/chat/completions    a conversation through the model's chat template
    GET  /health                 200 once the model serves; 503 before, and once shutdown begins
    GET  /metrics                Prometheus, the same registry as --metrics-port (--no-http-metrics: off)

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

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from card.common.status import http_status
from card.engine.shared.errors import CardError
from card.target_service import metrics
from card.target_service.frontend import Frontend, Running
from card.target_service.http_listener import DEFAULT_MAX_BODY_BYTES, Guard
from card.target_service.openai_schemas import ChatBody, CompletionBody
from card.target_service.openai_shapes import ChatShape, CompletionShape, Shape, error_json, error_response
from card.target_service.openai_stream import sse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 429 (no KV slot) or a 503 (draining, loading) asks a client to wait
_STARTED = int(time.time())


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
        return JSONResponse(error_json(exc), status_code=status, headers=retry)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # a bug, not the caller's fault: logged with its traceback, answered in OpenAI's shape
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_json(exc), status_code=500)

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
                                            "owned_by": "card",
                                            "max_model_len": front.validator.context_window}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        return await _serve(front, body, request, CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        return await _serve(front, body, request, ChatShape)

    return app


async def _serve(front: Frontend, body: CompletionBody | ChatBody, request: Request,
                 kind: type[Shape]) -> Any:
    valid = await asyncio.to_thread(body.valid, front.validator)  # tokenizing: off the event loop
    shape = kind(front.model.name, front.model.decode)
    running = await asyncio.to_thread(front.start, valid, asyncio.get_running_loop())
    watcher = asyncio.create_task(_cancel_on_disconnect(request, running))
    # no response starts before the request has a slot: past --queue-timeout-s it is a 429 with
    # Retry-After, streaming or not, and leaves nothing behind (its session opens at admission)
    try:
        await running.admission()
    except BaseException:
        watcher.cancel()
        running.cancel()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse(running, watcher, shape, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        async for _ in running:
            pass
    finally:
        watcher.cancel()
        running.cancel()
    if running.result is None:  # cancelled: the client is gone, nobody reads this
        return error_response(499, "client closed the request")
    return shape.whole(running.finished(), running.draft_name)


async def _cancel_on_disconnect(request: Request, running: Running) -> None:
    """The client went away: end the generation now (between two forwards), not at its next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            running.cancel()
            return

