"""What every service process shares: gRPC servers and their bounds, health, metrics, logging,
shutdown."""

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
from grpc_health.v1 import health_pb2_grpc

from card.common.gate import HEALTH_CALLS, Gate
from card.common.health import HANDSHAKE_TIMEOUT_MS, Health, HealthPort
from card.common.health import set_serving as set_serving  # re-exported: every service sets it here
from card.common.metrics_port import serve_metrics
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

# What a client accepts from its peers, and sends (card.common.channels): the services it calls
# are its own; each server takes less (``max_receive_bytes`` of make_server, sized per service).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Calls at once on one connection: grpc refuses more (REFUSED_STREAM: the caller sees UNAVAILABLE;
# grpc's clients do not wait for room). The server-wide bound is make_server's budget: this keeps
# one connection from taking all of it, above what a legitimate one holds (a target: its Steps and
# opens; a process of many drafts sharing one connection: three streams each).
STREAMS_PER_CONNECTION = 256
# How long a call of a method that takes one message may take to deliver it (card.common.gate):
# a client sends it with its headers; 20 s carries the largest message a service takes over a
# slow (a few Mbit/s) link. A silent caller's thread is freed then.
FIRST_MESSAGE_S = 20.0


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """The options of every thread-pool server.

    No connection age: the drafts' Commands and PublishLayers streams live as long as their
    registration, and a Generate stream as long as its generation; an age would cut them (grpc
    ends a connection's streams when its grace is over). A silent call is ended by the first
    message deadline instead (card.common.gate), and a connection that never finishes its
    handshake after HANDSHAKE_TIMEOUT_MS."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        # Flow-control windows stay at HTTP/2's 64 KiB a stream: with grpc's bandwidth-delay probe
        # on, they grow to megabytes on a fast link, and a call refused before its message is read
        # (an unauthenticated one) still had that much of the message taken into the server's
        # memory (24 calls of 20 MiB cost the target 15-115 MiB; without the probe, 2). 64 KiB a
        # stream carries a 4 MiB prompt over loopback as fast (8 ms) and over a LAN at hundreds
        # of MB/s; only a link of tens of ms round trip would feel it.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        # Clients ping every 30 s (card.common.channels); the server must allow that or it answers
        # with GOAWAY "too_many_pings" and long-lived streams (draft commands) drop.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC enables SO_REUSEPORT by default: a second server on a taken port would silently share
        # it; a port conflict must fail at startup instead
        ("grpc.so_reuseport", 0),
    ]


def make_server(max_workers: int = 32, interceptors: Sequence[grpc.ServerInterceptor] = (),
                maximum_concurrent_rpcs: int | None = None, *, max_receive_bytes: int = MAX_MESSAGE_BYTES,
                first_message_s: float = FIRST_MESSAGE_S) -> grpc.Server:
    """A thread-pool gRPC server with the shared options, every call through ``Gate`` (innermost,
    after ``interceptors``: a call an interceptor refuses costs no budget and no thread).

    Each open stream holds one thread. ``maximum_concurrent_rpcs``: service calls in flight (at
    most ``max_workers``, so that each has a thread at once); past it a call is refused
    (RESOURCE_EXHAUSTED) at once instead of queued. None: calls queue for a thread (tests).
    grpc.health.v1 runs on threads of its own (card.common.gate)."""
    if maximum_concurrent_rpcs is not None and maximum_concurrent_rpcs > max_workers:
        raise ValueError(f"{maximum_concurrent_rpcs} calls in flight need as many threads, not {max_workers}")
    gate = Gate(maximum_concurrent_rpcs, first_message_s)
    # grpc's own count is the backstop of the gate's: the service's calls, the health calls and
    # refusals under way (each ends at once)
    backstop = None if maximum_concurrent_rpcs is None else maximum_concurrent_rpcs + HEALTH_CALLS + 64
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                       options=server_options(max_receive_bytes), interceptors=[*interceptors, gate],
                       maximum_concurrent_rpcs=backstop)


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
def add_health(server: grpc.Server) -> Health:
    """Register grpc.health.v1 on ``server``; everything starts NOT_SERVING. The returned owner
    of the statuses also feeds the process's health ports (``start_health_port``)."""
    servicer = Health()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def start_health_port(servicer: Health, host: str, port: int | None) -> tuple[HealthPort | None, int]:
    """Serve ``servicer``'s statuses alone, in plaintext, on ``host:port`` ((None, 0) when port is
    None): for probes that cannot speak TLS (the kubelet's gRPC probe) when the service port does.
    It carries no request data, only SERVING / NOT_SERVING, and no caller can hold it
    (card.common.health). Returns the started server and its port."""
    if port is None:
        return None, 0
    server = HealthPort(servicer, host, port)
    log.info("plaintext health on %s:%d", host, server.port)
    return server, server.port


# ---- metrics --------------------------------------------------------------------------------
def start_metrics_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve Prometheus metrics over HTTP on ``addr:port`` (0 = disabled; loopback unless the
    service's ``--metrics-host`` says otherwise), bounded (card.common.metrics_port); returns
    the port or 0.

    InvalidArgument when the port cannot be bound (e.g. a second local instance on the default).
    """
    if port == 0:
        return 0
    try:
        serve_metrics(addr, port)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); choose another metrics "
            f"port or 0 to disable metrics"
        ) from None
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return port


def warn_open_port(what: str, host: str, port: int, missing: str, allows: str) -> None:
    """The one start-up warning for a port that serves without a token (``missing``: the flag)."""
    log.warning("the %s on %s:%d serves without %s: anyone who reaches it can %s", what, host, port,
                missing, allows)


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
def serve_until_signal(server: grpc.Server | HealthPort, on_shutdown: Callable[[], None],
                       grace_s: float = 5.0, health_servicer: Health | None = None,
                       health_server: HealthPort | None = None) -> None:
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
