"""``card-cache``: the cache service process.

    card-cache --port 50052 --redis-url redis://127.0.0.1:6379/0

Every flag ``--some-option`` reads the environment variable CARD_CACHE_SOME_OPTION (see
``card-cache --help``). A startup error exits 2 with one line, ``card-cache: CODE: message``. Once
it serves it prints one line, ``card-cache listening on HOST:PORT``, to stdout, so a parent process
started with ``--port 0`` can read the port the OS chose.
"""

from __future__ import annotations

import logging
import sys
import threading

from grpc_health.v1 import health_pb2

from card.cache_service.assignment import Assignments
from card.cache_service.config import CacheConfig
from card.cache_service.monitor import Monitor
from card.cache_service.pools import PoolRouter
from card.cache_service.records import RecordWriter
from card.cache_service.servicer import CacheServicer
from card.cache_service.sessions import SessionTable
from card.cache_service.store import MetadataStore, open_store
from card.common.auth import CACHE_ROLES, TokenAuth, cache_tokens
from card.common.cli import (
    CHAIN_FIELDS,
    exit_on_error,
    logging_options,
    option,
    service_command,
    tls_options,
    tree_options,
)
from card.common.serving import (
    add_health,
    bind,
    make_server,
    serve_until_signal,
    set_serving,
    setup_logging,
    start_health_port,
    start_metrics_server,
    warn_open_port,
)
from card.engine.shared.errors import InvalidArgument, Unavailable
from card.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
# Redis's state, on a health name of its own: the cache's own ("" and SERVICE_NAME, which the probes
# ask) does not follow Redis, which no request needs (card.cache_service.monitor)
REDIS_HEALTH_NAME = f"{SERVICE_NAME}.redis"

# The largest message the cache takes: an OpenSession's prompt of a million int64 ids is 8 MiB, a
# StepBatch of catch-ups less; a layer is at most MAX_LAYER_NODES + MAX_LAYER_SECONDARY entries
# (< 0.5 MiB). Anything larger is refused (RESOURCE_EXHAUSTED) before it is parsed.
MAX_RECEIVE_BYTES = 16 * 2**20


class CacheServer:
    """The gRPC server with the cache's state and background threads (the monitor, the writer of
    finished records); used like grpc.Server."""

    def __init__(self, config: CacheConfig, store: MetadataStore) -> None:
        self.config = config
        self.store = store
        tokens, closed = cache_tokens(config.draft_token, config.target_token, config.operator_token)
        auth = TokenAuth(CACHE_ROLES, tokens, closed=closed)
        # streams beyond the registry's bound are refused by the servicer before they last; calls
        # beyond the pool are refused at once (card.common.gate), never queued behind streams that
        # do not end
        self.grpc = make_server(config.server_threads, [auth], maximum_concurrent_rpcs=config.server_threads,
                                max_receive_bytes=MAX_RECEIVE_BYTES)
        self.health = add_health(self.grpc)
        self.assignments = Assignments(
            max_workers=config.max_drafts, router=PoolRouter(config.pool_weights),
            max_capacity=config.max_draft_capacity, drop_cooldown_s=config.drop_cooldown_s)
        self.records = RecordWriter(store)
        self.sessions = SessionTable(config, store, self.assignments, self.records)
        self.monitor = Monitor(config, store, self.assignments, self.sessions, self._set_store_health)
        self.servicer = CacheServicer(config, store, self.assignments, self.sessions, self.monitor)
        cache_pb2_grpc.add_CacheServiceServicer_to_server(self.servicer, self.grpc)
        self._stopped = False

    def _set_store_health(self, serving: bool) -> None:
        if not self._stopped:
            self.health.set(REDIS_HEALTH_NAME, health_pb2.HealthCheckResponse.SERVING if serving
                            else health_pb2.HealthCheckResponse.NOT_SERVING)

    def bind(self, addr: str) -> int:
        return bind(self.grpc, addr, self.config.tls)

    def warn_if_open(self, port: int) -> None:
        """One warning at start for each role whose calls this port serves without a token."""
        c = self.config
        if not c.target_token:
            warn_open_port("cache's gRPC port", c.host, port, "--target-token",
                           "open, step and close sessions, and read Status (every prompt's ids)")
        if not c.draft_token:
            warn_open_port("cache's gRPC port", c.host, port, "--draft-token",
                           "register as a draft and write the trees that targets verify")
        if not c.operator_token and not c.target_token:
            warn_open_port("cache's gRPC port", c.host, port, "--operator-token",
                           "drain draft workers and set pool weights")
        elif not c.operator_token:
            log.info("no --operator-token: Drain and SetPoolWeights are refused (Status takes the target "
                     "token)")

    def start(self) -> None:
        self.sessions.retire_predecessors()  # before serving: every live record now is ours
        self.records.start()
        self.grpc.start()
        self.monitor.start()
        set_serving(self.health, True, [SERVICE_NAME])  # whatever Redis does: it reports on its own name

    def shutdown_sessions(self) -> None:
        """Health NOT_SERVING, then end every session and draft stream cleanly (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.monitor.stop()
        self.servicer.shutdown()
        if self.monitor.store_up:  # the workers let go: their records go (one transaction)
            self.monitor.write_drafts()
        self.records.stop(timeout_s=5.0)  # the sessions' final records, written while Redis answers

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
        store = open_store(config.redis_url, config.redis_prefix, config.allow_memory_fallback,
                           config.require_redis)
    server = CacheServer(config, store)
    try:
        port = server.bind(addr)
    except Unavailable as exc:
        store.close()
        raise InvalidArgument(
            f"cannot listen on {addr}; is another card-cache running there? ({exc})") from None
    return server, port


@service_command("CARD_CACHE")
@option("--host", default="127.0.0.1", help="Interface to listen on; 0.0.0.0 in containers / Kubernetes.")
@option("--port", type=int, default=50052, help="gRPC port; 0 = OS-chosen.")
@option("--redis-url", default="redis://127.0.0.1:6379/0",
        help="Metadata store (records for operators; no request waits on it); memory:// = in-process "
             "(single machine, logs a warning). With a password: redis://:PASSWORD@HOST:PORT/DB (prefer the "
             "variable, from a Secret: a command line is visible in ps); it is never logged.")
@option("--redis-prefix", default="card:", help="Prefix of every Redis key.")
@option("--allow-memory-fallback", is_flag=True,
        help="Use the in-process store when Redis is unreachable at startup.")
@option("--require-redis/--no-require-redis", default=True,
        help="Refuse to start while Redis is unreachable (a clear error for a forgotten redis-server). "
             "--no-require-redis (deploy/) starts and serves anyway: no request needs Redis, its health "
             "name card.v1.CacheService.redis says NOT_SERVING and records wait until it answers, so a "
             "cache restarted during a Redis outage serves instead of crash-looping. A refused password "
             "stops the start either way.")
@option("--device", default="auto", help="Where the trees live: auto (cuda if available), cpu, cuda, cuda:N.")
@option("--metrics-port", type=int, default=9092, help="Prometheus /metrics port; 0 disables.")
@option("--metrics-host", default="127.0.0.1",
        help="Interface of the metrics port (0.0.0.0 in containers, where Prometheus scrapes the pod).")
@option("--session-ttl-s", type=int, default=3600,
        help="How long finished-session records (bounded summaries) stay in Redis, for debugging; "
             "default one hour.")
@option("--session-idle-timeout-s", type=float, default=600.0,
        help="Close a session with no Step or keepalive for this long (its target died); each target asks "
             "for less at OpenSession (ten of its Step deadlines, at least 5 s) and keeps the sessions it "
             "still serves alive. This is the cap, and the timeout of targets that ask nothing; 0 = none.")
@option("--heartbeat-interval-s", type=float, default=2.0,
        help="Draft heartbeat period; a worker expires after 3 missed.")
@tree_options(CHAIN_FIELDS, note="The chains handed to the target; a request's chain policy may set its own.")
@option("--grpc-threads", type=int, default=64,
        help="Server threads for Step, OpenSession, heartbeats and Status; the drafts' streams get threads "
             "of their own on top (three per registered draft), so no number of drafts can starve these.")
@option("--max-drafts", type=int, default=128,
        help="Most draft workers registered at once; more are refused (RESOURCE_EXHAUSTED).")
@option("--max-draft-capacity", type=int, default=64,
        help="Most sessions one draft worker is given, whatever capacity it declares (the least-loaded "
             "worker takes each new session: a draft that declared 4096 would take them all).")
@option("--drop-cooldown-s", type=float, default=60.0,
        help="A worker that dropped a session is not offered it again for this long; other workers are "
             "at once, and any is after it.")
@option("--pool-tokens", default=None,
        help="Bind pools to credentials, 'POOL=TOKEN,...' (a Secret): a worker registers into a listed "
             "pool only with its token (card-draft --pool-token) and into no other pool. Default: every "
             "pool open to --draft-token's holders.")
@option("--pool-weights", default="",
        help="Split unnamed sessions between draft pools by weight, e.g. 'stable=90,canary=10' (smooth "
             "round robin; pools left out take sessions only when no weighted pool has room). Default: the "
             "least-loaded worker of any pool.")
@option("--model-free-chains/--no-model-free-chains", default=True,
        help="Where a session's tree holds nothing (right after a miss, while its draft restarts; no worker "
             "free), answer the Step with a continuation the session's own text suggests (prompt lookup, "
             "no model, a few dict probes) instead of an empty chain. Outputs never change: the target "
             "verifies every token.")
@option("--draft-token", default=None,
        help="Drafts must present it (authorization: Bearer) to RegisterDraft, Commands, PublishLayers, "
             "Heartbeat; UNAUTHENTICATED otherwise (default: open).")
@option("--target-token", default=None,
        help="Targets must present it to OpenSession, Step, StepBatch, CloseSession and Status "
             "(default: open).")
@option("--operator-token", default=None,
        help="Operators must present it to Drain and SetPoolWeights (card-client drafts drain / resume / "
             "weights); Status takes it too. Unset while --target-token is set: those two are refused "
             "(no target can drain); unset with no target token: open.")
@tls_options("card-cache", dials=False)
@logging_options
def main(**options: object) -> None:
    """Serve the CARD cache: the authority on every session's candidate tree."""
    setup_logging(options["log_level"], options["json_logs"])  # type: ignore[arg-type]
    with exit_on_error("card-cache"):
        config = CacheConfig.from_options(**options)  # type: ignore[arg-type]
        server, bound = create_server(config.addr, config)
        server.warn_if_open(bound)
        start_metrics_server(config.metrics_port, config.metrics_host)
        server.start()
        health_server, _ = start_health_port(server.health, config.host, config.health_port)
    log.info("cache service on %s:%d (%s, device %s, store %s)", config.host, bound, config.tls.describe(),
             config.device, server.store.url)
    print(f"card-cache listening on {config.host}:{bound}", flush=True)
    serve_until_signal(server, server.shutdown_sessions, grace_s=5.0, health_servicer=server.health,
                       health_server=health_server)
    sys.stdout.flush()

if __name__ == "__main__":
    main()
