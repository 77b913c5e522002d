"""Client channels with the shared options, and waiting for a peer to be SERVING."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from card.common.auth import PresentToken
from card.common.serving import MAX_MESSAGE_BYTES
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import InvalidArgument, Unavailable

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
    (``authorization: Bearer``, card.common.auth); TLS when ``tls`` dials with it (card.common.tls),
    with the TLS files as they are at each call (``RenewingChannel``)."""
    ch: grpc.Channel
    if tls.dials:
        ch = RenewingChannel(addr, tls, [*CHANNEL_OPTIONS, *tls.channel_options()])
    else:
        ch = grpc.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
    return grpc.intercept_channel(ch, PresentToken(token)) if token else ch


# Channels a RenewingChannel keeps open after TLS renewals, for calls that began on them; an older
# one is closed (a renewal is a file change: cert-manager's come weeks apart, and a long stream on
# a channel eight renewals old is reconnected by its owner, as after any broken link).
MAX_RETIRED = 8


class RenewingChannel(grpc.Channel):
    """A TLS channel whose credentials follow its files. gRPC reads a client's certificate, key and
    CA once per channel, and reconnects with them for the channel's life: after cert-manager renews
    them in place, the next reconnect (a restarted peer) would present an expired certificate or
    trust a retired CA. Here, at the first call after any of the files changed, a new channel with
    the files as they are now carries that call and every later one; calls under way finish on the
    previous channel, which is closed with this one. Files that do not load yet (one written, not
    the other) leave the current channel in use, tried again at the next call."""

    def __init__(self, addr: str, tls: TlsConfig, options: list[tuple[str, Any]]) -> None:
        self._addr, self._tls, self._options = addr, tls, options
        self._lock = threading.Lock()
        self._stamp = tls.stamp()
        self._bad_stamp: tuple[int, ...] = ()
        self._current = self._open()
        self._retired: list[grpc.Channel] = []

    def _open(self) -> grpc.Channel:
        return grpc.secure_channel(self._addr, self._tls.channel_credentials(), options=self._options)

    def current(self) -> grpc.Channel:
        """The channel of the files as they are now (a stat of each file per call)."""
        stamp = self._tls.stamp()
        if stamp == self._stamp or stamp == self._bad_stamp:
            return self._current
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._tls.check_files()
                    fresh = self._open()
                except InvalidArgument as exc:
                    self._bad_stamp = stamp
                    log.warning("TLS files for %s changed but cannot be read yet: %s; keeping the "
                                "previous ones", self._addr, exc)
                    return self._current
                self._retired.append(self._current)
                if len(self._retired) > MAX_RETIRED:  # files touched in a loop must not pile up channels
                    log.warning("closing a channel to %s retired %d TLS renewals ago (calls still on it "
                                "end)", self._addr, MAX_RETIRED)
                    self._retired.pop(0).close()
                self._current, self._stamp = fresh, stamp
                log.info("TLS files changed: calls to %s now use them (%s)", self._addr, self._tls.cert
                         or self._tls.ca)
            return self._current

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Following(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Following(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Following(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Following(self, "stream_stream", method, args, kwargs)

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self.current().subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        for ch in (self._current, *self._retired):
            ch.unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            for ch in (self._current, *self._retired):
                ch.close()
            self._retired.clear()

    def __enter__(self) -> RenewingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Following:
    """A multi-callable of whichever channel is current at each call (stubs keep theirs for life)."""

    def __init__(self, owner: RenewingChannel, kind: str, method: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._method, self._args, self._kwargs = owner, kind, method, args, kwargs
        self._bound: tuple[grpc.Channel, Any] | None = None  # one tuple: swapped whole across threads

    def _now(self) -> Any:
        ch = self._owner.current()
        bound = self._bound
        if bound is None or bound[0] is not ch:
            bound = self._bound = (ch, getattr(ch, self._kind)(self._method, *self._args, **self._kwargs))
        return bound[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._now()(*args, **kwargs)

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._now().with_call(*args, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._now().future(*args, **kwargs)


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def warn_if_cleartext(addr: str, token: str | None, tls: TlsConfig, what: str) -> None:
    """One warning at start when a token would cross a network in clear (TLS off, peer not loopback)."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    if token and not tls.dials and host not in LOOPBACK:
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
