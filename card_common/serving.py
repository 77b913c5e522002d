"""What every service process shares: gRPC server options, health, metrics, logging, shutdown."""

from __future__ import annotations

import datetime
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Clients ping every 30 s (card.common.channels); the server must allow that or it answers with
# GOAWAY "too_many_pings" and long-lived streams (draft commands) drop.
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC enables SO_REUSEPORT by default: a second server on a taken port would silently share
    # it; a port conflict must fail at startup instead
    ("grpc.so_reuseport", 0),
)


class _Malformed:
    """What a request that does not parse becomes (instead of grpc's INTERNAL and a traceback)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class RejectMalformed(grpc.ServerInterceptor):
    """Answers a request message that does not parse with INVALID_ARGUMENT, and logs one line for
    the first of each method and every 1000th after (grpc alone logs a full traceback per message
    and answers INTERNAL: a fuzzer could fill the disk with logs)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def _refuse(self, method: str, bad: _Malformed, context: grpc.ServicerContext) -> None:
        with self._lock:
            n = self.seen[method] = self.seen.get(method, 0) + 1
        if n == 1 or n % 1000 == 0:
            log.warning("malformed %s request(s) refused: %d so far (latest from %s: %s)", method, n,
                        context.peer(), bad.error)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {bad.error}")

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        def safe(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, and anything else a parser can raise
                return _Malformed(exc)

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                self._refuse(method, request, context)
            return request

        def each(requests: Any, context: grpc.ServicerContext) -> Any:
            for request in requests:
                yield checked(request, context)

        kw = {"request_deserializer": safe, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            fn_uu = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(lambda r, c: fn_uu(checked(r, c), c), **kw)
        if handler.unary_stream:
            fn_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
                yield from fn_us(checked(request, context), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        if handler.stream_unary:
            fn_su = handler.stream_unary
            return grpc.stream_unary_rpc_method_handler(lambda rs, c: fn_su(each(rs, c), c), **kw)
        fn_ss = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(lambda rs, c: fn_ss(each(rs, c), c), **kw)


def make_server(max_workers: int = 32, interceptors: Sequence[grpc.ServerInterceptor] = (),
                maximum_concurrent_rpcs: int | None = None) -> grpc.Server:
    """A thread-pool gRPC server with the shared options (and RejectMalformed innermost, so that
    ``interceptors`` see parsed requests). Each open stream holds one thread; past
    ``maximum_concurrent_rpcs`` a call is refused (RESOURCE_EXHAUSTED) instead of queued."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=list(SERVER_OPTIONS),
                       interceptors=[*interceptors, RejectMalformed()],
                       maximum_concurrent_rpcs=maximum_concurrent_rpcs)


def bind(server: grpc.Server, addr: str, tls: TlsConfig = PLAINTEXT) -> int:
    """Listen on ``addr`` ("host:port", port 0 = OS-chosen), with TLS when ``tls`` has a
    certificate; the bound port, or Unavailable."""
    try:
        port = (server.add_secure_port(addr, tls.server_credentials()) if tls.serves
                else server.add_insecure_port(addr))
    except RuntimeError as exc:  # grpc raises this when the address is taken or invalid
        raise Unavailable(f"cannot bind {addr}: {exc} (is the port in use?)") from None
    if port == 0:
        raise Unavailable(f"cannot bind {addr} (is the port in use?)")
    return port


# ---- health ---------------------------------------------------------------------------------
def add_health(server: grpc.Server) -> health.HealthServicer:
    """Register grpc.health.v1 on ``server``; everything starts NOT_SERVING."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def start_health_port(servicer: health.HealthServicer, host: str, port: int | None
                      ) -> tuple[grpc.Server | None, int]:
    """Serve ``servicer`` alone, in plaintext, on ``host:port`` ((None, 0) when port is None): for
    probes that cannot speak TLS (the kubelet's gRPC probe) when the service port does. It carries
    no request data, only SERVING / NOT_SERVING. Returns the started server and its port."""
    if port is None:
        return None, 0
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=list(SERVER_OPTIONS))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = bind(server, f"{host}:{port}")
    server.start()
    log.info("plaintext health on %s:%d", host, bound)
    return server, bound


def set_serving(servicer: health.HealthServicer, serving: bool, services: Sequence[str] = ()) -> None:
    """Set the overall status ("") and each named service (e.g. "card.v1.CacheService")."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *services):
        servicer.set(name, status)


# ---- metrics --------------------------------------------------------------------------------
def start_metrics_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve Prometheus metrics over HTTP on ``addr:port`` (0 = disabled; loopback unless the
    service's ``--metrics-host`` says otherwise); returns the port or 0.

    InvalidArgument when the port cannot be bound (e.g. a second local instance on the default).
    """
    if port == 0:
        return 0
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=addr)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); choose another metrics "
            f"port or 0 to disable metrics"
        ) from None
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return port


# ---- logging --------------------------------------------------------------------------------
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, extra fields (session_id, ...), exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; extra fields are appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if extras:
            tail = " ".join(f"{k}={v}" for k, v in extras.items())
            head, sep, rest = line.partition("\n")  # keep key=value on the message line
            line = f"{head} {tail}{sep}{rest}"
        return line


def setup_logging(level: str = "INFO", json_logs: bool = False) -> None:
    """Configure the root logger once per process (stderr; stdout is kept for announcements)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_logs else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


# ---- shutdown -------------------------------------------------------------------------------
def serve_until_signal(server: grpc.Server, on_shutdown: Callable[[], None], grace_s: float = 5.0,
                       health_servicer: health.HealthServicer | None = None,
                       health_server: grpc.Server | None = None) -> None:
    """Block until SIGTERM/SIGINT, then drain: NOT_SERVING, ``on_shutdown()``, ``server.stop(grace)``.

    Health flips first so load balancers and probes stop routing here while sessions end cleanly.
    Must be called from the main thread (signal handlers).
    """
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if health_servicer is not None:
            health_servicer.enter_graceful_shutdown()
        try:
            on_shutdown()
        except Exception:  # shutdown must reach server.stop whatever the cleanup did
            log.exception("error during shutdown")
        server.stop(grace_s).wait()
        if health_server is not None:  # probes see NOT_SERVING until the very end
            health_server.stop(0)
        log.info("server stopped")
