"""The Prometheus metrics port of every service, bounded.

prometheus_client's ``start_http_server`` gives each connection a thread of its own with no
timeout: a caller that connects and sends nothing holds a thread (and a socket) forever, and many
such callers make a thread each. Here the same WSGI app (``prometheus_client.make_wsgi_app``: the
text and OpenMetrics formats, gzip, ``name[]`` filters) is served by the standard library's WSGI
server with at most METRICS_MAX_CONNECTIONS connections at once (more are closed unanswered), each
on a pool thread, each socket read or write timing out after METRICS_IO_TIMEOUT_S and every
connection shut after METRICS_CONNECTION_S whatever it does (a slow trickle included). A scrape is
one request of a few milliseconds: it finds a slot unless METRICS_MAX_CONNECTIONS callers hold one
each, and each of those is gone within METRICS_CONNECTION_S.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from concurrent import futures
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from card.common.gate import DEADLINES

log = logging.getLogger(__name__)

METRICS_MAX_CONNECTIONS = 64
METRICS_IO_TIMEOUT_S = 5.0
METRICS_CONNECTION_S = 10.0  # Prometheus' default scrape timeout


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape on stderr is noise


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read or write


class MetricsServer(WSGIServer):
    """A WSGI server of bounded connections (see the module's docstring)."""

    allow_reuse_address = True  # SO_REUSEADDR (a restart rebinds at once), not SO_REUSEPORT

    def __init__(self, addr: tuple[str, int], app: Any, max_connections: int = METRICS_MAX_CONNECTIONS,
                 io_timeout_s: float = METRICS_IO_TIMEOUT_S,
                 connection_s: float = METRICS_CONNECTION_S) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, _QuietHandler)
        self.set_app(app)
        self.io_timeout_s = io_timeout_s
        self.connection_s = connection_s
        self.refused = 0  # connections closed unanswered because every slot was taken
        self._slots = threading.BoundedSemaphore(max_connections)
        self._pool = futures.ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="metrics")
        self._thread = threading.Thread(target=self.serve_forever, name="metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            request.settimeout(self.io_timeout_s)
            timer = DEADLINES.arm(self.connection_s, lambda: _shut(request))
            self._pool.submit(self._serve, request, client_address, timer)
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _serve(self, request: Any, client_address: Any, timer: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:  # timed out, reset, shut by the deadline: the caller is gone
            pass
        except Exception:
            log.exception("metrics request from %s failed", client_address)
        finally:
            timer.disarm()
            self.shutdown_request(request)
            self._slots.release()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def serve_metrics(host: str, port: int, **bounds: Any) -> MetricsServer:
    """Prometheus' default registry on ``host:port`` (0 = OS-chosen), started; OSError when the
    address cannot be bound."""
    from prometheus_client import make_wsgi_app

    server = MetricsServer((host, port), make_wsgi_app(), **bounds)
    server.start()
    return server
