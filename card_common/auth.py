"""Bearer tokens: who may call which RPC of a service, and the one rule for a presented token.

A service that holds tokens (``card-cache --draft-token T1 --target-token T2``, ``card-target
--api-key K``) checks every call's ``authorization: Bearer <token>`` metadata against the role its
method needs and answers ``UNAUTHENTICATED`` otherwise; methods of no role (grpc.health.v1) stay
open, so probes work. A caller presents its token on every call of its channel (``channel(addr,
token=...)``). card-target's HTTP front checks its ``Authorization`` header by the same rule
(``bearer_matches``). Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import Any

import grpc

# card.v1.CacheService methods by the role that may call them
CACHE_ROLES: dict[str, str] = {
    **{f"/card.v1.CacheService/{m}": "target"
       for m in ("OpenSession", "Step", "StepBatch", "CloseSession", "Status", "Drain",
                 "SetPoolWeights")},
    **{f"/card.v1.CacheService/{m}": "draft"
       for m in ("RegisterDraft", "Commands", "PublishLayers", "Heartbeat")},
}

# card.v1.TargetService methods by role: users (card-target --api-key; the key of its HTTP front)
TARGET_ROLES: dict[str, str] = {f"/card.v1.TargetService/{m}": "user" for m in ("Generate", "Info")}


def bearer(token: str) -> str:
    return f"Bearer {token}"


def bearer_matches(presented: str | bytes, token: str) -> bool:
    """Whether an ``authorization`` value (``Bearer <token>``, the scheme in any case) carries
    ``token``; constant time in the token."""
    if isinstance(presented, str):
        presented = presented.encode(errors="replace")
    scheme, _, given = presented.strip().partition(b" ")
    ok_scheme = scheme.lower() == b"bearer"
    return hmac.compare_digest(given.strip(), token.encode()) and ok_scheme


def _presented(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


class TokenAuth(grpc.ServerInterceptor):
    """Refuse calls to a method of role R without the token of R (``tokens``: role -> token;
    a role without a token is open). ``hints``: role -> what the refusal tells the caller to
    present (default: the ``--R-token`` flag)."""

    def __init__(self, roles: Mapping[str, str], tokens: Mapping[str, str | None],
                 hints: Mapping[str, str] | None = None) -> None:
        self.roles = dict(roles)
        self.expected = {role: t for role, t in tokens.items() if t}
        self.hints = dict(hints or {})

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        role = self.roles.get(details.method)
        want = self.expected.get(role or "")
        if handler is None or want is None:
            return handler
        if bearer_matches(_presented(details.invocation_metadata), want):
            return handler
        hint = self.hints.get(role or "", f"the {role} token (authorization: Bearer ...; --{role}-token)")
        return _refusal(handler, f"{details.method} needs {hint}")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def deny_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # a generator, as a streaming handler must be

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = getattr(base, "compression", None)


class PresentToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", bearer(token))

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _Details(details, [*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
