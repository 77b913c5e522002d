"""HTTP request metrics of card-target's OpenAI-compatible front: a pure ASGI middleware that
counts every request by route template, method and status (``card_target_http_requests_total``)
and times it to its response's end, a stream's included (``card_target_http_request_duration_seconds``),
as prometheus-fastapi-instrumentator does for vLLM's server.

Labels are bounded: ``handler`` is the path template of the route that serves the request (the
app's own routes, a fixed set), or ``none`` for a path no route knows, never the raw URL; ``method``
is one of HTTP's methods or ``other``; ``status`` a status code this server sends. Probes and
scrapes (``EXCLUDED``) are not counted, as in vLLM.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.routing import BaseRoute, Match

from card.target_service import metrics

UNMATCHED = "none"  # prometheus-fastapi-instrumentator's handler for a path no route serves
EXCLUDED = frozenset({"/metrics", "/health"})
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


def route_template(routes: list[BaseRoute], scope: dict) -> str:
    """The path template of the route that serves ``scope`` (a path that some route serves with
    another method, answered 405, is that route's), else ``UNMATCHED``."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(getattr(route, "path", UNMATCHED))
        if match is Match.PARTIAL and partial is None:
            partial = str(getattr(route, "path", UNMATCHED))
    return partial or UNMATCHED


class HttpMetrics:
    """Outermost middleware (added last), so that what the ``Guard`` refuses (401, 413) counts too.
    ``routes``: the app's route list (``app.router.routes``, read at each request: routes are
    added after the middleware)."""

    def __init__(self, app: Any, routes: list[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in EXCLUDED:
            await self.app(scope, receive, send)
            return
        handler = route_template(self.routes, scope)
        method = scope["method"] if scope["method"] in METHODS else "other"
        status = 0
        t0 = time.perf_counter()

        async def watched(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            # no response started: the app raised, or returned without one (uvicorn answers 500)
            metrics.HTTP_REQUESTS.labels(handler, method, str(status or 500)).inc()
            metrics.HTTP_DURATION.labels(handler, method).observe(time.perf_counter() - t0)
