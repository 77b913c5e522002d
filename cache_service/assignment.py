"""Which draft worker serves which session: the registry of workers, each session's seat, drain,
the pause of a session's drafting, and "a worker is gone" (one path: its stream ended, its
heartbeats stopped, a successor took its name, the cache shuts down), behind one lock of its own.

Decide, then follow. Every change is decided under ``Assignments._lock``, which guards the
workers by id and name, the router, each worker's ``sessions`` / ``streaming`` / ``layer_streams`` /
``draining``, and each seat's ``worker`` / ``paused`` / ``refused_by`` / ``closed``. Nothing under it
waits: no session's lock is taken there (only leaf locks: a command queue's, logging's). The seats
whose worker changed are then brought to the decision (``_follow``) with the lock released, each
under its session's own lock (``CardSession.lock``): the old worker's link is detached (and told
to stop, unless that worker dropped the session) and the new one attached. A follow applies the
decision as it reads it then, so the last follow to run applies the last decision, whatever the
order of concurrent ones. So no lock is held while waiting for another: a slow Step holds only
its session's lock, and delays only a caller whose decision moved that very session.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from card.cache_service import metrics
from card.cache_service.pools import PoolRouter
from card.cache_service.registry import MAX_CAPACITY, MAX_LAYER_STREAMS, DraftRegistration, Worker
from card.common.drafts import ANY, Route, route_draft
from card.engine.shared.commands import AdvanceDraft, StartDraft, StopDraft
from card.engine.shared.config import ChainDraw
from card.engine.shared.errors import AlreadyExists, FailedPrecondition, NotFound, ResourceExhausted
from card.engine.shared.session import CardSession
from card.engine.shared.tree import Advance

log = logging.getLogger(__name__)


# a session goes to the worker that drafted its conversation's earlier turn (whose pool holds the
# prompt's front, card.cache_service.affinity) while that worker serves at most this many sessions
# more than the least-loaded candidate: beyond it, balance wins (its prefill of the whole
# conversation costs the new session less than a queue behind a busier worker costs every one)
AFFINITY_SLACK = 2


@dataclass(frozen=True)
class WorkerLink:
    """A session's link to the worker serving it: commands queued for its Commands stream."""

    worker: Worker
    session_id: str

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        self.worker.send(StartDraft(self.session_id, tuple(committed), epoch, draw))

    def advance(self, advance: Advance) -> None:
        self.worker.send(AdvanceDraft(self.session_id, advance))

    def stop(self) -> None:
        self.worker.send(StopDraft(self.session_id))


@dataclass(eq=False)
class Seat:
    """A session as the assignment sees it. ``worker`` (decided; ``card.link`` follows it),
    ``paused``, ``refused_by`` and ``closed`` are written under Assignments' lock; the draft counters
    under the card's lock (the serving worker's, from its latest layer; and those of earlier ones)."""

    session_id: str
    fingerprint: str
    card: CardSession
    route: Route = ANY  # where its workers come from (the request's draft, resolved at open)
    default_pool: str = ""  # the target's --default-pool, for an unnamed session
    worker: Worker | None = None
    paused: bool = False  # the target paused its drafting: no worker until a Step resumes it
    # the worker that drafted the conversation's earlier turn (card.cache_service.affinity): it
    # holds the keys and values of this prompt's front; "" = none known
    prefers: str = ""
    # workers that dropped it (LayerMessage.dropped), by id, and until when (time.monotonic()) they
    # are not offered it again; other workers are at once (Assignments.dropped)
    refused_by: dict[str, float] = field(default_factory=dict)
    closed: bool = False
    forwards: int = 0
    idle_s: float = 0.0
    forwards_done: int = 0
    idle_done: float = 0.0

    @property
    def refused(self) -> bool:
        """A worker dropped it and its cooldown has not run out (the assignments' lock held)."""
        now = time.monotonic()
        return any(until > now for until in self.refused_by.values())

    def refuses(self, now: float) -> frozenset[str]:
        """The workers not to offer it now (the assignments' lock held); expired refusals go."""
        for worker_id in [w for w, until in self.refused_by.items() if until <= now]:
            del self.refused_by[worker_id]
        return frozenset(self.refused_by)

    def linked(self, worker_id: str) -> bool:
        """The card drafts through ``worker_id`` now (the caller holds the card's lock)."""
        link = self.card.link
        return isinstance(link, WorkerLink) and link.worker.worker_id == worker_id

    def totals(self) -> tuple[int, float]:
        """The draft's forwards and idle seconds for this session, over every worker that served it."""
        return self.forwards_done + self.forwards, self.idle_done + self.idle_s


class Assignments:
    """Workers by id and by name, and the routing of sessions to them. Thread-safe; see the module
    docstring for the lock. ``router`` splits unnamed sessions between pools (--pool-weights).

    A draft is a guest: ``max_capacity`` caps the capacity a worker declares (card-cache
    --max-draft-capacity; the least-loaded worker takes a new session, so a worker that claimed
    4096 places would take nearly every session of its tokenizer), and ``drop_cooldown_s`` is how
    long a worker that dropped a session is not offered it again (--drop-cooldown-s; other workers
    are at once, and after the cooldown any is, so a dropped message never takes a session's draft
    for its whole life)."""

    def __init__(self, max_workers: int = 1024, router: PoolRouter | None = None,
                 max_capacity: int = MAX_CAPACITY, drop_cooldown_s: float = 60.0) -> None:
        self._lock = threading.Lock()
        self.max_workers = max_workers
        self.max_capacity = max_capacity
        self.drop_cooldown_s = drop_cooldown_s
        self.router = router or PoolRouter()
        self._by_id: dict[str, Worker] = {}
        self._by_name: dict[str, Worker] = {}
        self._seats: dict[str, Seat] = {}
        # seats whose refusal by a worker runs out then: (until, tie-break, seat); expire() re-seats them
        self._cooling: list[tuple[float, int, Seat]] = []
        self._drops = 0

    # ---- workers ------------------------------------------------------------------------------
    def register(self, reg: DraftRegistration, live_s: float) -> tuple[Worker, Worker | None]:
        """Add a worker; returns it and the worker it replaced (same name), which is now gone.

        A name is replaced only when its holder is gone: no Commands stream open and no heartbeat
        for ``live_s``. Otherwise AlreadyExists: a second registration (a misconfigured twin, or
        someone holding a stolen draft token) cannot evict a live worker and start a name war. A
        worker that restarts under its name gets it back once the old stream has ended (at once
        when its connection closed, else after ``live_s``); the draft link retries with backoff.
        ResourceExhausted: ``max_workers`` are registered (each holds server threads for its
        streams, sized from this bound: card.cache_service.server).
        """
        capacity = min(reg.capacity, self.max_capacity)  # what the draft says is a claim, not a right
        worker = Worker(worker_id=uuid.uuid4().hex, name=reg.name, model=reg.model,
                        fingerprint=reg.fingerprint, capacity=capacity, pool=reg.pool_or_model)
        with self._lock:
            old = self._by_name.get(reg.name)
            if old is None and len(self._by_id) >= self.max_workers:
                raise ResourceExhausted(f"the registry is full ({self.max_workers} draft workers; "
                                        f"card-cache --max-drafts)")
            if old is not None and (old.streaming or time.monotonic() - old.last_heartbeat <= live_s):
                raise AlreadyExists(
                    f"draft name {reg.name!r} is held by a live worker (registered "
                    f"{time.time() - old.registered_unix:.0f}s ago); give this worker another --name, "
                    f"or retry once that one has stopped")
            self._by_id[worker.worker_id] = worker
            self._by_name[worker.name] = worker
        if old is not None:
            self.gone(old, "re-registered; the old registration is replaced")
        self._count()
        log.info("draft %s registered (pool %s, model %s, capacity %d)", worker.name, worker.pool,
                 worker.model, worker.capacity, extra={"draft": worker.name, "worker_id": worker.worker_id})
        if capacity < reg.capacity:
            log.warning("draft %s declared capacity %d; it is given %d (card-cache --max-draft-capacity)",
                        worker.name, reg.capacity, capacity, extra={"draft": worker.name})
        return worker, old

    def get(self, worker_id: str) -> Worker:
        with self._lock:
            worker = self._by_id.get(worker_id)
        if worker is None:
            raise NotFound(f"no draft worker with id {worker_id!r} is registered (register again)")
        return worker

    def gone(self, worker: Worker, why: str) -> bool:
        """``worker`` is gone: unregistered, its stream ended, its sessions detached and each given
        another worker where one can serve it (they go on with their trees' chains meanwhile).
        The one path for every way a worker goes (its Commands stream ended, its heartbeats
        stopped, a successor took its name, shutdown). False when it was gone already."""
        with self._lock:
            worker.streaming = False
            if self._by_id.get(worker.worker_id) is not worker:
                return False
            del self._by_id[worker.worker_id]
            if self._by_name.get(worker.name) is worker:
                del self._by_name[worker.name]
            worker.close()
            orphans = self._evict(worker)
            changed = [*orphans, *self._rebalance()]
        worker.end_layer_streams()  # a stream of nobody's would hold a server thread for nothing
        self._follow(changed)
        self._count()
        moved = sum(s.worker is not None for s in orphans)
        log.warning("draft %s %s; %d of its %d session(s) moved to other workers", worker.name, why, moved,
                    len(orphans), extra={"draft": worker.name})
        return True

    def expire(self, max_age_s: float) -> None:
        """Workers with no heartbeat for ``max_age_s`` are gone; sessions whose refusal by a worker
        that dropped them has run out may take a worker again (the monitor's tick)."""
        now = time.monotonic()
        with self._lock:
            expired = [w for w in self._by_id.values() if now - w.last_heartbeat > max_age_s]
            due = []
            while self._cooling and self._cooling[0][0] <= now:
                due.append(heapq.heappop(self._cooling)[2])
            changed = self._rebalance(dict.fromkeys(s for s in due if not s.closed))
        self._follow(changed)
        for worker in expired:
            self.gone(worker, f"missed its heartbeats for {max_age_s:g}s; unregistered")

    def heartbeat(self, worker_id: str, draining: bool = False) -> Worker:
        """``draining``: the worker's SIGTERM: its sessions move, then it exits."""
        worker = self.get(worker_id)
        worker.last_heartbeat = time.monotonic()
        worker.last_heartbeat_unix = time.time()
        if draining and not worker.draining:
            self.drain(name=worker.name)
        return worker

    def open_stream(self, worker_id: str, cancel: Callable[[], object]) -> Worker:
        """The worker's Commands stream opened (``cancel`` ends it): it may take sessions now."""
        worker = self.get(worker_id)
        with self._lock:
            if worker.streaming:
                raise FailedPrecondition(f"draft {worker.name} already has a command stream open")
            worker.streaming, worker.cancel_stream = True, cancel
            changed = self._rebalance()
        self._follow(changed)
        self._count()
        return worker

    def open_layer_stream(self, worker_id: str, cancel: Callable[[], object]) -> tuple[Worker, object]:
        """One more PublishLayers stream of the worker (``cancel`` ends it), at most
        MAX_LAYER_STREAMS at once, and none of a worker that is gone: a stream of nobody's would
        hold a server thread for nothing. The stream ends with its worker (``gone`` cancels it).
        Returns the worker and the stream's key (for ``layer_stream_closed``)."""
        worker = self.get(worker_id)
        key = object()
        with self._lock:
            if self._by_id.get(worker.worker_id) is not worker or worker.closed:
                raise NotFound(f"draft worker {worker.name} is gone (register again)")
            if len(worker.layer_streams) >= MAX_LAYER_STREAMS:
                raise ResourceExhausted(
                    f"draft {worker.name} already has {len(worker.layer_streams)} layer streams open")
            worker.layer_streams[key] = cancel
        return worker, key

    def layer_stream_closed(self, worker: Worker, key: object) -> None:
        with self._lock:
            worker.layer_streams.pop(key, None)

    def drain(self, name: str = "", pool: str = "", resume: bool = False) -> tuple[list[Worker], int]:
        """Mark the worker ``name``, or every worker of ``pool``, drained (or not, ``resume``): a
        drained worker takes no new session, and its sessions go where a new session of theirs
        would (their pool first), each drained worker told to stop them. Returns the workers and
        how many sessions moved to a worker; NotFound when no worker matches."""
        with self._lock:
            found = sorted((w for w in self._by_id.values() if (w.name == name if name else w.pool == pool)),
                           key=lambda w: w.name)
            if not found:
                what = f"draft worker {name!r}" if name else f"draft pool {pool!r}"
                known = ", ".join(sorted(self._by_name if name else {w.pool for w in self._by_id.values()}))
                raise NotFound(f"no {what} is registered (registered: {known or 'none'})")
            for w in found:
                w.draining = not resume
            moving = [seat for w in found if w.draining for seat in self._evict(w)]
            changed = [*moving, *self._rebalance()]
        self._follow(changed)
        self._count()
        moved = sum(s.worker is not None for s in moving)
        log.info("%s %s (%d session(s) moved)", "resumed" if resume else "drained",
                 ", ".join(w.name for w in found), moved)
        return found, moved

    def set_weights(self, weights: Iterable[tuple[str, float]]) -> dict[str, float]:
        """New pool weights (PoolRouter.set); returns them."""
        with self._lock:
            self.router.set(weights)
            now = dict(self.router.weights)
        self._count()
        return now

    def workers(self) -> list[Worker]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda w: w.name)

    def pools(self) -> dict[str, list[Worker]]:
        """Every pool with a registered worker, and the pools the weights name (maybe empty)."""
        with self._lock:
            pools: dict[str, list[Worker]] = {p: [] for p in self.router.weights}
            for w in sorted(self._by_id.values(), key=lambda w: w.name):
                pools.setdefault(w.pool, []).append(w)
            return pools

    def _count(self) -> None:
        metrics.DRAFTS.set(len(self._by_id))
        metrics.set_pools(self.pools(), self.router.weight)

    # ---- sessions -----------------------------------------------------------------------------
    def route(self, draft: str, fingerprint: str, target_model: str = "the target",
              known_pools: Iterable[str] = ()) -> Route:
        """A request's ``draft`` as a route (card.common.drafts.route_draft, against the workers
        registered now, the weighted pools and ``known_pools``: those Status lists, e.g. measured
        ones whose workers are gone). NotFound / FailedPrecondition."""
        with self._lock:
            entries = [w.entry() for w in self._by_id.values()]
            pools = {*self.router.weights, *known_pools}
        return route_draft(draft, entries, fingerprint, target_model, pools)

    def join(self, seat: Seat) -> Seat:
        """A new session: the worker its route picks, else it waits (``paused``: it waits for a
        Step that resumes it). ResourceExhausted: the worker its request named is full."""
        with self._lock:
            pinned = self._by_name.get(seat.route.worker) if seat.route.worker else None
            if pinned is not None and pinned.full and not pinned.draining and not seat.paused:
                raise ResourceExhausted(
                    f"draft {seat.route.worker!r} is at capacity ({pinned.capacity} sessions); retry later, "
                    f"name its pool {seat.route.pool!r}, or leave the draft unnamed")
            self._seats[seat.session_id] = seat
            changed = self._rebalance([seat])
        self._follow(changed)
        return seat

    def leave(self, seat: Seat) -> None:
        """The session closed (its card too, which stopped its worker): its place is free."""
        with self._lock:
            seat.closed = True
            self._seats.pop(seat.session_id, None)
            changed = self._unseat(seat)
        self._follow(changed)

    def pause(self, seat: Seat, paused: bool) -> None:
        """Pause the session's drafting (its worker is told to stop and serves others; its tree
        empties) or resume it (a worker is picked as for a new session, and starts from the whole
        committed text at once: the tree is empty)."""
        with self._lock:
            seat.paused = paused
            changed = self._unseat(seat) if paused else self._rebalance([seat])
        self._follow(changed)
        metrics.DRAFT_PAUSES.labels("pause" if paused else "resume").inc()

    def dropped(self, session_id: str, worker_id: str) -> bool:
        """Worker ``worker_id`` gave the session up: free its place in the worker's capacity (a
        waiting session may take it). The session goes on with the chains its tree still holds and
        is offered to another worker of its route at once; the worker that dropped it is not
        offered it again for ``drop_cooldown_s`` (e.g. a prompt token outside its vocabulary: it
        would drop it again), and any worker may take it after that (the monitor's tick): a
        dropped message costs a session its draft for a cooldown, never for life. False when the
        worker does not serve the session (anymore)."""
        with self._lock:
            seat = self._seats.get(session_id)
            worker = seat.worker if seat is not None else None
            if seat is None or worker is None or worker.worker_id != worker_id:
                return False
            until = time.monotonic() + self.drop_cooldown_s
            seat.refused_by[worker_id] = until
            self._drops += 1
            heapq.heappush(self._cooling, (until, self._drops, seat))
            changed = self._unseat(seat)
        self._follow(changed)
        log.warning("draft %s dropped session %s; %s", worker.name, session_id,
                    f"draft {seat.worker.name} serves it now" if seat.worker is not None else
                    f"it goes on without a draft until a worker can take it (not {worker.name} for "
                    f"{self.drop_cooldown_s:g}s)", extra={"session_id": session_id, "draft": worker.name})
        return True

    def pick(self, fingerprint: str, route: Route = ANY, default_pool: str = "") -> Worker | None:
        with self._lock:
            return self._pick(fingerprint, route, default_pool)

    def cooling(self) -> int:
        """Refusals waiting to run out (a bound check: at most one per session and worker)."""
        with self._lock:
            return len(self._cooling)

    # ---- under the lock -----------------------------------------------------------------------
    def _evict(self, worker: Worker) -> list[Seat]:
        """Every session of ``worker`` loses it (it is gone or drained); the seats."""
        seats = [self._seats[sid] for sid in sorted(worker.sessions) if sid in self._seats]
        worker.sessions.clear()
        for seat in seats:
            seat.worker = None
        return seats

    def _unseat(self, seat: Seat) -> list[Seat]:
        """Take the seat's worker away; its place may serve a waiting session. The seats changed."""
        worker, seat.worker = seat.worker, None
        if worker is None:
            return [seat]
        worker.sessions.discard(seat.session_id)
        return [seat, *self._rebalance()]

    def _rebalance(self, seats: Iterable[Seat] | None = None) -> list[Seat]:
        """Give each waiting seat (of ``seats``, default all) a worker where a matching one has room."""
        changed = []
        now = time.monotonic()
        for seat in list(self._seats.values()) if seats is None else seats:
            if seat.worker is None and not (seat.paused or seat.closed):
                worker = self._pick(seat.fingerprint, seat.route, seat.default_pool, seat.refuses(now),
                                    seat.prefers)
                if seat.prefers and worker is not None:  # no worker yet: it keeps its preference
                    kept = worker.worker_id == seat.prefers
                    metrics.TURN_AFFINITY.labels("kept" if kept else "moved").inc()
                    seat.prefers = ""  # its first placement only: a moved session has no such worker
                if worker is not None:
                    worker.sessions.add(seat.session_id)
                    seat.worker = worker
                    changed.append(seat)
        return changed

    def _pick(self, fingerprint: str, route: Route = ANY, default_pool: str = "",
              refused: frozenset[str] = frozenset(), prefers: str = "") -> Worker | None:
        """The worker for a new or orphaned session, or None (it waits without speculation):

        - the route's worker while it can take it, else the least-loaded one of the route's pool;
        - unnamed: the least-loaded one of ``default_pool`` while it has room, else of the pool the
          router chooses among those with room;
        - but among those candidates, ``prefers`` (the worker that drafted the conversation's
          earlier turn) while it serves at most AFFINITY_SLACK sessions more than the least-loaded.

        Only workers whose command stream is open, not drained and not full are candidates, and
        none of ``refused`` (those that dropped the session, within their cooldown). A named
        worker is preferred only while it serves the route's pool (a successor under its name
        from another pool is not the worker the request named).
        """
        preferred = self._by_name.get(route.worker) if route.worker else None
        if (preferred is not None and preferred.assignable and preferred.fingerprint == fingerprint
                and preferred.worker_id not in refused and (not route.pool or preferred.pool == route.pool)):
            return preferred
        candidates = [w for w in self._by_id.values()
                      if w.assignable and w.fingerprint == fingerprint and w.worker_id not in refused]
        if route.pool:
            candidates = [w for w in candidates if w.pool == route.pool]
        elif candidates:
            in_default = [w for w in candidates if w.pool == default_pool] if default_pool else []
            if in_default:
                candidates = in_default
            else:
                chosen = self.router.choose(w.pool for w in candidates)
                candidates = [w for w in candidates if w.pool in chosen]
        if not candidates:
            return None
        least = min(candidates, key=lambda w: (w.load, len(w.sessions), w.registered_unix))
        if prefers and prefers != least.worker_id:
            earlier = next((w for w in candidates if w.worker_id == prefers), None)
            if earlier is not None and len(earlier.sessions) <= len(least.sessions) + AFFINITY_SLACK:
                return earlier
        return least

    # ---- with the lock released ---------------------------------------------------------------
    @staticmethod
    def _follow(seats: Iterable[Seat]) -> None:
        """Bring each seat's card to the worker decided for it, under the card's lock alone."""
        for seat in dict.fromkeys(seats):  # once each, in order
            card = seat.card
            with card.lock:
                worker, link = seat.worker, card.link
                if card.closed or (link.worker if isinstance(link, WorkerLink) else None) is worker:
                    continue
                if link is not None:  # a paused session's tree empties now: no chain of it goes out
                    card.detach(keep_tree=not seat.paused)
                    seat.forwards_done += seat.forwards
                    seat.idle_done += seat.idle_s
                    seat.forwards, seat.idle_s = 0, 0.0
                    if not (isinstance(link, WorkerLink) and link.worker.worker_id in seat.refused_by):
                        link.stop()  # (a worker that dropped it holds nothing of it)
                if worker is not None:
                    card.attach(WorkerLink(worker, seat.session_id))
            if worker is not None:
                log.info("session %s served by draft %s", seat.session_id, worker.name,
                         extra={"session_id": seat.session_id, "draft": worker.name})
