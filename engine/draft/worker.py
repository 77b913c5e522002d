"""A draft worker: one draft model serving up to ``slots`` sessions from one thread, all of them
in one forward per round.

Three kinds, by what it is given (``model``, ``ngram``):
    neural      (model, None):   card.engine.draft.drafter.Drafter sessions on a shared KV pool
    cascade     (model, table):  the same, each forward also checking the n-gram table's likeliest
                                 continuations of its frontier (drafts verifying drafts)
    model-free  (None, table):   card.engine.draft.ngram.NgramDrafter sessions; no forward, no KV cache; the
                                 table is the worker's shared n-gram table (or None: each session
                                 drafts from its own text alone, ``ngram_config`` says how)

The worker never waits for the target. Each round it applies every queued command (start,
advance, stop), asks every session what it needs next (``Drafter.plan``: a prefill chunk, its
frontier's K nodes, or a layer regrown without a forward), runs **one** forward over all of them
on the shared KV pool (card.engine.shared.kv_pool: flattened rows, attention per session under its own tree
mask), and hands each session's new layer to ``publish``. A round with 8 sessions costs about what
one session's forward costs where the forward is bound by reading the weights, which is what
makes drafting affordable under load. It sleeps only when no session has anything to grow (all
trees at max depth), until the next command arrives. Drafters are touched by the worker thread
alone; other threads talk to it through the command queue (bounded: MAX_QUEUED_COMMANDS, and a
caller waits for room, so a worker far behind slows the link that feeds it instead of growing).

``idle`` is set while the worker sleeps with no command pending and cleared by the thread that
queues a command, before the worker can wake: a target thread that sees it set may borrow the
worker's cores until its own next command (card.engine.inprocess.core_lending).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from card.engine.draft.drafter import Drafter, grow_round, tree_rows
from card.engine.draft.ngram import NgramDrafter
from card.engine.draft.static_tree import tree_step_for
from card.engine.shared.commands import AdvanceDraft, DraftCommand, StartDraft, StopDraft
from card.engine.shared.config import ChainDraw, DrafterKind, NgramConfig, TreeParams
from card.engine.shared.errors import CardError, InvalidArgument, ResourceExhausted
from card.engine.shared.hf import CausalLM
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.ngram_stats import NgramTable
from card.engine.shared.torch_threads import name_os_thread
from card.engine.shared.tree import Advance, Layer

log = logging.getLogger(__name__)

Publish = Callable[[str, Layer], None]


@dataclass
class DraftSessionStats:
    forwards: int = 0
    layers: int = 0
    idle_s: float = 0.0


@dataclass
class _Session:
    drafter: Drafter | NgramDrafter
    stats: DraftSessionStats = field(default_factory=DraftSessionStats)
    idle_since: float | None = None


# Commands queued for a worker at most (starts, advances, stops: a few per session and target
# step; a worker this far behind is overloaded, and apply() makes its callers wait)
MAX_QUEUED_COMMANDS = 4096


class DraftWorker:
    """``slots`` sessions at most, each of up to ``max_len`` committed tokens (plus its tree's
    rows); with a model, their keys and values live in one KVPool allocated here. ``ngram_config``
    with no model makes a model-free worker over a vocabulary of ``vocab_size`` ids; with a model,
    a cascade (``ngram`` is the shared table, None when its budget is 0)."""

    @classmethod
    def of_kind(cls, kind: DrafterKind, model: CausalLM | None, params: TreeParams,
                publish: Publish, *,
                ngram_config: NgramConfig | None = None, ngram: NgramTable | None = None,
                **kwargs: object) -> DraftWorker:
        """The worker ``kind`` names (the one place a kind becomes a worker): ``model`` for neural
        and cascade, ``ngram_config`` (and the shared ``ngram`` table) for cascade and ngram."""
        if kind.needs_model and model is None:
            raise InvalidArgument(f"a {kind.value} draft worker needs a draft model")
        if kind.uses_ngram and ngram_config is None:
            raise InvalidArgument(f"a {kind.value} draft worker needs n-gram settings")
        return cls(model if kind.needs_model else None, params, publish,
                   ngram_config=ngram_config if kind.uses_ngram else None,
                   ngram=ngram if kind.uses_ngram else None, **kwargs)  # type: ignore[arg-type]

    def __init__(self, model: CausalLM | None, params: TreeParams, publish: Publish, *, slots: int,
                 max_len: int, threads: int | None = None, name: str = "draft",
                 ngram_config: NgramConfig | None = None, ngram: NgramTable | None = None,
                 vocab_size: int | None = None, on_forward: Callable[[int], None] | None = None,
                 on_drop: Callable[[str], None] | None = None, prefix_caching: bool = True,
                 cached_slots: int = 0, cache_bytes: int | None = None,
                 decode_step: str = "auto", max_commands: int = MAX_QUEUED_COMMANDS) -> None:
        if model is None and ngram_config is None:
            raise InvalidArgument("a draft worker needs a model, n-gram settings, or both")
        self.model = model
        self.kind = (DrafterKind.NGRAM if model is None else
                     DrafterKind.CASCADE if ngram_config is not None else DrafterKind.NEURAL)
        self.params = params
        self.slots = slots
        self.max_len = max_len
        self.ngram_config = ngram_config
        self.ngram = ngram
        if vocab_size is None and model is not None:
            vocab_size = model.get_input_embeddings().num_embeddings
        self.vocab_size = vocab_size or 0
        if not self.vocab_size:
            raise InvalidArgument("a model-free draft worker needs the vocabulary size")
        # prefix caching: a new session starts from the longest prefix a slot still holds
        # (card.engine.shared.prefix_cache; the draft's prefill is what a card session waits for
        # first); ``cached_slots`` more keep finished sessions' text, within ``cache_bytes`` (KVPool)
        self.pool = (KVPool(model, slots, max_len + tree_rows(params), prefix_caching=prefix_caching,
                            cached_slots=cached_slots if prefix_caching else 0,
                            cache_bytes=cache_bytes if prefix_caching else None)
                     if model is not None else None)
        # the tree rows at static shapes (card.engine.draft.static_tree), or None: the eager forward
        lookahead = ngram_config.lookahead if ngram_config is not None else 0
        self.step = tree_step_for(model, self.pool, decode_step, params.width * (1 + lookahead))
        self.forwards = 0  # draft forwards run (each for every session that had work that round)
        self.batch_rows = 0  # sessions those forwards served, summed (mean batch = rows / forwards)
        self._on_forward = on_forward or (lambda sessions: None)  # after each forward (metrics)
        # a session this worker gave up on its own (not told to stop): whoever assigned it frees its place
        self.on_drop = on_drop or (lambda session_id: None)
        self.publish = publish
        self.threads = threads
        self.name = name
        self._commands: queue.Queue[DraftCommand | None] = queue.Queue()  # None: wake up
        # the queue's bound: a command waits for room before it takes _idle_lock (the worker takes
        # that lock to go idle, so a put blocking under it would wait for the worker forever); each
        # command the worker takes gives its room back
        self._room = threading.BoundedSemaphore(max_commands)
        self._sessions: dict[str, _Session] = {}
        self._stats_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False
        self.idle = threading.Event()
        self._idle_lock = threading.Lock()  # makes "queue empty -> idle" atomic with "queue a command"

    # ---- commands (any thread) ---------------------------------------------------------------
    def apply(self, command: DraftCommand) -> None:
        """Queue a command (engine.shared.commands); the worker's thread applies it before its
        next round. Blocks while ``max_commands`` wait already."""
        self._room.acquire()  # a worker max_commands behind slows its callers (backpressure)
        with self._idle_lock:
            self.idle.clear()
            self._commands.put(command)

    def start_session(self, session_id: str, committed: Sequence[int], epoch: int = 0,
                      draw: ChainDraw | None = None) -> None:
        self.apply(StartDraft(session_id, tuple(committed), epoch, draw))

    def advance(self, session_id: str, advance: Advance) -> None:
        self.apply(AdvanceDraft(session_id, advance))

    def stop_session(self, session_id: str) -> None:
        self.apply(StopDraft(session_id))

    def session_stats(self, session_id: str) -> DraftSessionStats | None:
        """A snapshot of a live session's stats, the idle period under way included."""
        with self._stats_lock:
            s = self._sessions.get(session_id)
            if s is None:
                return None
            snap = DraftSessionStats(**vars(s.stats))
            if s.idle_since is not None:
                snap.idle_s += time.perf_counter() - s.idle_since
            return snap

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    def kv_slots_held(self) -> int:
        """KV slots held by all drafters (0 when no session is live)."""
        return sum(s.drafter.kv_length() for s in list(self._sessions.values()))

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name=f"draft-worker-{self.name}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self._running = False
        with self._idle_lock:
            self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- the loop (worker thread) ------------------------------------------------------------
    def _apply(self, command: DraftCommand) -> None:
        match command:
            case StartDraft(sid, committed, epoch, draw):
                self._drop(sid)  # a restart gives its slot back first
                drafter = self._new_drafter()
                drafter.start(committed, epoch, draw)
                with self._stats_lock:
                    self._sessions[sid] = _Session(drafter)
            case AdvanceDraft(sid, advance):
                s = self._sessions.get(sid)
                if s is None:
                    return
                with self._stats_lock:
                    if s.idle_since is not None:
                        s.stats.idle_s += time.perf_counter() - s.idle_since
                        s.idle_since = None
                s.drafter.advance(advance)
            case StopDraft(sid):
                self._drop(sid)

    def _new_drafter(self) -> Drafter | NgramDrafter:
        if self.model is None:
            if len(self._sessions) >= self.slots:
                raise ResourceExhausted(f"the draft worker serves {self.slots} sessions at most (all held)")
            assert self.ngram_config is not None
            return NgramDrafter(self.params, self.vocab_size, self.ngram_config, self.ngram, self.max_len)
        return Drafter(self.model, self.params, self.pool, ngram_config=self.ngram_config, ngram=self.ngram)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._safe_apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _safe_apply(self, command: DraftCommand | None) -> None:
        if command is None:  # close()'s wake-up: it took no room
            return
        self._room.release()
        try:
            self._apply(command)
        except Exception as exc:  # one broken session must not take the worker (and every session) down
            self._fail(command.session_id, exc)

    def _drop(self, session_id: str) -> None:
        with self._stats_lock:
            s = self._sessions.pop(session_id, None)
        if s is not None:
            s.drafter.release()

    def _run(self) -> None:
        name_os_thread(f"draft-{self.name}")  # its OpenMP workers, started by it, take the name too
        if self.threads:
            torch.set_num_threads(self.threads)
        while self._running:
            self._drain(block=False)
            if not self._round():
                with self._idle_lock:
                    if self._commands.empty():
                        self.idle.set()
                self._drain(block=True)

    def _round(self) -> bool:
        """Grow every session that can grow by one forward (engine.draft.drafter.grow_round);
        False when none could."""
        sessions = list(self._sessions.items())
        grown = grow_round(self.model, self.pool, [s.drafter for _, s in sessions], self._forwarded,
                           self.step)
        progressed = False
        for (sid, s), g in zip(sessions, grown, strict=True):
            if g.error is not None:
                self._fail(sid, g.error)
                continue
            if g.forwarded:
                s.stats.forwards += 1
            if g.idle:
                if s.idle_since is None:
                    with self._stats_lock:
                        s.idle_since = time.perf_counter()
                continue
            progressed = True
            for layer in g.layers:
                self._published(sid, s, layer)
        return progressed

    def _forwarded(self, sessions: int) -> None:
        self.forwards += 1
        self.batch_rows += sessions
        self._on_forward(sessions)

    def _published(self, sid: str, s: _Session, layer: Layer) -> None:
        s.stats.layers += 1
        self.publish(sid, layer)

    def _fail(self, sid: str, exc: BaseException) -> None:
        if isinstance(exc, CardError):
            log.warning("draft session %s dropped: %s", sid, exc)
        else:
            log.error("draft session %s failed; dropping it", sid, exc_info=exc)
        self._drop(sid)
        self.on_drop(sid)
