"""The background loop: Redis health, draft-worker expiry, live-session records."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from card.cache_service import metrics
from card.cache_service.config import CacheConfig
from card.cache_service.registry import Registry
from card.cache_service.sessions import SessionTable
from card.cache_service.store import MetadataStore
from card.engine.shared.errors import Unavailable

log = logging.getLogger(__name__)


class Monitor:
    """Every ``health_check_interval_s`` (and at least every heartbeat interval): ping the store
    and report it through ``on_health``, drop draft workers that missed three heartbeats, close
    sessions idle past ``session_idle_timeout_s``, flush live-session records to the store."""

    def __init__(self, config: CacheConfig, store: MetadataStore, registry: Registry,
                 sessions: SessionTable, on_health: Callable[[bool], None]) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.sessions = sessions
        self.on_health = on_health
        self.store_up = store.ping()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.on_health(self.store_up)
        self._thread = threading.Thread(target=self._run, name="cache-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        period = min(self.config.health_check_interval_s, self.config.heartbeat_interval_s)
        while not self._stop.wait(period):
            try:
                self.tick()
            except Exception:  # the loop must outlive any one bad round
                log.exception("monitor round failed")

    def tick(self) -> None:
        up = self.store.ping()
        if up != self.store_up:
            if up:
                log.info("metadata store %s is reachable again", self.store.url)
            else:
                log.error("metadata store %s is unreachable; reporting NOT_SERVING", self.store.url)
        came_back = up and not self.store_up
        self.store_up = up
        metrics.REDIS_UP.set(1 if up else 0)
        self.on_health(up)
        for worker in self.registry.expired(self.config.worker_ttl_s):
            if self.registry.remove(worker):
                log.warning("draft %s missed %d heartbeats; unregistered", worker.name, 3,
                            extra={"draft": worker.name})
                self.sessions.worker_left(worker)
        metrics.DRAFTS.set(len(self.registry.workers()))
        self.sessions.close_idle(self.config.session_idle_timeout_s)
        if up:
            try:
                # a restarted Redis has lost every record: rewrite them all
                self.sessions.flush_records(everything=came_back)
            except Unavailable as exc:
                log.warning("live-session records not flushed: %s", exc)
