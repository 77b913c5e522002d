"""The background loop: Redis health, draft-worker expiry, idle sessions, live-session records."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from card.cache_service import metrics
from card.cache_service.assignment import Assignments
from card.cache_service.config import CacheConfig
from card.cache_service.sessions import SessionTable
from card.cache_service.store import MetadataStore, StoreFull
from card.engine.shared.errors import Unavailable

log = logging.getLogger(__name__)

# why the store is not usable ("" = it is): health is NOT_SERVING for either reason
OUT_OF_MEMORY = "out of memory"
UNREACHABLE = "unreachable"


class Monitor:
    """Every ``health_check_interval_s`` (and at least every heartbeat interval): probe the store
    with a tiny write (``{prefix}probe``, a TTL of a few rounds) and report through ``on_health``
    whether it takes writes, drop draft workers that missed three heartbeats, close sessions idle
    past ``session_idle_timeout_s``, write the live records of sessions that lived through a round.

    A plain PING is not enough: Redis at ``maxmemory`` with ``noeviction`` answers PING and reads
    but refuses every write ("OOM command not allowed"). Either way (down, or out of memory) health
    is NOT_SERVING, with one log line naming the reason when it starts and one when it ends;
    ``reason`` holds it meanwhile (Status reports ``redis_connected`` false)."""

    def __init__(self, config: CacheConfig, store: MetadataStore, assignments: Assignments,
                 sessions: SessionTable, on_health: Callable[[bool], None]) -> None:
        self.config = config
        self.store = store
        self.assignments = assignments
        self.sessions = sessions
        self.on_health = on_health
        self.period_s = min(config.health_check_interval_s, config.heartbeat_interval_s)
        self.probe_ttl_s = max(1.0, 3 * self.period_s)
        self.kind, self.reason = self._check()
        if self.kind:
            self._log_change("")
        self._set_metrics()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # rounds run so far: a test that asserts something did NOT happen waits for rounds, not a sleep
        self.rounds = 0

    @property
    def store_up(self) -> bool:
        """The store answers and takes writes (as of the last round)."""
        return not self.kind

    @property
    def out_of_memory(self) -> bool:
        """The store answers (reads work) but refuses writes for memory."""
        return self.kind == OUT_OF_MEMORY

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
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception:  # the loop must outlive any one bad round
                log.exception("monitor round failed")
            self.rounds += 1

    def _check(self) -> tuple[str, str]:
        """(kind, reason): ("", "") when the store takes writes."""
        try:
            self.store.probe(self.probe_ttl_s)
        except StoreFull as exc:
            return OUT_OF_MEMORY, str(exc)
        except Unavailable as exc:
            return UNREACHABLE, str(exc)
        return "", ""

    def _log_change(self, before: str) -> None:
        url = self.store.url
        if not self.kind:
            log.info("metadata store %s takes writes again (it was %s); reporting SERVING", url, before)
        elif self.kind == OUT_OF_MEMORY:
            log.error("metadata store %s is out of memory: it answers but refuses writes (maxmemory reached, "
                      "policy noeviction); reporting NOT_SERVING until writes succeed again. Sessions still "
                      "open and close; their records are not kept meanwhile. Free memory or raise maxmemory",
                      url)
        else:
            log.error("metadata store %s is unreachable; reporting NOT_SERVING (%s)", url, self.reason)

    def _set_metrics(self) -> None:
        metrics.REDIS_UP.set(1 if self.store_up else 0)
        metrics.REDIS_OUT_OF_MEMORY.set(1 if self.out_of_memory else 0)

    def tick(self) -> None:
        before = self.kind
        self.kind, self.reason = self._check()
        if self.kind != before:  # one line per change, not one per round
            self._log_change(before)
        # Redis may have restarted empty: rewrite every live record (out of memory loses none)
        came_back = self.store_up and before == UNREACHABLE
        self._set_metrics()
        self.on_health(self.store_up)
        self.assignments.expire(self.config.worker_ttl_s)
        self.sessions.close_idle(self.config.session_idle_timeout_s)
        if self.store_up:
            try:
                self.sessions.flush_records(everything=came_back)
            except Unavailable as exc:  # the next round's probe says why; these wait for a later round
                log.debug("live-session records not flushed: %s", exc)
