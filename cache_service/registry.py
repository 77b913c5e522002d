"""Live draft workers: who they are, what they can serve, and the queue of commands for each."""

from __future__ import annotations

import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

from card.common.drafts import check_named_draft
from card.engine.shared.commands import DraftCommand
from card.engine.shared.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_CAPACITY = 4096  # sessions per worker: a bound, not a target


@dataclass(frozen=True)
class DraftRegistration:
    """What a draft worker says about itself when it registers."""

    name: str  # unique; a name is taken over only from a worker that is gone (Registry.register)
    model: str
    fingerprint: str  # of its tokenizer; only sessions of targets with the same one are served
    capacity: int  # most concurrent sessions, in [1, MAX_CAPACITY]

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


@dataclass(eq=False)
class Worker:
    """One registration. ``sessions`` is guarded by the owning Registry's lock."""

    worker_id: str
    name: str
    model: str
    fingerprint: str
    capacity: int  # most concurrent sessions
    registered_unix: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    last_heartbeat_unix: float = field(default_factory=time.time)
    sessions: set[str] = field(default_factory=set)
    streaming: bool = False  # a Commands stream is open
    closed: bool = False
    commands: queue.Queue[DraftCommand | None] = field(default_factory=queue.Queue)

    def send(self, command: DraftCommand) -> None:
        if not self.closed:
            self.commands.put(command)

    def close(self) -> None:
        """End the Commands stream (a None wakes and stops it)."""
        self.closed = True
        self.commands.put(None)

    @property
    def full(self) -> bool:
        return self.capacity > 0 and len(self.sessions) >= self.capacity

    @property
    def load(self) -> float:
        return len(self.sessions) / self.capacity if self.capacity > 0 else 0.0

    def record(self) -> dict[str, str | int | float]:
        """The registry entry as Redis holds it (``Status`` reads other replicas' workers there)."""
        return {
            "name": self.name, "model": self.model, "tokenizer_fingerprint": self.fingerprint,
            "capacity": self.capacity, "worker_id": self.worker_id,
            "active_sessions": len(self.sessions), "last_heartbeat_unix": self.last_heartbeat_unix,
            "registered_unix": self.registered_unix,
        }


class Registry:
    """Workers by id and by name. Methods are thread-safe; ``lock`` is shared with the session
    table so that assigning a session and counting a worker's load happen together."""

    def __init__(self, lock: threading.RLock | None = None, max_workers: int = 1024) -> None:
        self.lock = lock or threading.RLock()
        self.max_workers = max_workers
        self._by_id: dict[str, Worker] = {}
        self._by_name: dict[str, Worker] = {}

    def register(self, reg: DraftRegistration, live_s: float) -> tuple[Worker, Worker | None]:
        """Add a worker; returns it and the worker it replaced (same name), which is now removed.

        A name is replaced only when its holder is gone: no Commands stream open and no heartbeat
        for ``live_s``. Otherwise AlreadyExists: a second registration (a misconfigured twin, or
        someone holding a stolen draft token) cannot evict a live worker and start a name war. A
        worker that restarts under its name gets it back once the old stream has ended (at once
        when its connection closed, else after ``live_s``); the draft link retries with backoff.
        """
        worker = Worker(worker_id=uuid.uuid4().hex, name=reg.name, model=reg.model,
                        fingerprint=reg.fingerprint, capacity=reg.capacity)
        with self.lock:
            old = self._by_name.get(reg.name)
            if old is None and len(self._by_id) >= self.max_workers:
                raise ResourceExhausted(f"the registry is full ({self.max_workers} draft workers)")
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

    def pick(self, fingerprint: str, name: str = "", target_model: str = "the target") -> Worker | None:
        """The worker for a new session: ``name`` if given, else the least-loaded matching one.

        NotFound: ``name`` is not registered. FailedPrecondition: its tokenizer differs.
        ResourceExhausted: the named worker is at capacity. None: no matching worker has room
        (the session opens without speculation).
        """
        with self.lock:
            if name:
                worker = self._by_name.get(name)
                check_named_draft(name, (worker.model, worker.fingerprint) if worker else None, self._by_name,
                                  fingerprint, target_model)
                assert worker is not None
                if worker.full:
                    raise ResourceExhausted(
                        f"draft {name!r} is at capacity ({worker.capacity} sessions); retry later or "
                        f"leave the draft unnamed"
                    )
                return worker
            candidates = [w for w in self._by_id.values() if w.fingerprint == fingerprint and not w.full]
            if not candidates:
                return None
            return min(candidates, key=lambda w: (w.load, len(w.sessions), w.registered_unix))
