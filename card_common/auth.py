"""Bearer tokens: who may call which RPC of a service, and the one rule for a presented token.

A service that holds tokens (``card-cache --draft-token T1 --target-token T2 --operator-token T3``,
``card-target --api-key K``) checks every call's ``authorization: Bearer <token>`` metadata
against the roles its method accepts and answers ``UNAUTHENTICATED`` otherwise, before the
request message is read (card.common.gate.refusal); methods of no role (grpc.health.v1) stay open,
so probes work. A caller presents its token on every call of its channel (``channel(addr,
token=...)``). card-target's HTTP front checks its ``Authorization`` header by the same rule
(``bearer_matches``). Tokens are compared in constant time and never logged.

The cache's roles: a *target* opens and steps sessions; a *draft* registers and publishes trees;
an *operator* drains workers and sets pool weights (card-client drafts drain / resume / weights).
Status, read-only, takes the target's or the operator's token (a target lists the drafts with it;
card-client status and drafts show it). A role without a token is open, except the operator's
where the target's is set: a cache that guards its sessions does not let every target pod drain
its drafts, so Drain and SetPoolWeights are then refused until ``--operator-token`` is set.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection, Mapping
from typing import Any

import grpc

from card.common.gate import refusal

Roles = tuple[str, ...]

# card.v1.CacheService methods by the roles whose token may call them
CACHE_ROLES: dict[str, Roles] = {
    **{f"/card.v1.CacheService/{m}": ("target",)
       for m in ("OpenSession", "Step", "StepBatch", "CloseSession")},
    "/card.v1.CacheService/Status": ("target", "operator"),
    **{f"/card.v1.CacheService/{m}": ("operator",) for m in ("Drain", "SetPoolWeights")},
    **{f"/card.v1.CacheService/{m}": ("draft",)
       for m in ("RegisterDraft", "Commands", "PublishLayers", "Heartbeat")},
}

# card.v1.TargetService methods by role: users (card-target --api-key; the key of its HTTP front)
TARGET_ROLES: dict[str, Roles] = {f"/card.v1.TargetService/{m}": ("user",) for m in ("Generate", "Info")}


def cache_tokens(draft: str | None, target: str | None, operator: str | None
                 ) -> tuple[dict[str, str | None], set[str]]:
    """The cache's (tokens by role, closed roles): the operator's role is closed when the
    target's has a token and it has none (see the module's docstring)."""
    closed = {"operator"} if target and not operator else set()
    return {"draft": draft, "target": target, "operator": operator}, closed


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
    """Refuse calls to a method without the token of one of its roles (``roles``: method ->
    roles; ``tokens``: role -> token). A role without a token is open, unless it is in ``closed``:
    then its methods are refused whatever is presented (unless another of their roles lets the
    call through). ``hints``: role -> what the refusal tells the caller to present (default: the
    ``--R-token`` flag). A refused call never reaches the handler: its message is not read."""

    def __init__(self, roles: Mapping[str, Roles], tokens: Mapping[str, str | None],
                 hints: Mapping[str, str] | None = None, closed: Collection[str] = ()) -> None:
        self.roles = dict(roles)
        self.expected = {role: t for role, t in tokens.items() if t}
        self.closed = frozenset(closed)
        self.hints = dict(hints or {})

    def allows(self, method: str, metadata: Any) -> bool:
        roles = self.roles.get(method)
        if roles is None:
            return True
        if any(r not in self.expected and r not in self.closed for r in roles):
            return True  # an open role
        presented = _presented(metadata)
        # every token compared (constant time in which one matches)
        matches = [bearer_matches(presented, self.expected[r]) for r in roles if r in self.expected]
        return any(matches)

    def hint(self, role: str) -> str:
        if role in self.closed:
            return (f"the {role} token, which this server does not have: it refuses these calls until "
                    f"it is started with --{role}-token")
        return self.hints.get(role, f"the {role} token (authorization: Bearer ...; --{role}-token)")

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if self.allows(details.method, details.invocation_metadata):
            return continuation(details)
        roles = self.roles[details.method]
        hint = " or ".join([self.hint(r) for r in roles if r not in self.closed]
                           or [self.hint(r) for r in roles])
        return refusal(grpc.StatusCode.UNAUTHENTICATED, f"{details.method} needs {hint}")


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
