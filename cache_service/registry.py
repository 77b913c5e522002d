"""Live draft workers: who they are, which pool each serves, the queue of commands for each, and
which worker a new (or orphaned) session goes to."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from card.cache_service.pools import PoolRouter
from card.common.drafts import ANY, POOL_NAME, DraftEntry, Route, pool_name, route_draft
from card.engine.shared.commands import DraftCommand
from card.engine.shared.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

log = logging.getLogger(__name__)

NAME = POOL_NAME  # worker names follow the same rule as pools
MAX_CAPACITY = 4096  # sessions per worker: a bound, not a target
# Commands queued for one worker beyond which it is dropped (its sessions fail over): a worker that
# stops reading its stream must not grow the cache's memory without bound. A live worker holds
# about one command per session per target step.
MIN_COMMAND_BACKLOG = 1024
COMMANDS_PER_SLOT = 64
# PublishLayers streams one worker may hold open at once: its link holds one, and a reconnect may
# overlap the old one's end; more would only hold server threads (CacheConfig.server_threads)
MAX_LAYER_STREAMS = 2


@dataclass(frozen=True)
class DraftRegistration:
    """What a draft worker says about itself when it registers. ``pool`` "" = from its model id."""

    name: str  # unique; a name is taken over only from a worker that is gone (Registry.register)
    model: str
    fingerprint: str  # of its tokenizer; only sessions of targets with the same one are served
    capacity: int  # most concurrent sessions, in [1, MAX_CAPACITY]
    pool: str = ""

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name or ""):
            raise InvalidArgument("a draft worker's name is 1-128 characters of A-Z a-z 0-9 . _ -, got "
                                  f"{self.name[:40]!r}{'...' if len(self.name) > 40 else ''}")
        if not self.fingerprint or len(self.fingerprint) > 128:
            raise InvalidArgument(f"draft {self.name!r} sent no (or an oversized) tokenizer fingerprint")
        if len(self.model) > 512:
            raise InvalidArgument(f"draft {self.name!r}: model id of {len(self.model)} characters (max 512)")
        if not 1 <= self.capacity <= MAX_CAPACITY:
            raise InvalidArgument(
                f"draft {self.name!r}: capacity must be in [1, {MAX_CAPACITY}], got {self.capacity}")
        if self.pool and not POOL_NAME.fullmatch(self.pool):
            raise InvalidArgument(f"draft {self.name!r}: a pool name is 1-128 characters of A-Z a-z 0-9 "
                                  f". _ -, got {self.pool[:40]!r}")

    @property
    def pool_or_model(self) -> str:
        """A worker from before pools (no ``pool``) serves in the pool named after its model."""
        return self.pool or pool_name(self.model or self.name)


@dataclass(eq=False)
class Worker:
    """One registration. ``sessions`` and ``draining`` are guarded by the owning Registry's lock."""

    worker_id: str
    name: str
    model: str
    fingerprint: str
    capacity: int  # most concurrent sessions
    pool: str = ""
    registered_unix: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    last_heartbeat_unix: float = field(default_factory=time.time)
    sessions: set[str] = field(default_factory=set)
    streaming: bool = False  # a Commands stream is open
    publishing: int = 0  # PublishLayers streams open
    draining: bool = False  # drained (operator, or its own SIGTERM): no new session
    closed: bool = False
    commands: queue.Queue[DraftCommand | None] = field(init=False)
    # ends the Commands stream from outside it (set by the stream's handler): a worker whose queue
    # overflowed is not reading, so waking its loop with a None would not reach it
    cancel_stream: Callable[[], object] | None = None

    def __post_init__(self) -> None:
        self.commands = queue.Queue(maxsize=max(MIN_COMMAND_BACKLOG, COMMANDS_PER_SLOT * self.capacity))

    def send(self, command: DraftCommand) -> None:
        if self.closed:
            return
        try:
            self.commands.put_nowait(command)
        except queue.Full:
            # May run under a session's lock: only end the stream here; its handler unregisters
            # the worker and the sessions move to other workers (SessionTable.worker_left)
            log.warning("draft %s has %d commands unread; ending its command stream (its sessions move "
                        "to other workers)", self.name, self.commands.qsize(), extra={"draft": self.name})
            self.close()
            if self.cancel_stream is not None:
                self.cancel_stream()

    def close(self) -> None:
        """End the Commands stream (a None wakes and stops it)."""
        self.closed = True
        with contextlib.suppress(queue.Full):  # its loop sees ``closed`` after the next command
            self.commands.put_nowait(None)

    @property
    def full(self) -> bool:
        return self.capacity > 0 and len(self.sessions) >= self.capacity

    @property
    def assignable(self) -> bool:
        """It may take a session now: its command stream is open, it is not drained, it has room."""
        return self.streaming and not self.closed and not self.draining and not self.full

    @property
    def load(self) -> float:
        return len(self.sessions) / self.capacity if self.capacity > 0 else 0.0

    def entry(self) -> DraftEntry:
        return DraftEntry(self.name, self.model, self.fingerprint, self.pool)

    def record(self) -> dict[str, str | int | float]:
        """The registry entry as Redis holds it (``Status`` reads other replicas' workers there)."""
        return {
            "name": self.name, "model": self.model, "tokenizer_fingerprint": self.fingerprint,
            "capacity": self.capacity, "worker_id": self.worker_id, "pool": self.pool,
            "draining": int(self.draining), "live": int(self.streaming and not self.closed),
            "active_sessions": len(self.sessions), "last_heartbeat_unix": self.last_heartbeat_unix,
            "registered_unix": self.registered_unix,
        }


class Registry:
    """Workers by id and by name, and the routing of sessions to them. Methods are thread-safe;
    ``lock`` is shared with the session table so that assigning a session and counting a worker's
    load happen together. ``router`` splits unnamed sessions between pools (--pool-weights)."""

    def __init__(self, lock: threading.RLock | None = None, max_workers: int = 1024,
                 router: PoolRouter | None = None) -> None:
        self.lock = lock or threading.RLock()
        self.max_workers = max_workers
        self.router = router or PoolRouter()
        self._by_id: dict[str, Worker] = {}
        self._by_name: dict[str, Worker] = {}

    def register(self, reg: DraftRegistration, live_s: float) -> tuple[Worker, Worker | None]:
        """Add a worker; returns it and the worker it replaced (same name), which is now removed.

        A name is replaced only when its holder is gone: no Commands stream open and no heartbeat
        for ``live_s``. Otherwise AlreadyExists: a second registration (a misconfigured twin, or
        someone holding a stolen draft token) cannot evict a live worker and start a name war. A
        worker that restarts under its name gets it back once the old stream has ended (at once
        when its connection closed, else after ``live_s``); the draft link retries with backoff.
        ResourceExhausted: ``max_workers`` are registered (each holds server threads for its
        streams, sized from this bound: card.cache_service.server).
        """
        worker = Worker(worker_id=uuid.uuid4().hex, name=reg.name, model=reg.model,
                        fingerprint=reg.fingerprint, capacity=reg.capacity, pool=reg.pool_or_model)
        with self.lock:
            old = self._by_name.get(reg.name)
            if old is None and len(self._by_id) >= self.max_workers:
                raise ResourceExhausted(f"the registry is full ({self.max_workers} draft workers; "
                                        f"card-cache --max-drafts)")
            if old is not None:
                if old.streaming or time.monotonic() - old.last_heartbeat <= live_s:
                    raise AlreadyExists(
                        f"draft name {reg.name!r} is held by a live worker (registered "
                        f"{time.time() - old.registered_unix:.0f}s ago); give this worker another --name, "
                        f"or retry once that one has stopped")
                self._remove(old)
            self._by_id[worker.worker_id] = worker
            self._by_name[worker.name] = worker
        return worker, old

    def get(self, worker_id: str) -> Worker:
        with self.lock:
            worker = self._by_id.get(worker_id)
        if worker is None:
            raise NotFound(f"no draft worker with id {worker_id!r} is registered (register again)")
        return worker

    def _remove(self, worker: Worker) -> None:
        self._by_id.pop(worker.worker_id, None)
        if self._by_name.get(worker.name) is worker:
            del self._by_name[worker.name]
        worker.close()

    def remove(self, worker: Worker) -> bool:
        """Unregister ``worker``; False when it was already gone (replaced or expired)."""
        with self.lock:
            present = self._by_id.get(worker.worker_id) is worker
            if present:
                self._remove(worker)
            return present

    def named(self, name: str) -> Worker | None:
        with self.lock:
            return self._by_name.get(name) if name else None

    def heartbeat(self, worker_id: str) -> Worker:
        worker = self.get(worker_id)
        worker.last_heartbeat = time.monotonic()
        worker.last_heartbeat_unix = time.time()
        return worker

    def expired(self, max_age_s: float) -> list[Worker]:
        now = time.monotonic()
        with self.lock:
            return [w for w in self._by_id.values() if now - w.last_heartbeat > max_age_s]

    def workers(self) -> list[Worker]:
        with self.lock:
            return sorted(self._by_id.values(), key=lambda w: w.name)

    def pools(self) -> dict[str, list[Worker]]:
        """Every pool with a registered worker, and the pools the weights name (maybe empty)."""
        with self.lock:
            pools: dict[str, list[Worker]] = {p: [] for p in self.router.weights}
            for w in sorted(self._by_id.values(), key=lambda w: w.name):
                pools.setdefault(w.pool, []).append(w)
            return pools

    def drain(self, name: str = "", pool: str = "", resume: bool = False) -> list[Worker]:
        """Mark the worker ``name``, or every worker of ``pool``, drained (or not, ``resume``): a
        drained worker takes no new session. Returns them; NotFound when none matches. Moving the
        sessions they serve is the session table's (SessionTable.drain)."""
        with self.lock:
            if name:
                found = [w for w in self._by_id.values() if w.name == name]
            else:
                found = [w for w in self._by_id.values() if w.pool == pool]
            if not found:
                what = f"draft worker {name!r}" if name else f"draft pool {pool!r}"
                names = self._by_name if name else {w.pool for w in self._by_id.values()}
                known = ", ".join(sorted(names))
                raise NotFound(f"no {what} is registered (registered: {known or 'none'})")
            for w in found:
                w.draining = not resume
            return sorted(found, key=lambda w: w.name)

    def route(self, draft: str, fingerprint: str, target_model: str = "the target",
              known_pools: Iterable[str] = ()) -> Route:
        """A request's ``draft`` as a route (card.common.drafts.route_draft, against the workers
        registered now, the weighted pools and ``known_pools``: those Status lists, e.g. measured
        ones whose workers are gone). NotFound / FailedPrecondition."""
        with self.lock:
            entries = [w.entry() for w in self._by_id.values()]
        return route_draft(draft, entries, fingerprint, target_model, {*self.router.weights, *known_pools})

    def pick(self, fingerprint: str, route: Route = ANY, default_pool: str = "") -> Worker | None:
        """The worker for a new or orphaned session, or None (it waits without speculation):

        - the route's worker while it can take it, else the least-loaded one of the route's pool;
        - unnamed: the least-loaded one of ``default_pool`` while it has room, else of the pool the
          router chooses among those with room.

        Only workers whose command stream is open, not drained and not full are candidates.
        """
        with self.lock:
            preferred = self._by_name.get(route.worker) if route.worker else None
            if preferred is not None and preferred.assignable and preferred.fingerprint == fingerprint:
                return preferred
            candidates = [w for w in self._by_id.values() if w.assignable and w.fingerprint == fingerprint]
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
            return min(candidates, key=lambda w: (w.load, len(w.sessions), w.registered_unix))
