"""grpc.health.v1: one owner of a process's statuses, served on its main port and on health ports.

``Health`` holds the statuses (``set``, ``enter_graceful_shutdown``: grpc_health's servicer,
served on a service's main port, thread-pool server) and tells every ``HealthPort`` of a change.
A ``HealthPort`` serves the same statuses alone on a port of its own (``--health-port``, the
kubelet's probe; the draft's gRPC port) from an asyncio server on a thread of its own: a caller
there costs a coroutine, not a thread, so that no number of silent or watching callers makes a
probe wait. Its Check and Watch read their one request message within HEALTH_FIRST_MESSAGE_S (then
DEADLINE_EXCEEDED); it takes at most HEALTH_PORT_MAX_CALLS calls at once (RESOURCE_EXHAUSTED
beyond), HEALTH_PORT_STREAMS_PER_CONNECTION per connection, and messages of HEALTH_MAX_MESSAGE_BYTES.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from card.common.gate import HEALTH_FIRST_MESSAGE_S, HEALTH_SERVICE
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import Unavailable

log = logging.getLogger(__name__)

HEALTH_PORT_MAX_CALLS = 1024  # each a coroutine of a few kB; a silent one ends within 5 s
HEALTH_PORT_STREAMS_PER_CONNECTION = 32
HEALTH_MAX_MESSAGE_BYTES = 4096  # a HealthCheckRequest is one service name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

# shared by every server: connections that never finish their handshake, or that idle, end
HANDSHAKE_TIMEOUT_MS = 10_000


class Health(health.HealthServicer):
    """The statuses of one process (everything starts NOT_SERVING). As grpc_health's servicer
    (non-blocking Watch) it serves them on a main port; ``status`` and ``subscribe`` let health
    ports serve the same ones. After ``enter_graceful_shutdown`` every status is NOT_SERVING for
    good, on every port."""

    def __init__(self) -> None:
        super().__init__(experimental_non_blocking=True)
        self._guard = threading.RLock()  # re-entered: grpc_health's shutdown calls our ``set``
        self._statuses: dict[str, int] = {}
        self._closing = False
        self._listeners: list[Callable[[], None]] = []
        self.set("", NOT_SERVING)

    def set(self, service: str, status: Any) -> None:
        with self._guard:
            if self._closing:
                return
            self._statuses[service] = status
            super().set(service, status)
            listeners = list(self._listeners)
        for notify in listeners:
            notify()

    def enter_graceful_shutdown(self) -> None:
        with self._guard:
            if self._closing:
                return
            super().enter_graceful_shutdown()  # NOT_SERVING for each service, through ``set``
            self._closing = True

    def status(self, service: str) -> Any:
        """The status of ``service`` ("" = the whole process), or None when none was set."""
        with self._guard:
            return self._statuses.get(service)

    def subscribe(self, notify: Callable[[], None]) -> Callable[[], None]:
        """Call ``notify()`` (on the setter's thread; it must not block) after every change;
        returns the function that stops it."""
        with self._guard:
            self._listeners.append(notify)

        def unsubscribe() -> None:
            with self._guard:
                if notify in self._listeners:
                    self._listeners.remove(notify)

        return unsubscribe


def set_serving(servicer: Health | health.HealthServicer, serving: bool,
                services: Sequence[str] = ()) -> None:
    """Set the overall status ("") and each named service (e.g. "card.v1.CacheService")."""
    status = SERVING if serving else NOT_SERVING
    for name in ("", *services):
        servicer.set(name, status)


def health_port_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", HEALTH_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", HEALTH_MAX_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", HEALTH_PORT_STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        # a probe's connection carries one call: an idle one is closed after a minute
        ("grpc.max_connection_idle_ms", 60_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.so_reuseport", 0),
    ]


def _parse(data: bytes) -> health_pb2.HealthCheckRequest | None:
    try:
        return health_pb2.HealthCheckRequest.FromString(data)
    except Exception:  # a message that does not parse: refused below, without a traceback
        return None


class HealthPort:
    """``health`` served alone on ``host:port`` (port 0 = OS-chosen; ``port`` is the bound one),
    TLS when ``tls`` serves; started at once. ``stop`` ends it (used like a grpc.Server there)."""

    def __init__(self, health_: Health, host: str, port: int, tls: TlsConfig = PLAINTEXT) -> None:
        self.health = health_
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Event | None = None
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="health-port", daemon=True)
        self._thread.start()
        self._unsubscribe = health_.subscribe(self._on_change)
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(f"{host}:{port}", tls),
                                                         self._loop).result(30)
        except BaseException:
            self._close_loop()
            raise

    async def _start(self, addr: str, tls: TlsConfig) -> int:
        self._changed = asyncio.Event()
        server = grpc.aio.server(options=health_port_options(), maximum_concurrent_rpcs=HEALTH_PORT_MAX_CALLS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
            "Check": grpc.stream_unary_rpc_method_handler(
                self._check, request_deserializer=_parse,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
            "Watch": grpc.stream_stream_rpc_method_handler(
                self._watch, request_deserializer=_parse,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        }),))
        try:
            port = (server.add_secure_port(addr, tls.server_credentials()) if tls.serves
                    else server.add_insecure_port(addr))
        except RuntimeError as exc:
            raise Unavailable(f"cannot bind {addr}: {exc} (is the port in use?)") from None
        if port == 0:
            raise Unavailable(f"cannot bind {addr} (is the port in use?)")
        await server.start()
        self._server = server
        return port

    def _on_change(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: this port is stopped
            self._loop.call_soon_threadsafe(self._wake_watchers)

    def _wake_watchers(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _first(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
                     ) -> health_pb2.HealthCheckRequest:
        try:
            request = await asyncio.wait_for(anext(requests), HEALTH_FIRST_MESSAGE_S)
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {HEALTH_FIRST_MESSAGE_S:g}s")
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a health call takes one request message")
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed HealthCheckRequest")
        return request

    async def _check(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
                     ) -> health_pb2.HealthCheckResponse:
        request = await self._first(requests, context)
        status = self.health.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:100]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def _watch(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        request = await self._first(requests, context)
        last = None
        while True:
            changed = self._changed  # taken before the read: a change after it wakes us
            assert changed is not None
            status = self.health.status(request.service)
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await changed.wait()

    def stop(self, grace: float | None = 0) -> threading.Event:
        """Stop serving (calls under way get ``grace`` seconds); returns a set Event, as
        grpc.Server.stop's once done."""
        self._unsubscribe()
        if self._server is not None and not self._loop.is_closed():
            server = self._server
            try:
                asyncio.run_coroutine_threadsafe(server.stop(grace), self._loop).result((grace or 0) + 10)
            except Exception as exc:  # stopping must not fail a shutdown
                log.warning("health port did not stop cleanly: %s", exc)
        self._close_loop()
        done = threading.Event()
        done.set()
        return done

    def _close_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
