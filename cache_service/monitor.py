"""The cache's background loops: housekeeping (draft-worker expiry, idle sessions) and the store
(Redis's state, live-session records, the draft registry's records).

Redis is a dependency that can fail, and nothing the cache serves needs it: sessions, their trees
and the draft registry live in this process, Redis keeps records of them for operators. So:

- Two threads. The store loop may wait on Redis (a stopped Redis accepts connections and never
  answers: each call costs a socket timeout); housekeeping never calls Redis, so draft workers
  still expire and idle sessions still close on time whatever Redis does.
- No RPC writes to Redis. RegisterDraft, Heartbeat and Drain change the in-process registry and
  ``kick`` the store loop, which writes every registered worker's record (and deletes the records
  of workers gone) in one transaction per round; a heartbeat never waits on Redis, so a slow
  Redis cannot make drafts miss their heartbeats and re-register in a loop.
- Redis's state is reported on its own gRPC health name (``on_health``: the server's
  ``card.v1.CacheService.redis``), never on the cache's own ("" and card.v1.CacheService), which
  readiness and liveness probes ask: a Redis outage must not take the cache out of its Service
  or get it restarted (every live tree would be lost, and a restart does not bring Redis back).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from card.cache_service import metrics
from card.cache_service.assignment import Assignments
from card.cache_service.config import CacheConfig
from card.cache_service.sessions import SessionTable
from card.cache_service.store import MetadataStore, StoreAuth, StoreFull
from card.engine.shared.errors import Unavailable

log = logging.getLogger(__name__)

# why the store is not usable ("" = it is): its health name is NOT_SERVING for each
OUT_OF_MEMORY = "out of memory"
UNREACHABLE = "unreachable"
AUTH = "refusing the password"
MIN_ROUND_GAP_S = 0.05  # kicks (registrations, drains) never run store rounds closer than this


class Monitor:
    """Housekeeping every ``period_s`` (the health-check interval, at most the heartbeat
    interval): drop draft workers that missed three heartbeats, close sessions idle past
    ``session_idle_timeout_s``.

    The store loop, every ``period_s`` and when kicked: probe the store with a tiny write
    (``{prefix}probe``, a TTL of a few rounds) and report through ``on_health`` whether it takes
    writes; while it does, write the live records of sessions that lived through a round and the
    records of the registered draft workers.

    A plain PING is not enough: Redis at ``maxmemory`` with ``noeviction`` answers PING and reads
    but refuses every write ("OOM command not allowed"). Whatever the reason (down, out of memory,
    refusing the password) there is one log line when it starts and one when it ends; ``reason``
    holds it meanwhile (Status reports ``redis_connected`` false)."""

    def __init__(self, config: CacheConfig, store: MetadataStore, assignments: Assignments,
                 sessions: SessionTable, on_health: Callable[[bool], None]) -> None:
        self.config = config
        self.store = store
        self.assignments = assignments
        self.sessions = sessions
        self.on_health = on_health
        self.period_s = min(config.health_check_interval_s, config.heartbeat_interval_s)
        self.probe_ttl_s = max(1.0, 3 * self.period_s)
        # marks this process's draft records: Status lists its own workers from memory, and other
        # replicas' from Redis
        self.instance = uuid.uuid4().hex
        self._written_drafts: set[str] = set()  # names whose records the last round wrote
        self._drafts_lock = threading.Lock()  # one draft-record write at a time (a round, shutdown)
        self.kind, self.reason = self._check()
        if self.kind:
            self._log_change("")
        self._set_metrics()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        # rounds run so far: a test that asserts something did NOT happen waits for rounds, not a sleep
        self.housekeeping_rounds = 0
        self.store_rounds = 0

    @property
    def rounds(self) -> int:
        """Rounds both loops have run (each at least this many)."""
        return min(self.housekeeping_rounds, self.store_rounds)

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
        for name, loop in (("cache-monitor", self._housekeeping), ("cache-store", self._store_loop)):
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(5.0)
        self._threads = []

    def kick(self) -> None:
        """The registry changed (a worker registered, drained, went): a store round soon writes
        its records. Never waits."""
        self._wake.set()

    # ---- the loops ----------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.housekeeping_round()
            except Exception:  # the loop must outlive any one bad round
                log.exception("monitor round failed")
            self.housekeeping_rounds += 1

    def _store_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.store_round()
            except Exception:
                log.exception("store round failed")
            self.store_rounds += 1
            self._stop.wait(MIN_ROUND_GAP_S)

    def tick(self) -> None:
        """One round of each loop, here."""
        self.housekeeping_round()
        self.store_round()

    def housekeeping_round(self) -> None:
        """No Redis here: a stopped Redis must not delay expiry or idle closes."""
        self.assignments.expire(self.config.worker_ttl_s)
        self.sessions.close_idle(self.config.session_idle_timeout_s)

    def store_round(self) -> None:
        before = self.kind
        self.kind, self.reason = self._check()
        if self.kind != before:  # one line per change, not one per round
            self._log_change(before)
            self.on_health(self.store_up)
        # Redis may have restarted empty: rewrite every live record (out of memory loses none)
        came_back = self.store_up and before in (UNREACHABLE, AUTH)
        self._set_metrics()
        if not self.store_up:
            return
        try:
            self.sessions.flush_records(everything=came_back)
        except Unavailable as exc:  # the next round's probe says why; these wait for a later round
            log.debug("live-session records not flushed: %s", exc)
        self.write_drafts()

    def write_drafts(self) -> None:
        """Every registered worker's record (TTL: three heartbeats, so a record outlives no worker
        by long), the records of workers gone since the last write deleted: one transaction. On
        failure the records of workers gone are left to their TTL."""
        workers = self.assignments.workers()
        with self._drafts_lock:
            current = {w.name: {**w.record(), "cache": self.instance} for w in workers}
            gone = self._written_drafts - current.keys()
            try:
                self.store.put_drafts(current, self.config.worker_ttl_s, gone)
            except StoreFull:
                metrics.DRAFT_RECORDS_FAILED.labels("out_of_memory").inc()
            except Unavailable as exc:
                metrics.DRAFT_RECORDS_FAILED.labels("unreachable").inc()
                log.debug("draft records not written: %s", exc)
            self._written_drafts = set(current)

    # ---- the store's state --------------------------------------------------------------------
    def _check(self) -> tuple[str, str]:
        """(kind, reason): ("", "") when the store takes writes."""
        try:
            self.store.probe(self.probe_ttl_s)
        except StoreFull as exc:
            return OUT_OF_MEMORY, str(exc)
        except StoreAuth as exc:
            return AUTH, str(exc)
        except Unavailable as exc:
            return UNREACHABLE, str(exc)
        return "", ""

    def _log_change(self, before: str) -> None:
        url = self.store.url
        if not self.kind:
            log.info("metadata store %s takes writes again (it was %s); its health "
                     "(card.v1.CacheService.redis) is SERVING", url, before)
        elif self.kind == OUT_OF_MEMORY:
            log.error("metadata store %s is out of memory: it answers but refuses writes (maxmemory reached, "
                      "policy noeviction); its health (card.v1.CacheService.redis) is NOT_SERVING until "
                      "writes succeed again. The cache serves on: sessions open, step and close, drafts "
                      "register; finished records are not kept meanwhile (card_cache_records_failed_total). "
                      "Free memory, raise maxmemory, or run Redis with allkeys-lru (docs/deploy.md)", url)
        else:
            log.error("metadata store %s is %s; its health (card.v1.CacheService.redis) is NOT_SERVING. "
                      "The cache serves on; finished records wait in a bounded queue "
                      "(card_cache_records_pending, then card_cache_records_dropped_total): %s",
                      url, self.kind, self.reason)

    def _set_metrics(self) -> None:
        metrics.REDIS_UP.set(1 if self.store_up else 0)
        metrics.REDIS_OUT_OF_MEMORY.set(1 if self.out_of_memory else 0)
