"""The cache's assignment of sessions to draft workers (card.cache_service.assignment), in process:
"a worker is gone", drain, pause, a dropped session and rebalancing, each checked on the workers'
real command queues and the sessions' real CardSessions; and the cache's locks: a session whose
lock a slow Step holds stalls no other session (with the table as it was for the negative control).
The same rules through real gRPC: test_cache_service.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from card.cache_service import metrics
from card.cache_service.assignment import Assignments, Seat, WorkerLink
from card.cache_service.config import CacheConfig
from card.cache_service.registry import DraftRegistration, Worker
from card.cache_service.sessions import Session, SessionTable
from card.cache_service.store import RedisStore
from card.engine.shared.commands import DraftCommand, StartDraft, StopDraft
from card.engine.shared.config import TreeParams
from card.engine.shared.errors import NotFound
from card.engine.shared.session import CardSession
from card.engine.shared.tree import Correction
from tests.services.cache_helpers import TIMEOUT, wait_for

PROMPT = (1, 2, 3)


def worker(assignments: Assignments, name: str, capacity: int = 4, pool: str = "p") -> Worker:
    """A registered worker whose Commands stream is open (it may take sessions)."""
    w, _ = assignments.register(DraftRegistration(name, "model", "fp", capacity, pool), live_s=10.0)
    return assignments.open_stream(w.worker_id, cancel=lambda: None)


def seat(assignments: Assignments, name: str, draft: str = "") -> Seat:
    card = CardSession(TreeParams(), "cpu")
    card.open(PROMPT)
    route = assignments.route(draft, "fp")
    return assignments.join(Seat(name, "fp", card, route))


def sent(w: Worker) -> list[DraftCommand | None]:
    """The commands queued for ``w`` since the last call (None: its stream was told to end)."""
    out = []
    while not w.commands.empty():
        out.append(w.commands.get_nowait())
    return out


def serving(s: Seat) -> Worker | None:
    """The worker the session's CardSession drafts through now (what ``_follow`` applied)."""
    link = s.card.link
    return link.worker if isinstance(link, WorkerLink) else None


def test_a_gone_workers_sessions_move_to_peers_with_room_and_the_rest_wait() -> None:
    a = Assignments()
    w1 = worker(a, "w1", capacity=2)
    s1, s2 = seat(a, "s1"), seat(a, "s2")
    assert serving(s1) is serving(s2) is w1 and w1.sessions == {"s1", "s2"}
    assert sent(w1) == [StartDraft("s1", PROMPT, 0), StartDraft("s2", PROMPT, 0)]
    w2 = worker(a, "w2", capacity=1)
    assert a.gone(w1, "left (test)")
    assert not a.gone(w1, "left again (test)")  # one path, once
    assert w1.closed and a.workers() == [w2] and sent(w1) == [None]  # no command after its end
    moved, waiting = (s1, s2) if s1.worker is w2 else (s2, s1)
    assert w2.sessions == {moved.session_id} and serving(moved) is w2
    assert waiting.worker is None and serving(waiting) is None and not waiting.linked(w1.worker_id)
    assert sent(w2) == [StartDraft(moved.session_id, PROMPT, 0)]
    w3 = worker(a, "w3")  # a worker whose stream opens takes the waiting session at once
    assert serving(waiting) is w3 and sent(w3) == [StartDraft(waiting.session_id, PROMPT, 0)]
    assert a.gone(w2, "closed its command stream (test)")
    assert serving(moved) is w3 and w3.sessions == {"s1", "s2"} and sent(w2) == [None]


def test_drain_moves_sessions_tells_the_drained_worker_and_resume_takes_new_ones() -> None:
    a = Assignments()
    w1 = worker(a, "w1")
    seats = [seat(a, f"s{i}") for i in range(2)]
    w2 = worker(a, "w2", capacity=3)
    sent(w1)
    workers, moved = a.drain(name="w1")
    assert workers == [w1] and moved == 2 and w1.draining and not w1.sessions
    assert sent(w1) == [StopDraft("s0"), StopDraft("s1")]  # alive: told to stop each
    assert [serving(s) for s in seats] == [w2, w2]
    assert seat(a, "s2").worker is w2  # a drained worker takes nothing new
    late = seat(a, "s3")  # w2 is full
    assert late.worker is None
    workers, moved = a.drain(pool="p", resume=True)
    assert workers == [w1, w2] and moved == 0 and serving(late) is w1  # resumed: it takes the waiting one
    with pytest.raises(NotFound, match="no draft pool 'nope'"):
        a.drain(pool="nope")


def test_a_freed_place_goes_to_a_waiting_session_pause_resume_and_drop() -> None:
    a = Assignments()
    w = worker(a, "w", capacity=1)
    first, second = seat(a, "first"), seat(a, "second")
    assert (first.worker, second.worker) == (w, None)
    sent(w)
    first.card.close()  # as SessionTable.close: its card stops the worker, then its place is free
    a.leave(first)
    assert serving(second) is w and sent(w) == [StopDraft("first"), StartDraft("second", PROMPT, 0)]

    a.pause(second, True)  # its worker stops and serves others; it waits for a resume, not a place
    assert second.worker is None and serving(second) is None and sent(w) == [StopDraft("second")]
    third = seat(a, "third")
    assert third.worker is w
    third.card.close()
    a.leave(third)
    assert serving(second) is None  # paused: a free place is not its
    a.pause(second, False)
    assert serving(second) is w
    assert sent(w) == [StartDraft("third", PROMPT, 0), StopDraft("third"), StartDraft("second", PROMPT, 0)]

    assert not a.dropped("second", "another-worker")  # only the worker serving it can give it up
    assert a.dropped("second", w.worker_id)
    assert second.refused and serving(second) is None and not w.sessions
    assert sent(w) == []  # a worker that dropped a session holds nothing of it: no StopDraft
    a.pause(second, True)
    a.pause(second, False)  # never offered to a worker again, resumed or not
    assert serving(second) is None and seat(a, "fresh").worker is w


def test_the_assignments_lock_is_free_while_a_follow_waits_for_a_session() -> None:
    """A worker goes while a Step of one of its sessions holds that session's lock: the caller
    that decided the move waits for that session (it must, to move it), holding no lock, so
    opening another session meanwhile does not wait."""
    a = Assignments()
    w1 = worker(a, "w1")
    busy = seat(a, "busy")
    worker(a, "w2")
    left, opened = threading.Event(), threading.Event()
    with busy.card.lock:  # a slow Step of ``busy``
        threading.Thread(target=lambda: (a.gone(w1, "left (test)"), left.set()), daemon=True).start()
        wait_for(lambda: w1.closed, what="w1 unregistered")
        threading.Thread(target=lambda: (seat(a, "other"), opened.set()), daemon=True).start()
        assert opened.wait(TIMEOUT)
        assert not left.is_set()  # it moves ``busy`` once the Step is done
        assert serving(busy) is w1
    assert left.wait(TIMEOUT) and serving(busy) is not None and serving(busy) is not w1


# ---- the convoy ----------------------------------------------------------------------------------
class ConvoyTable(SessionTable):
    """Negative control: the table as it was, whose close waited for the session's lock while
    holding the table lock (which every OpenSession, Step and close takes)."""

    def _remove(self, session_id: str) -> Session:
        with self.lock:
            session = self._sessions.pop(session_id)
            session.card.close()  # waits for the session's lock, the table lock held
        self.assignments.leave(session.seat)
        metrics.SESSIONS_OPEN.dec()
        return session


@pytest.fixture
def config(redis_url: str, redis_prefix: str) -> Iterator[tuple[CacheConfig, RedisStore]]:
    config = CacheConfig(redis_url=redis_url, redis_prefix=redis_prefix, metrics_port=0)
    store = RedisStore(config.redis_url, config.redis_prefix)
    yield config, store
    store.close()


def others_go_on(table: SessionTable, wait_s: float) -> bool:
    """Session A's lock is held (a slow Step of A) while A is closed: do another session's Step
    and close, and a new session's OpenSession, finish within ``wait_s`` meanwhile? Afterwards
    (A's Step done) everything finishes either way."""
    a = table.open(PROMPT, "fp", "target")
    b = table.open(PROMPT, "fp", "target")
    a_closed, others_done = threading.Event(), threading.Event()

    def others() -> None:
        c = table.open(PROMPT, "fp", "target")
        table.step(b.session_id, Correction(0, (), (), 5))
        table.close(b.session_id)
        table.close(c.session_id)
        others_done.set()

    with a.lock:
        threading.Thread(target=lambda: (table.close(a.session_id), a_closed.set()), daemon=True).start()
        wait_for(lambda: len(table) == 1, what="A's close to take it out of the table")
        threading.Thread(target=others, daemon=True).start()
        went_on = others_done.wait(wait_s)
        assert not a_closed.is_set()  # A's close waits for its Step
    assert a_closed.wait(TIMEOUT) and others_done.wait(TIMEOUT) and len(table) == 0
    return went_on


@pytest.mark.parametrize("table_class", [SessionTable, ConvoyTable], ids=["table", "negative-control-convoy"])
def test_a_slow_step_of_one_session_stalls_no_other(config: tuple[CacheConfig, RedisStore],
                                                     table_class: type[SessionTable]) -> None:
    """With a worker serving every session (so closing and opening move places too). The old
    table stalled them all until A's Step ended: deterministically, since they wait for the
    table lock its close held."""
    cache_config, store = config
    assignments = Assignments()
    worker(assignments, "w", capacity=8)
    table = table_class(cache_config, store, assignments)
    try:
        if table_class is SessionTable:
            assert others_go_on(table, TIMEOUT)
        else:
            assert not others_go_on(table, 1.0)
    finally:
        table.records.stop()
