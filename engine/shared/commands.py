"""What the cache tells a draft worker about one session, as engine values.

    StartDraft(session_id, committed, epoch, draw)   prefill ``committed`` (prompt + every
                        committed token) and grow a fresh tree under the virtual root of
                        ``epoch``; a session the worker already holds starts over
                        (DraftWorker.start_session); ``draw``: a rejection session, whose every
                        expanded node gets a child drawn from its tier B (Drafter.start)
    AdvanceDraft(session_id, advance)   the target's correction with the cache's verdict: re-root
                        the mirror tree on a hit, or restart it below the new committed text
                        (DraftWorker.advance)
    StopDraft(session_id)   the session is over: drop its tree and free its KV cache
                        (DraftWorker.stop_session)

The cache queues these per worker; card.common.convert turns them into the wire's DraftCommand
and back.
"""

from __future__ import annotations

from dataclasses import dataclass

from card.engine.shared.config import ChainDraw
from card.engine.shared.tree import Advance


@dataclass(frozen=True)
class StartDraft:
    session_id: str
    committed: tuple[int, ...]
    epoch: int
    draw: ChainDraw | None = None


@dataclass(frozen=True)
class AdvanceDraft:
    session_id: str
    advance: Advance


@dataclass(frozen=True)
class StopDraft:
    session_id: str


DraftCommand = StartDraft | AdvanceDraft | StopDraft
