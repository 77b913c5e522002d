"""OpenAI-compatible HTTP front of card-target (``--http-port``): the routes of its FastAPI app.

    GET  /v1/models              the served model
    POST /v1/completions         raw text (or token ids) in, text out
    POST /v1/chat/completions    a conversation through the model's chat template
    POST /tokenize               vLLM's: a prompt or a conversation -> {count, max_model_len, tokens}
    POST /detokenize             vLLM's: {tokens} -> {prompt}
    GET  /health                 200 once the model serves; 503 before, and once shutdown begins
    GET  /metrics                Prometheus, the same registry as --metrics-port (--no-http-metrics: off)

Request bodies (OpenAI's fields and defaults, card's extensions): openai_schemas.py. Answers
(``usage.card``, vLLM's ``metrics.speculative_decoding``, logprobs, errors): openai_shapes.py.
``stream: true``: openai_stream.py. Every answer carries the seed it ran with (``seed``, and the
``x-card-seed`` header). Here: the door (``Guard``: --api-key, --max-body-mb, before a
body is read), the listener (``HttpServer``: uvicorn on its thread, --http-tls-cert) and the
routes. No response starts before the request has a KV slot; a client that disconnects ends its
generation within one target forward, prefill included, and its cache session and draft state go
with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse

from card.common.auth import bearer_matches
from card.common.status import http_status
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import CardError, InvalidArgument
from card.target_service import metrics
from card.target_service.frontend import Frontend, Running
from card.target_service.http_limits import BoundedH11
from card.target_service.http_metrics import HttpMetrics
from card.target_service.openai_schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from card.target_service.openai_shapes import (
    ChatShape,
    CompletionShape,
    Finished,
    Shape,
    error_json,
    error_response,
)
from card.target_service.openai_stream import PING_S, serving_drafts, sse
from card.target_service.validation import Validator, check_template_kwargs

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 429 (no KV slot) or a 503 (draining, loading) asks a client to wait
SEED_HEADER = "x-card-seed"  # the seed a request ran with (its own, or the fresh one it was given)
_STARTED = int(time.time())


# ---- the door: the key and the body limit, before the body is read ---------------------------
OPEN_PATHS = frozenset({"/health"})  # probes: no key
DEFAULT_MAX_BODY_BYTES = 4 * 2**20


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
            await error_response(401, "a valid API key is required (Authorization: Bearer <key>)",
                                 code="invalid_api_key")(scope, receive, send)
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


# ---- the listener ---------------------------------------------------------------------------
# How long a TLS connection the server closes waits for the client's close_notify. asyncio's
# default is 30 s, which an idle pooled client (any OpenAI client between requests) never sends:
# on SIGTERM such a connection held the shutdown for the whole grace although nothing was running.
TLS_CLOSE_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn, plus a look at the TLS files once a second (on the event loop's thread, which runs
    every handshake), and TLS connections that close within TLS_CLOSE_S."""

    def __init__(self, config: uvicorn.Config, reload_tls: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.reload_tls = reload_tls

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's create_server takes no ssl_shutdown_timeout: hand it one, for this call only
        # (the loop is asyncio's: HttpServer's Config says so)
        loop = asyncio.get_running_loop()
        create = loop.create_server

        async def create_server(*args: Any, **kwargs: Any) -> asyncio.Server:
            if kwargs.get("ssl") is not None:
                kwargs["ssl_shutdown_timeout"] = TLS_CLOSE_S
            return await create(*args, **kwargs)

        loop.create_server = create_server  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server

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
        # BoundedH11: a request arrives whole within its deadline, and open connections are capped
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", loop="asyncio",
                                timeout_graceful_shutdown=int(grace_s), ssl_certfile=tls.cert,
                                ssl_keyfile=tls.key, http=BoundedH11)
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


# ---- the routes -----------------------------------------------------------------------------
def create_app(front: Frontend, api_key: str | None = None, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, serve_metrics: bool = True) -> FastAPI:
    """The OpenAI-compatible app behind its ``Guard`` (``api_key``, ``max_body_bytes``);
    ``serve_metrics``: /metrics (behind the key when there is one)."""
    app = FastAPI(title="card-target", description="OpenAI-compatible API of a CARD target",
                  docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(HttpMetrics, routes=app.router.routes)  # outermost: the Guard's refusals count

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
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
        window = front.validator.context_window
        # every served name (the reported one first), each the same model, as vllm serve lists them
        return {"object": "list", "data": [{"id": name, "object": "model", "created": _STARTED,
                                            "owned_by": "card", "max_model_len": window}
                                           for name in front.config.accepted_names(front.model.name)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        return await _serve(front, body, request, CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        return await _serve(front, body, request, ChatShape)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        return await asyncio.to_thread(_tokenize, front.validator, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        return await asyncio.to_thread(_detokenize, front.validator, body)

    return app


def _tokenize(validator: Validator, body: TokenizeBody) -> dict:
    """vLLM's /tokenize: the ids a prompt (raw text) or a conversation (the chat template, with its
    generation prompt and ``chat_template_kwargs``) reads as; ``count``, and the most a request
    holds (``max_model_len``)."""
    body.check_model(validator)
    model = validator.model
    if (body.prompt is None) == (body.messages is None):
        raise InvalidArgument("tokenize takes a prompt or messages (one of them)")
    if body.messages is not None:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                    for m in body.messages]
        ids = model.encode_prompt(messages, True, check_template_kwargs(body.chat_template_kwargs))
    else:
        ids = list(model.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    out: dict[str, Any] = {"count": len(ids), "max_model_len": validator.context_window, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = model.tokenizer.convert_ids_to_tokens(ids)
    return out


def _detokenize(validator: Validator, body: DetokenizeBody) -> dict:
    """vLLM's /detokenize: the text of token ids, as a generation's text reads (special tokens
    skipped)."""
    body.check_model(validator)
    validator.check_vocab("tokens", body.tokens)
    return {"prompt": validator.model.decode(body.tokens)}


async def _serve(front: Frontend, body: CompletionBody | ChatBody, request: Request,
                 kind: type[Shape]) -> Any:
    valid = await asyncio.to_thread(body.valid, front.validator)  # tokenizing: off the event loop
    seed = valid.generation.sampling.seed  # the request's, or the fresh one it was given
    shape = kind(front.model.name, front.model.decode, seed, body.choices)
    if isinstance(body, ChatBody) and isinstance(shape, ChatShape):
        use, functions = body.tool_use()
        if use != "none":  # auto reads calls out of the text; required's grammar writes them
            shape.use_tools(functions)
    runnings = await asyncio.to_thread(front.start_choices, valid, body.choices, asyncio.get_running_loop())
    watcher = asyncio.create_task(_cancel_on_disconnect(request, runnings))
    # no response starts before the request has its slots: past --queue-timeout-s it is a 429 with
    # Retry-After, streaming or not, and leaves nothing behind (a session opens at admission)
    admissions = [asyncio.ensure_future(r.admission()) for r in runnings]
    try:
        await asyncio.gather(*admissions)
    except BaseException:
        _settle(admissions)
        _end(watcher, runnings)
        raise
    headers = {SEED_HEADER: str(seed)}
    if body.stream:
        return EventSourceResponse(sse(runnings, watcher, shape, include_usage=body.include_usage,
                                       continuous_usage=body.continuous_usage),
                                   headers=headers, ping=PING_S, sep="\n")
    drains = [asyncio.ensure_future(_drain(r)) for r in runnings]
    try:
        await asyncio.gather(*drains)
    finally:
        _settle(drains)
        _end(watcher, runnings)
    if any(r.result is None for r in runnings):  # cancelled: the client is gone, nobody reads this
        return error_response(499, "client closed the request")
    answer = shape.whole([Finished(r.finished(), r.stop_reason) for r in runnings], serving_drafts(runnings))
    return JSONResponse(answer, headers=headers)


async def _drain(running: Running) -> None:
    async for _ in running:
        pass


def _settle(tasks: Sequence[asyncio.Future[None]]) -> None:
    """The first of the choices' tasks failed: cancel the others, and take any error they also
    ended with (the first one is the answer's)."""
    for task in tasks:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()


def _end(watcher: asyncio.Task[None], runnings: list[Running]) -> None:
    watcher.cancel()
    for running in runnings:
        running.cancel()


async def _cancel_on_disconnect(request: Request, runnings: list[Running]) -> None:
    """The client went away: end its generations now (between two forwards), not at their next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for running in runnings:
                running.cancel()
            return

