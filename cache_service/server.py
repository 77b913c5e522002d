"""``card-cache``: the cache service process.

    card-cache --port 50052 --redis-url redis://127.0.0.1:6379/0

Every flag has a CARD_* environment variable (see ``card-cache --help``). It prints one line,
``card-cache listening on HOST:PORT``, to stdout once it serves, so a parent process started with
``--port 0`` can read the port the OS chose.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

import click
import torch

from cache_service.config import CacheConfig, resolve_device
from cache_service.monitor import Monitor
from cache_service.registry import Registry
from cache_service.servicer import CacheServicer
from cache_service.sessions import SessionTable
from cache_service.store import MetadataStore, open_store
from card.v1 import cache_pb2, cache_pb2_grpc
from card_common.serving import (
    add_health,
    make_server,
    serve_until_signal,
    set_serving,
    setup_logging,
    start_metrics_server,
)
from engine.config import default_tree_params
from engine.errors import CardError, InvalidArgument

log = logging.getLogger(__name__)

option = functools.partial(click.option, show_envvar=True)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name


class CacheServer:
    """The gRPC server with the cache's state and background monitor; used like grpc.Server."""

    def __init__(self, config: CacheConfig, store: MetadataStore, max_workers: int) -> None:
        self.config = config
        self.store = store
        self.grpc = make_server(max_workers)
        self.health = add_health(self.grpc)
        self.registry = Registry()
        self.sessions = SessionTable(config, store, self.registry)
        self.monitor = Monitor(config, store, self.registry, self.sessions, self._set_health)
        self.servicer = CacheServicer(config, store, self.registry, self.sessions, self.monitor)
        cache_pb2_grpc.add_CacheServiceServicer_to_server(self.servicer, self.grpc)
        self._stopped = False

    def _set_health(self, serving: bool) -> None:
        if not self._stopped:
            set_serving(self.health, serving, [SERVICE_NAME])

    def add_insecure_port(self, addr: str) -> int:
        return self.grpc.add_insecure_port(addr)

    def start(self) -> None:
        self.grpc.start()
        self.monitor.start()

    def shutdown_sessions(self) -> None:
        """Health NOT_SERVING, then end every session and draft stream cleanly (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.monitor.stop()
        self.servicer.shutdown()

    def stop(self, grace: float | None) -> threading.Event:
        self.shutdown_sessions()
        event = self.grpc.stop(grace)
        self.store.close()
        return event

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc.wait_for_termination(timeout)


def create_server(addr: str, config: CacheConfig, store: MetadataStore | None = None
                  ) -> tuple[CacheServer, int]:
    """Build (not start) the server bound to ``addr``; returns it and the bound port.

    ``store`` defaults to ``open_store`` for the config (Unavailable when Redis is unreachable
    and the in-process fallback is not allowed).
    """
    if store is None:
        store = open_store(config.redis_url, config.redis_prefix, config.allow_memory_fallback)
    server = CacheServer(config, store, config.grpc_threads)
    try:
        port = server.add_insecure_port(addr)
    except RuntimeError as exc:  # grpc raises when the address is taken or invalid
        store.close()
        raise InvalidArgument(
            f"cannot listen on {addr} ({exc}); is another card-cache running there?"
        ) from None
    return server, port


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@option("--host", envvar="CARD_CACHE_HOST", default="127.0.0.1",
              help="Interface to listen on; 0.0.0.0 in containers / Kubernetes.")
@option("--port", envvar="CARD_CACHE_PORT", type=int, default=50052, help="gRPC port; 0 = OS-chosen.")
@option("--redis-url", envvar="CARD_REDIS_URL", default="redis://127.0.0.1:6379/0",
              help="Metadata store; memory:// = in-process (single machine, logs a warning).")
@option("--redis-prefix", envvar="CARD_REDIS_PREFIX", default="card:",
              help="Prefix of every Redis key.")
@option("--allow-memory-fallback", envvar="CARD_ALLOW_MEMORY_FALLBACK", is_flag=True,
              help="Use the in-process store when Redis is unreachable at startup.")
@option("--device", envvar="CARD_CACHE_DEVICE", default="auto",
              help="Where the trees live: auto (cuda if available), cpu, cuda, cuda:N.")
@option("--metrics-port", envvar="CARD_METRICS_PORT", type=int, default=9092,
              help="Prometheus /metrics port; 0 disables.")
@option("--session-ttl-s", envvar="CARD_SESSION_TTL_S", type=int, default=86400,
              help="How long finished-session records stay in Redis.")
@option("--session-idle-timeout-s", envvar="CARD_SESSION_IDLE_TIMEOUT_S", type=float, default=600.0,
        help="Close a session with no Step for this long (its target died); 0 = never.")
@option("--heartbeat-interval-s", envvar="CARD_HEARTBEAT_INTERVAL_S", type=float, default=2.0,
              help="Draft heartbeat period; a worker expires after 3 missed.")
@option("--max-chain", envvar="CARD_MAX_CHAIN", type=int, default=None,
        help="Most drafted tokens per chain handed to the target (default: 6 on CPU, 8 on GPU).")
@option("--b-extension/--no-b-extension", envvar="CARD_B_EXTENSION", default=True,
              help="Extend each chain by the best secondary-tier token.")
@option("--min-path-prob", envvar="CARD_MIN_PATH_PROB", type=click.FloatRange(0.0, 1.0), default=None,
        help="Cut chains where the draft's prefix probability falls below this "
             "(default: 0, never).")
@option("--grpc-threads", envvar="CARD_GRPC_THREADS", type=int, default=64,
              help="Server threads; every open draft stream holds one.")
@option("--log-level", envvar="CARD_LOG_LEVEL", default="INFO",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@option("--json-logs", envvar="CARD_JSON_LOGS", is_flag=True, help="One JSON object per log line.")
def main(host: str, port: int, redis_url: str, redis_prefix: str, allow_memory_fallback: bool, device: str,
         metrics_port: int, session_ttl_s: int, session_idle_timeout_s: float, heartbeat_interval_s: float,
         max_chain: int | None, b_extension: bool, min_path_prob: float | None, grpc_threads: int,
         log_level: str, json_logs: bool) -> None:
    """Serve the CARD cache: the authority on every session's candidate tree."""
    setup_logging(log_level, json_logs)
    try:
        device = resolve_device(device)
        # the cache sits with the target: its hardware says how long a chain pays to verify
        hardware = default_tree_params(torch.device(device).type)
        max_chain = hardware.max_chain if max_chain is None else max_chain
        min_path_prob = hardware.min_path_prob if min_path_prob is None else min_path_prob
        config = CacheConfig(
            host=host, port=port, redis_url=redis_url, redis_prefix=redis_prefix,
            allow_memory_fallback=allow_memory_fallback, device=device,
            metrics_port=metrics_port, session_ttl_s=session_ttl_s,
            session_idle_timeout_s=session_idle_timeout_s, heartbeat_interval_s=heartbeat_interval_s,
            health_check_interval_s=min(2.0, heartbeat_interval_s), max_chain=max_chain,
            b_extension=b_extension, min_path_prob=min_path_prob, grpc_threads=grpc_threads,
            log_level=log_level, json_logs=json_logs,
        )
        server, bound = create_server(config.addr, config)
        start_metrics_server(config.metrics_port)
    except CardError as exc:
        raise click.ClickException(str(exc)) from None
    server.start()
    log.info("cache service on %s:%d (device %s, store %s)", host, bound, config.device, server.store.url)
    print(f"card-cache listening on {host}:{bound}", flush=True)
    serve_until_signal(server, server.shutdown_sessions, grace_s=5.0, health_servicer=server.health)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
