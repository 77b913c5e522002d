"""Client channels with the shared options, and waiting for a peer to be SERVING."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from card.common.auth import PresentToken
from card.common.serving import MAX_MESSAGE_BYTES
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import Unavailable

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # keep idle long-lived streams (draft commands) alive through NATs and proxies, and notice a
    # dead peer within ~40 s even when nothing is sent
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # reconnect quickly after a peer restarts (default backoff grows to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


def channel(addr: str, token: str | None = None, tls: TlsConfig = PLAINTEXT) -> grpc.Channel:
    """A channel to ``addr`` ("host:port"); with ``token``, every call presents it
    (``authorization: Bearer``, card.common.auth); TLS when ``tls`` dials with it (card.common.tls)."""
    if tls.dials:
        ch = grpc.secure_channel(addr, tls.channel_credentials(), options=[*CHANNEL_OPTIONS,
                                                                            *tls.channel_options()])
    else:
        ch = grpc.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
    return grpc.intercept_channel(ch, PresentToken(token)) if token else ch


def warn_if_cleartext(addr: str, token: str | None, tls: TlsConfig, what: str) -> None:
    """One warning at start when a token would cross a network in clear (TLS off, peer not loopback)."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    if token and not tls.dials and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("the %s token goes to %s without TLS: anyone on the path can read it (--tls-ca)",
                    what, addr)


def health_status(addr: str, service: str = "", timeout_s: float = 2.0, tls: TlsConfig = PLAINTEXT) -> str:
    """The peer's health status name ("SERVING", "NOT_SERVING", ...); raises grpc.RpcError."""
    with channel(addr, tls=tls) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_serving(addr: str, timeout_s: float = 30.0, service: str = "", tls: TlsConfig = PLAINTEXT) -> None:
    """Poll the health service of ``addr`` until SERVING; Unavailable after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with channel(addr, tls=tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"{addr} is not serving after {timeout_s:g}s (last: {last})")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=max(0.05, min(2.0, remaining)))
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as err:
                last = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.Call) else str(err)
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
