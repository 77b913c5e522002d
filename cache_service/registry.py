"""A draft worker as the cache knows it: what it said when it registered, which pool it serves, the
queue of commands for it. Which sessions it serves is card.cache_service.assignment's."""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from card.common.drafts import POOL_NAME, DraftEntry, pool_name
from card.engine.shared.commands import DraftCommand
from card.engine.shared.errors import (
    InvalidArgument,
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

    name: str  # unique; a name is taken over only from a worker that is gone (Assignments.register)
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
    """One registration. ``sessions``, ``streaming``, ``layer_streams`` and ``draining`` are the
    Assignments' (guarded by its lock)."""

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
    # the PublishLayers streams open, each by its key with the callable that ends it: they end with
    # the worker (``end_layer_streams``), so that a registration that expired holds no server thread
    layer_streams: dict[object, Callable[[], object]] = field(default_factory=dict)
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
            # the worker and the sessions move to other workers (Assignments.gone)
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

    def end_layer_streams(self) -> int:
        """Cancel every PublishLayers stream of this worker (it is gone); how many. Called without
        the assignments' lock: a cancel takes gRPC's own (leaf) lock of that call."""
        cancels = list(self.layer_streams.values())
        for cancel in cancels:
            cancel()
        return len(cancels)

    @property
    def publishing(self) -> int:
        """PublishLayers streams open."""
        return len(self.layer_streams)

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
