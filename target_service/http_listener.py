"""What stands between a socket and the OpenAI-compatible app: the door (``Guard``: the API key
and the body limit, before the body is read) and uvicorn on its own thread (``HttpServer``)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from card.common.auth import bearer_matches
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import InvalidArgument
from card.target_service.openai_shapes import error_response

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
