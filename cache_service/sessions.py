"""The cache's sessions: which draft worker serves each, their records, their idleness.

Query-and-correct itself is engine.shared.session.CardSession (tree, committed text, chain
settings: the cache's with the target's ChainPolicy over them); each Session here holds one, with
a ``WorkerLink`` that queues StartDraft / AdvanceDraft / StopDraft for the worker serving it.
Everything here is engine values; wire messages exist only in the servicer and convert.py.

Changing a session's worker (one left, one joined, one replaced) detaches the old link and
attaches a new one: the CardSession restarts the tree under the virtual root of the epoch and the
new worker gets ``StartDraft(committed, epoch)``, at once or right after the next correction when
the tree still holds nodes the target may be verifying. Output never depends on any of this: the
target verifies every token.

Records (card.cache_service.records): no session RPC waits for Redis. OpenSession writes
nothing; a session that lives through a monitor round gets its live record written once, by the
monitor (``flush_records``); CloseSession hands the finished record (a bounded summary) and its
totals to the cache's RecordWriter thread and returns.

Lock order: the table lock (shared with the Registry) before any session's lock; Redis is never
called under either. A session's ``record_lock`` is taken alone (never with the table lock or the
session's lock held), by the monitor around a live-record write and by the RecordWriter around the
finished one, so that a live write in flight cannot land after the finished record.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from card.cache_service import metrics
from card.cache_service.config import CacheConfig
from card.cache_service.pools import PoolStats
from card.cache_service.records import FinishedRecord, RecordWriter, stats_fields
from card.cache_service.registry import Registry, Worker
from card.cache_service.store import MetadataStore
from card.common.drafts import ANY, Route
from card.engine.shared.commands import AdvanceDraft, StartDraft, StopDraft
from card.engine.shared.config import ChainDraw, ChainPolicy, TreeParams
from card.engine.shared.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from card.engine.shared.ngram_stats import PromptLookup
from card.engine.shared.session import CardSession, StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Advance, Chain, Correction, Layer, Outcome, TwoTierTree

HITS = (Outcome.HIT, Outcome.SECONDARY_HIT)

log = logging.getLogger(__name__)


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
class Session:
    session_id: str
    target_model: str
    fingerprint: str
    draft_name: str  # the draft the target asked for (a pool or a worker); "" = any matching worker
    card: CardSession  # tree, committed text, chain settings (the cache's, its ChainPolicy over them)
    prompt_tokens: int
    vocab_size: int = 0  # the target's (OpenSession); layers' tokens must lie below it
    opened_unix: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)  # open, last Step or keepalive
    idle_timeout_s: float = 0.0  # the target's (OpenSession); 0 = the cache's
    draft_refused: bool = False  # a worker dropped it (LayerMessage.dropped): no worker is tried again
    # the target's drafting policy has no worker draft for it (none, or the lookup alone): chains
    # are the lookup's or empty, until a Step names the worker (StepRequest.drafter)
    paused: bool = False
    worker: Worker | None = None
    route: Route = ANY  # where its workers come from (draft_name resolved at open)
    default_pool: str = ""  # the target's --default-pool, for an unnamed session
    # the chain handed out last: its length and the pool whose worker grew it ("" = none); the next
    # Step's correction is that pool's acceptance (PoolStats)
    chain_len: int = 0
    chain_pool: str = ""
    last_step: float = field(default_factory=time.monotonic)
    # draft counters: from workers that served earlier + the current worker's latest layer
    draft_forwards_done: int = 0
    draft_idle_done: float = 0.0
    draft_forwards: int = 0
    draft_idle_s: float = 0.0
    # live record: the monitor saw the session in one round (it lived through one), wrote its record
    seen_by_monitor: bool = False
    live_written: bool = False
    # serialises Redis writes of this session's record so a late flush cannot revive a closed one
    record_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def lock(self) -> threading.Condition:
        return self.card.lock

    @property
    def epoch(self) -> int:
        return self.card.epoch

    @property
    def tree(self) -> TwoTierTree:
        return self.card.tree

    @property
    def params(self) -> TreeParams:
        return self.card.params

    @property
    def closed(self) -> bool:
        return self.card.closed

    @property
    def draft(self) -> str:
        """Name of the worker serving the session now; "" when none does."""
        return self.worker.name if self.worker else ""

    def record(self) -> dict[str, str | int | float]:
        """The live-session record as Redis holds it."""
        return {
            "status": "live", "target_model": self.target_model, "fingerprint": self.fingerprint,
            "draft_requested": self.draft_name, "draft": self.draft,
            "prompt_tokens": self.prompt_tokens, "committed_tokens": len(self.card.committed),
            "epoch": self.epoch, "tree_nodes": len(self.tree), "max_chain": self.params.max_chain,
            "min_path_prob": self.params.min_path_prob, "b_extension": int(self.params.b_extension),
            "opened_unix": self.opened_unix, "updated_unix": time.time(),
        }

    def draft_totals(self) -> tuple[int, float]:
        return self.draft_forwards_done + self.draft_forwards, self.draft_idle_done + self.draft_idle_s


class SessionTable:
    """``records``: the writer of finished records (the cache's; started and stopped by it). Without
    one the table makes and starts its own."""

    def __init__(self, config: CacheConfig, store: MetadataStore, registry: Registry,
                 records: RecordWriter | None = None, pool_stats: PoolStats | None = None) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.pool_stats = pool_stats or PoolStats()
        if records is None:
            records = RecordWriter(store)
            records.start()
        self.records = records
        self.lock = registry.lock
        self.device = torch.device(config.device)
        self._sessions: dict[str, Session] = {}
        self.closing = False  # set by close_all at shutdown: no new sessions

    # ---- lookup -------------------------------------------------------------------------------
    def get(self, session_id: str) -> Session:
        with self.lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id!r} is not open on this cache service")
        return session

    def sessions(self) -> list[Session]:
        with self.lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- worker assignment (table lock held) --------------------------------------------------
    def _attach(self, session: Session, worker: Worker) -> None:
        worker.sessions.add(session.session_id)
        with session.lock:
            session.worker = worker
            session.card.attach(WorkerLink(worker, session.session_id))
        log.info("session %s served by draft %s", session.session_id, worker.name,
                 extra={"session_id": session.session_id, "draft": worker.name})

    def _detach(self, session: Session, stop: bool = False, keep_tree: bool = True) -> None:
        """The session's worker no longer serves it (it left, dropped it, is drained, or the
        session is paused): no command goes to it after this one; ``stop``: tell it to stop (a
        drained worker is alive, and counts its sessions down to exit). With ``keep_tree`` the tree
        it grew serves the chain in flight and the next worker starts after the next correction;
        without, the tree empties now."""
        worker = session.worker
        if worker is None:
            return
        worker.sessions.discard(session.session_id)
        with session.lock:
            forwards, idle = session.draft_forwards, session.draft_idle_s
            session.draft_forwards_done += forwards
            session.draft_idle_done += idle
            session.draft_forwards, session.draft_idle_s = 0, 0.0
            session.worker = None
            link = session.card.detach(keep_tree)
        if stop and link is not None:
            link.stop()

    def _rebalance(self) -> None:
        """Give every session without a worker one, where a matching worker has room."""
        for session in self._sessions.values():
            if session.worker is not None or session.draft_refused or session.paused:
                continue
            worker = self.registry.pick(session.fingerprint, session.route, session.default_pool)
            if worker is not None:
                self._attach(session, worker)

    def worker_joined(self, worker: Worker, replaced: Worker | None) -> None:
        with self.lock:
            if replaced is not None:
                self.worker_left(replaced)
            self._rebalance()

    def rebalance(self) -> None:
        """A worker may take sessions again (its command stream opened, it was resumed): give
        every waiting session one where a matching worker has room."""
        with self.lock:
            self._rebalance()

    def worker_left(self, worker: Worker) -> None:
        """``worker`` is gone: its sessions continue without it (or with another worker)."""
        with self.lock:
            orphans = [self._sessions[sid] for sid in list(worker.sessions) if sid in self._sessions]
            worker.sessions.clear()
            for session in orphans:
                self._detach(session)
            self._rebalance()
        if orphans:
            moved = sum(s.worker is not None for s in orphans)
            log.warning("draft %s left; %d of its %d session(s) moved to other workers, the rest continue "
                        "without a draft", worker.name, moved, len(orphans), extra={"draft": worker.name})

    def drain(self, workers: Sequence[Worker]) -> int:
        """Move the sessions of ``workers`` (now drained: Registry.drain) to other workers: each
        drained worker is told to stop them, and they go where a new session of theirs would (their
        pool first). Returns how many moved to a worker."""
        with self.lock:
            moving = [self._sessions[sid] for w in workers if w.draining
                      for sid in sorted(w.sessions) if sid in self._sessions]
            for session in moving:
                self._detach(session, stop=True)
            self._rebalance()
            moved = sum(s.worker is not None for s in moving)
        if moving:
            log.info("drained %s: %d of %d session(s) moved to other workers",
                     ", ".join(w.name for w in workers), moved, len(moving))
        return moved

    # ---- target side --------------------------------------------------------------------------
    def open(self, prompt_ids: Sequence[int], fingerprint: str, target_model: str,
             draft: str = "", chain: ChainPolicy | None = None, vocab_size: int = 0,
             context_window: int = 0, idle_timeout_s: float = 0.0, draw: ChainDraw | None = None,
             default_pool: str = "", paused: bool = False) -> Session:
        """``draft``: a pool or a worker's name (card.common.drafts.route_draft; "" = any pool,
        ``default_pool`` first); ``chain`` goes over the configured chain settings for this session
        (None: keep them);
        ``draw``: its chains are drawn (verify rejection; None: the best path);
        ``vocab_size`` / ``context_window``: the target's (0 = not told); ``idle_timeout_s``: how
        long the session lives without a Step or keepalive (0 = the cache's; it is also the cap).
        InvalidArgument: an empty
        prompt, one at or past the context window, a token outside the vocabulary, no fingerprint,
        or a chain policy out of range. ``paused``: no worker drafts for it until a Step resumes it.
        NotFound / FailedPrecondition: ``draft`` names no pool or
        worker, or one with another tokenizer. ResourceExhausted: the named worker is full."""
        if self.closing:
            raise Unavailable("the cache service is shutting down; retry against another replica")
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if context_window and len(prompt_ids) >= context_window:
            raise InvalidArgument(f"the prompt has {len(prompt_ids)} tokens, the target's context window "
                                  f"is {context_window}")
        if min(prompt_ids) < 0 or (vocab_size and max(prompt_ids) >= vocab_size):
            raise InvalidArgument(
                f"the prompt holds a token outside the vocabulary [0, {vocab_size or '...'})")
        if not fingerprint:
            raise InvalidArgument("tokenizer_fingerprint is required to match a draft to the target")
        params = chain.over(self.config.tree) if chain is not None else self.config.tree
        route = self.registry.route(draft, fingerprint, target_model or "the target", self.pool_stats.names())
        # model-free chains from the session's own text where its tree holds nothing (a miss while
        # the draft restarts, no worker free): the target verifies something every step
        lookup = PromptLookup(vocab_size) if self.config.model_free_chains and vocab_size else None
        card = CardSession(params, self.device, draw=draw, lookup=lookup)
        card.open(prompt_ids)
        session = Session(
            session_id=uuid.uuid4().hex, target_model=target_model or "unknown", fingerprint=fingerprint,
            draft_name=draft, card=card, prompt_tokens=len(prompt_ids), vocab_size=vocab_size,
            idle_timeout_s=idle_timeout_s, route=route, default_pool=default_pool, paused=paused,
        )
        with self.lock:
            pinned = self.registry.named(route.worker)
            if pinned is not None and pinned.full and not pinned.draining and not paused:
                raise ResourceExhausted(
                    f"draft {route.worker!r} is at capacity ({pinned.capacity} sessions); retry later, name "
                    f"its pool {route.pool!r}, or leave the draft unnamed")
            worker = None if paused else self.registry.pick(fingerprint, route, default_pool)
            self._sessions[session.session_id] = session
            if worker is not None:
                self._attach(session, worker)
        # no Redis write here: the monitor writes the live record of a session that outlives a round
        metrics.SESSIONS_OPEN.inc()
        log.info("session %s opened (%d prompt tokens, draft %s)", session.session_id, len(prompt_ids),
                 worker.name if worker else "none", extra={"session_id": session.session_id})
        return session

    def step(self, session_id: str, correction: Correction,
             pause_draft: bool = False) -> tuple[Chain, Outcome]:
        """Apply the target's correction and return the next chain; never waits for a draft.
        ``pause_draft``: the session's drafting is paused (its worker stops and its tree empties;
        the chain is the session's model-free lookup, empty without one); a Step without it
        resumes a paused session (a worker starts from the whole text)."""
        t0 = time.perf_counter()
        session = self.get(session_id)
        with session.lock:
            if session.closed:
                raise NotFound(f"session {session_id!r} is closed")
            result = session.card.step(correction)  # Aborted on a stale epoch
        if pause_draft != session.paused:
            self._pause(session, pause_draft)
            if pause_draft:  # the tree is gone: what the session's own text suggests, if anything
                with session.lock:
                    chain, looked_up = session.card.offer()
                result = StepResult(chain, result.outcome, looked_up)
        with session.lock:
            now = time.monotonic()
            pool, chain_len, busy_s = session.chain_pool, session.chain_len, now - session.last_step
            session.last_active = session.last_step = now
            session.chain_len = len(result.chain.tokens)
            serving = session.worker
            # a looked-up chain is no pool's: its acceptance says nothing of the draft
            drafted = session.chain_len and not result.looked_up
            session.chain_pool = serving.pool if serving is not None and drafted else ""
        assert result.outcome is not None
        if pool:
            self.pool_stats.record(pool, chain_len, len(correction.accepted_tokens), result.outcome in HITS,
                                   busy_s)
        metrics.STEPS.inc()
        if result.looked_up:
            metrics.LOOKUP_CHAINS.inc()
        metrics.OUTCOMES.labels(result.outcome.value).inc()
        metrics.STEP_LATENCY.observe(time.perf_counter() - t0)
        return result.chain, result.outcome

    def _pause(self, session: Session, pause: bool) -> None:
        """Pause a session's drafting (its worker is told to stop and serves others; its tree
        empties) or resume it (a worker is picked as for a new session, and starts from the whole
        committed text at once: the tree is empty)."""
        with self.lock:
            if session.closed:
                return
            session.paused = pause
            if pause:
                self._detach(session, stop=True, keep_tree=False)
                self._rebalance()  # its place on the worker may serve a waiting session
            elif not session.draft_refused:
                worker = self.registry.pick(session.fingerprint, session.route, session.default_pool)
                if worker is not None:
                    self._attach(session, worker)
        metrics.DRAFT_PAUSES.labels("pause" if pause else "resume").inc()

    def close(self, session_id: str, stats: GenerationStats | None = None,
              status: str = "finished") -> tuple[int, float]:
        """End the session everywhere; returns the draft's (forwards, idle seconds). Its finished
        record (a bounded summary, whatever ``stats`` holds) goes to the RecordWriter: this never
        waits for Redis, and a record the writer cannot take is dropped and counted."""
        session = self._remove(session_id)
        forwards, idle = session.draft_totals()
        card = session.card
        cache_counts = {o.value: n for o, n in card.outcomes.items()}
        record: dict[str, str | int | float] = {
            **session.record(),  # the live fields: the live record may never have been written
            "status": status, "closed_unix": time.time(), "epoch": session.epoch,
            "committed_tokens": len(card.committed), "steps": card.steps, "layers": card.layers,
            "lookup_chains": card.looked_up,
            "draft_forwards": forwards, "draft_idle_s": idle,
            **{f"cache_{k}{'es' if k.endswith('s') else 's'}": v for k, v in cache_counts.items()},
        }
        record.pop("updated_unix", None)
        record.pop("tree_nodes", None)  # the tree is freed
        totals: dict[str, float] = {
            "sessions": 1, "hits": cache_counts["hit"], "secondary_hits": cache_counts["secondary_hit"],
            "misses": cache_counts["miss"], "draft_forwards": forwards,
        }
        if stats is not None:
            record.update(stats_fields(stats))
            totals.update(new_tokens=stats.new_tokens, target_forwards=stats.target_forwards)
        self.records.submit(FinishedRecord(session_id, record, totals, self.config.session_ttl_s,
                                           guard=session.record_lock))
        log.info("session %s closed (%s, %d steps, draft forwards %d)", session_id, status,
                 card.steps, forwards, extra={"session_id": session_id})
        return forwards, idle

    def _remove(self, session_id: str) -> Session:
        with self.lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise NotFound(f"session {session_id!r} is not open on this cache service")
            worker = session.worker
            if worker is not None:
                worker.sessions.discard(session_id)
            with session.lock:
                session.worker = None
                session.card.close()  # StopDraft to the worker; the tree's tensors are freed now
            if worker is not None:
                self._rebalance()  # the freed slot may serve a waiting session
        metrics.SESSIONS_OPEN.dec()
        return session

    def retire_predecessors(self) -> int:
        """At start: every live record under this prefix belongs to a cache that is gone (one
        cache per prefix; trees live in its memory), e.g. one that was SIGKILLed. Each becomes a
        finished record, ``abandoned``, instead of staying live until its TTL. Best effort: with
        Redis down it is left to a later start. Returns how many were retired."""
        try:
            stale = [sid for sid in self.store.live_session_ids() if sid not in self._sessions]
            for sid in stale:
                self.store.finish_session(sid, {"status": "abandoned", "closed_unix": time.time(),
                                                "reason": "its cache service stopped without closing it"},
                                          self.config.session_ttl_s)
        except Unavailable as exc:
            log.warning("live records of a previous cache not retired: %s", exc)
            return 0
        if stale:
            log.warning("retired %d live session record(s) left by a previous cache service", len(stale))
        return len(stale)

    def close_all(self, status: str) -> None:
        """End every session and refuse new ones from now on (shutdown)."""
        self.closing = True
        for session in self.sessions():
            with contextlib.suppress(NotFound):  # closed concurrently
                self.close(session.session_id, status=status)

    # ---- draft side ---------------------------------------------------------------------------
    def apply_layer(self, session_id: str, worker_id: str, layer: Layer, draft_forwards: int = 0,
                    draft_idle_s: float = 0.0) -> bool:
        """Add a layer that worker ``worker_id`` grew to its session's tree, with the worker's
        counters for the session so far; False when it was dropped (session gone, sent by a
        worker that no longer serves the session). InvalidArgument: a layer no drafter grows
        (``Layer.check`` against the session's vocabulary), dropped whole."""
        with self.lock:
            session = self._sessions.get(session_id)
        if session is None:
            return False
        layer.check(session.vocab_size)
        with session.lock:
            worker = session.worker
            if worker is None or worker.worker_id != worker_id:
                return False
            if not session.card.apply_layer(layer):  # closed, or layers of the old tree
                return False
            session.draft_forwards = draft_forwards
            session.draft_idle_s = draft_idle_s
        return True

    def draft_dropped(self, session_id: str, worker_id: str) -> bool:
        """Worker ``worker_id`` gave the session up: free its place in the worker's capacity (a
        waiting session may take it). The session goes on with the chains its tree still holds,
        then without a draft; a worker that could not hold it once is not asked again. False when
        the worker does not serve the session (anymore)."""
        with self.lock:
            session = self._sessions.get(session_id)
            if session is None or session.worker is None or session.worker.worker_id != worker_id:
                return False
            worker = session.worker
            self._detach(session)
            session.draft_refused = True
            self._rebalance()
        log.warning("draft %s dropped session %s; it goes on without a draft", worker.name, session_id,
                    extra={"session_id": session_id, "draft": worker.name})
        return True

    # ---- records ------------------------------------------------------------------------------
    def flush_records(self, everything: bool = False) -> int:
        """The monitor's round (background; off every session RPC): write the live record of each
        session that has lived through one round (the previous one saw it) and has none yet, once
        per session; with ``everything`` (Redis came back and may have restarted empty) also those
        already written. Sessions that end within a round never get one. Unavailable: the store
        refused a write (the rest wait for the next round). Returns how many were written."""
        written = 0
        for session in self.sessions():
            if not session.seen_by_monitor:
                session.seen_by_monitor = True
                continue
            if session.live_written and not everything:
                continue
            with session.record_lock:
                if session.closed:
                    continue
                self.store.put_session(session.session_id, session.record(), self.config.session_ttl_s)
                session.live_written = True
                written += 1
        return written

    def keep_alive(self, session_ids: Sequence[str]) -> None:
        """The target still serves these sessions, which have no Step now (prefill, a KV-slot wait)."""
        now = time.monotonic()
        with self.lock:
            for session_id in session_ids:
                session = self._sessions.get(session_id)
                if session is not None:
                    session.last_active = now

    def close_idle(self, idle_s: float) -> list[str]:
        """Close sessions with no Step or keepalive for their idle timeout (the target's, at most
        ``idle_s``; 0 = no cap): their target died without closing them. Its capacity on the draft
        is free again at once."""
        now = time.monotonic()
        idle = []
        for s in self.sessions():
            limits = [x for x in (s.idle_timeout_s, idle_s) if x > 0]  # the target's, capped by ours
            limit = min(limits, default=0.0)
            if limit and now - s.last_active > limit:
                idle.append((s.session_id, limit))
        for session_id, limit in idle:
            with contextlib.suppress(NotFound):  # closed concurrently
                self.close(session_id, status="abandoned")
                log.warning("session %s had no step or keepalive for %.1fs; closed as abandoned", session_id,
                            limit, extra={"session_id": session_id})
        return [sid for sid, _ in idle]

