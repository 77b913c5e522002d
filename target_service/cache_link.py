"""card-target's side of its cache, everything but the Step itself: which calls may go out, and
who waits for them (nobody on the engine's thread).

    CacheTarget     what every session tells the cache, and the deadlines (built once, at ready)
    Breaker         stops opening sessions against a cache that keeps failing; probes it back
    CacheClient     OpenSession as a future the engine polls, CloseSession fire-and-forget, both
                    bounded in flight; the SessionKeeper's keepalives on their own thread
    DraftDirectory  a request that names a draft is checked here, at the edge, on its handler's
                    thread: refused before it waits for a KV slot, never on the engine's thread

The engine thread's only network wait is one StepBatch per iteration, with its deadline
(target_service.remote_card). A cache that hangs costs each stream one Step deadline; after
that its sessions are abandoned, the streams decode plainly, and new sessions are opened only
when the breaker lets a probe through and the cache answers it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from card.common.convert import chain_draw_to_msg, chain_policy_to_msg, drafter_to_msg, stats_to_msg
from card.common.drafts import DraftEntry, route_draft
from card.common.status import error_from_rpc
from card.common.tensors import ids_to_msg
from card.engine.shared.config import ChainDraw, ChainPolicy
from card.engine.shared.stats import GenerationStats
from card.engine.target.chain_source import DraftKind
from card.target_service import metrics
from card.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

# the cache itself is in trouble (not one session): counted by the breaker
CACHE_TROUBLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                 grpc.StatusCode.INTERNAL)


def session_idle_timeout_s(step_timeout_s: float) -> float:
    """How long the cache keeps one of this target's sessions without a Step or keepalive: ten
    Step deadlines, at least 5 s. A target that died frees its sessions' draft capacity this soon;
    a live one keeps every session it still serves alive (SessionKeeper), however long its prefill."""
    return max(5.0, 10.0 * step_timeout_s)


@dataclass(frozen=True)
class CacheTarget:
    """What every session of one card-target tells the cache, and how long it waits: built once
    (target_service.frontend), shared by every RemoteCard. ``vocab_size`` and ``context_window``
    are the target's: the cache checks prompts and the draft's layers against them."""

    cache_addr: str
    target_model: str
    fingerprint: str
    vocab_size: int = 0
    context_window: int = 0
    step_timeout_s: float = 1.0
    open_timeout_s: float = 5.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 5.0
    default_pool: str = ""  # the pool an unnamed session prefers (card-target --default-pool)
    # a session opens at its generation's first Step, not at admission (card-target
    # --draft-after-prefill): the draft's prefill does not share the cores with the target's
    open_after_prefill: bool = False

    @property
    def idle_timeout_s(self) -> float:
        return session_idle_timeout_s(self.step_timeout_s)


class Breaker:
    """A circuit breaker over the cache's answers: ``threshold`` failures in a row open it for
    ``cooldown_s`` (no session is opened meanwhile); then one probe may go (half-open): its
    success closes it, its failure opens it again for twice as long, at most ``max_cooldown_s``."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, threshold: int = 3, cooldown_s: float = 1.0, max_cooldown_s: float = 8.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._cooldown_s = cooldown_s
        self._open_until = 0.0
        self._probing = False
        self.state = self.CLOSED
        metrics.CACHE_BREAKER.set(0)

    def allow(self) -> bool:
        """May a session be opened now? In half-open state only one caller gets True."""
        with self._lock:
            if self.state == self.CLOSED:
                return True
            if self.state == self.OPEN:
                if self.clock() < self._open_until:
                    return False
                self._set(self.HALF_OPEN)
            if self._probing:
                return False
            self._probing = True
            return True

    def retry_in(self) -> float:
        """Seconds until ``allow`` may say yes again (0 when closed)."""
        with self._lock:
            return max(0.0, self._open_until - self.clock()) if self.state == self.OPEN else 0.0

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._probing = False
            self._cooldown_s = self.base_cooldown_s
            if self.state != self.CLOSED:
                log.info("the cache answers again: opening sessions")
                self._set(self.CLOSED)

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self.state == self.HALF_OPEN:
                self._cooldown_s = min(2 * self._cooldown_s, self.max_cooldown_s)
            elif self.state == self.OPEN or self._failures < self.threshold:
                return
            self._probing = False
            self._open_until = self.clock() + self._cooldown_s
            log.warning("the cache failed %d call(s) in a row: no new sessions for %.1fs, then one probe",
                        self._failures, self._cooldown_s)
            self._set(self.OPEN)

    def _set(self, state: str) -> None:
        self.state = state
        metrics.CACHE_BREAKER.set({self.CLOSED: 0, self.OPEN: 1, self.HALF_OPEN: 2}[state])


class KeptSession(Protocol):
    """What the keeper reads of a source (RemoteCard): its session, and when it last heard back."""

    session_id: str
    last_contact: float


class SessionKeeper:
    """Sends the cache, every quarter of the idle timeout, the ids of this target's open sessions
    that had no Step or open in that time (one StepBatch with keepalive ids, no steps): a session
    is closed for idleness only when its target is gone. Its own thread: never the engine's."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, idle_timeout_s: float, cache_addr: str) -> None:
        self.stub = stub
        self.period_s = idle_timeout_s / 4.0
        self.cache_addr = cache_addr
        self._sources: weakref.WeakSet[KeptSession] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-keeper", daemon=True)
        self._thread.start()

    def add(self, source: KeptSession) -> None:
        with self._lock:
            self._sources.add(source)

    def discard(self, source: KeptSession) -> None:
        with self._lock:
            self._sources.discard(source)

    def stop(self) -> None:
        self._stop.set()

    def quiet_sessions(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            sources = list(self._sources)
        return [s.session_id for s in sources if s.session_id and now - s.last_contact >= self.period_s]

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            ids = self.quiet_sessions()
            if not ids:
                continue
            try:
                self.stub.StepBatch(cache_pb2.StepBatchRequest(keepalive_session_ids=ids),
                                    timeout=self.period_s)
            except grpc.RpcError as err:  # the cache is down: its sessions are lost anyway
                log.debug("keepalive of %d session(s) failed: %s", len(ids),
                          error_from_rpc(err, self.cache_addr))


class CacheClient:
    """One card-target's calls to its cache other than Step. ``max_in_flight`` bounds the opens
    and closes under way at once: past it an open waits for a later iteration and a close is left
    to the cache's idle timeout (counted), so a hung cache holds a bounded number of calls."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, target: CacheTarget,
                 breaker: Breaker | None = None, max_in_flight: int = 256) -> None:
        self.stub = stub
        self.target = target
        self.breaker = breaker or Breaker()
        self.keeper = SessionKeeper(stub, target.idle_timeout_s, target.cache_addr)
        self.directory = DraftDirectory(stub, target.cache_addr)
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self._cv = threading.Condition()

    def _take(self) -> bool:
        with self._cv:
            if self._in_flight >= self.max_in_flight:
                return False
            self._in_flight += 1
            return True

    def _done(self, _: object = None) -> None:
        with self._cv:
            self._in_flight -= 1
            self._cv.notify_all()

    def open_session(self, committed: list[int], requested_draft: str, chain: ChainPolicy,
                     draw: ChainDraw | None = None, drafter: DraftKind | None = DraftKind.WORKER
                     ) -> grpc.Future | None:
        """OpenSession at ``committed``, under way (None: too many calls in flight, try later);
        ``draw``: the session's chains are drawn (verify rejection); ``drafter``: what drafts for
        it (the drafting policy's choice; none or the lookup: no worker until a Step names it)."""
        if not self._take():
            return None
        t = self.target
        request = cache_pb2.OpenSessionRequest(
            prompt_ids=ids_to_msg(committed), vocab_size=t.vocab_size, context_window=t.context_window,
            tokenizer_fingerprint=t.fingerprint, target_model=t.target_model, draft=requested_draft,
            chain=chain_policy_to_msg(chain), idle_timeout_ms=round(t.idle_timeout_s * 1000),
            default_pool=t.default_pool, drafter=drafter_to_msg(drafter))
        if draw is not None:
            request.draw.CopyFrom(chain_draw_to_msg(draw))
        future = self.stub.OpenSession.future(request, timeout=t.open_timeout_s)

        def done(f: grpc.Future) -> None:  # whoever waits for it: the breaker hears every answer
            self._done()
            err = None if f.cancelled() else f.exception()
            if f.cancelled() or (isinstance(err, grpc.Call) and err.code() in CACHE_TROUBLE):
                self.breaker.failure()
            else:  # an answer, even a refusal of this request's draft: the cache works
                self.breaker.success()

        future.add_done_callback(done)
        return future

    def close_session(self, session_id: str, stats: GenerationStats | None = None) -> None:
        """CloseSession, nobody waiting for it; the cache records ``stats`` (the generation's)."""
        if not self._take():
            metrics.CLOSES_DROPPED.inc()
            log.debug("session %s left to the cache's idle timeout (too many calls in flight)", session_id)
            return
        request = cache_pb2.CloseSessionRequest(session_id=session_id)
        if stats is not None:
            request.stats.CopyFrom(stats_to_msg(stats))
        future = self.stub.CloseSession.future(request, timeout=self.target.open_timeout_s)

        def done(f: grpc.Future) -> None:
            self._done()
            if not f.cancelled() and f.exception() is not None:
                log.info("CloseSession failed for session %s (the cache's idle timeout ends it): %s",
                         session_id, error_from_rpc(f.exception(), self.target.cache_addr),
                         extra={"session_id": session_id})

        future.add_done_callback(done)

    def close_when_open(self, opening: grpc.Future) -> None:
        """The generation ended while its session was opening: close it once it is open."""
        def done(f: grpc.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self.close_session(f.result().session_id)

        opening.add_done_callback(done)

    def in_flight(self) -> int:
        with self._cv:
            return self._in_flight

    def drain(self, timeout_s: float) -> bool:
        """Wait (shutdown) until the calls under way have ended; False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        self.keeper.stop()


class DraftDirectory:
    """The draft pools and workers registered with the cache, as its Status last listed them (at
    most ``max_age_s`` old). A request that names a draft is refused here, in one line, before it
    waits for a slot (card.common.drafts.route_draft); when the cache does not answer, the request
    is not refused for it (the session's open decides, and degrades to plain decoding).

    A name the listing lacks is looked up again only when the listing is ``recheck_s`` old or
    more: a negative cache for unknown names, bounded by construction (it is the listing itself,
    whatever names users send), so requests naming drafts that do not exist cost the cache at most
    one Status per ``recheck_s`` per target, not one each. One lookup at a time: callers that need
    a fresh listing while one is on its way wait for it (at most ``timeout_s``) and share it."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, cache_addr: str, timeout_s: float = 1.0,
                 max_age_s: float = 5.0, recheck_s: float = 1.0) -> None:
        self.stub = stub
        self.cache_addr = cache_addr
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.recheck_s = recheck_s
        self._lock = threading.Lock()  # the listing below; held for no call
        self._entries: list[DraftEntry] = []
        self._pools: set[str] = set()  # every pool the cache lists (weighted ones too)
        self._at = -1e18
        self._fetch = threading.Lock()  # one Status at a time (each bounded by timeout_s)
        self.lookups = 0  # Status calls made (tests count them)

    def _refresh(self, older_than: float) -> tuple[list[DraftEntry], set[str]] | None:
        """A listing newer than ``older_than`` (its monotonic time): the one another caller just
        fetched, else a new one; None when the cache does not answer."""
        with self._fetch:
            with self._lock:
                if self._at > older_than:
                    return self._entries, self._pools
            self.lookups += 1
            try:
                status = self.stub.Status(cache_pb2.StatusRequest(), timeout=self.timeout_s)
            except grpc.RpcError as err:
                log.info("cannot list the cache's drafts: %s", error_from_rpc(err, self.cache_addr))
                return None
            entries = [DraftEntry(d.name, d.model, d.tokenizer_fingerprint, d.pool) for d in status.drafts]
            pools = {p.name for p in status.pools} | {e.pool for e in entries}
            with self._lock:
                self._entries, self._pools, self._at = entries, pools, time.monotonic()
            return entries, pools

    def check(self, name: str, fingerprint: str, target_model: str) -> None:
        with self._lock:
            at, entries, pools = self._at, self._entries, self._pools
        age = time.monotonic() - at
        known = name in pools or any(e.name == name for e in entries)
        if age >= self.max_age_s or (not known and age >= self.recheck_s):
            listed = self._refresh(at)
            if listed is None:
                return
            entries, pools = listed
        # pools without a worker now (weighted, or measured) may be named and waited for
        route_draft(name, entries, fingerprint, target_model, pools - {e.pool for e in entries})
