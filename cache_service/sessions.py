"""The cache's sessions: the open ones, their records, their idleness.

Query-and-correct itself is engine.shared.session.CardSession (tree, committed text, chain
settings: the cache's with the target's ChainPolicy over them); each Session here holds one, and
its ``Seat`` in the cache's Assignments (card.cache_service.assignment), which decides the worker
that serves it and links its CardSession to that worker. Everything here is engine values; wire
messages exist only in the servicer and convert.py.

Records (card.cache_service.records): no session RPC waits for Redis. OpenSession writes
nothing; a session that lives through a monitor round gets its live record written once, by the
monitor (``flush_records``); CloseSession hands the finished record (a bounded summary) and its
totals to the cache's RecordWriter thread and returns.

Locks, never two of these at once (under each only leaf locks that never wait: a command queue's,
the in-process store's, metrics', logging's): the table lock, over the dict of sessions only (a
close takes the session out under it, then takes the session's lock); a session's lock (its
CardSession's); the Assignments' lock (card.cache_service.assignment); a session's
``record_lock``, around the monitor's live-record write and the RecordWriter's finished one (so a
live write in flight lands first), the only one Redis is called under.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from card.cache_service import metrics
from card.cache_service.affinity import TurnAffinity
from card.cache_service.assignment import Assignments, Seat, WorkerLink
from card.cache_service.config import CacheConfig
from card.cache_service.pools import PoolStats
from card.cache_service.records import FinishedRecord, RecordWriter, stats_fields
from card.cache_service.store import MetadataStore
from card.engine.shared.config import ChainDraw, ChainPolicy
from card.engine.shared.errors import InvalidArgument, NotFound, Unavailable
from card.engine.shared.ngram_stats import PromptLookup
from card.engine.shared.session import CardSession, StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import WORKER_TREE_ENTRIES, Chain, Correction, Layer, Outcome, TreeBudget

HITS = (Outcome.HIT, Outcome.SECONDARY_HIT)
# A session's committed text at most, where its target did not say its context window: above any
# model's context, so only a target that lies about its text meets it (each Step's accepted tokens
# grow the text, and the model-free lookup reads it).
MAX_SESSION_TOKENS = 1 << 20
# Model-free lookups of recently closed sessions kept for a conversation's next turn (EarlierTurns):
# at most this many, holding at most this many tokens of text together
EARLIER_TURNS = 64
EARLIER_TURN_TOKENS = 1 << 20

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    session_id: str
    target_model: str
    requested_draft: str  # the draft the target asked for (a pool or a worker); "" = any matching worker
    seat: Seat  # its place in the Assignments: the worker serving it, its CardSession
    prompt_tokens: int
    vocab_size: int = 0  # the target's (OpenSession); layers' tokens must lie below it
    context_window: int = 0  # the target's (OpenSession); the committed text stays within it
    opened_unix: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)  # open, last Step or keepalive
    idle_timeout_s: float = 0.0  # the target's (OpenSession); 0 = the cache's
    # the chain handed out last: its length and the pool whose worker grew it ("" = none); the next
    # Step's correction is that pool's acceptance (PoolStats)
    chain_len: int = 0
    chain_pool: str = ""
    last_step: float = field(default_factory=time.monotonic)
    # live record: the monitor saw the session in one round (it lived through one), wrote its record
    seen_by_monitor: bool = False
    live_written: bool = False
    # serialises Redis writes of this session's record so a late flush cannot revive a closed one
    record_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def card(self) -> CardSession:  # tree, committed text, chain settings
        return self.seat.card

    @property
    def lock(self) -> threading.Condition:
        return self.card.lock

    @property
    def serving_draft(self) -> str:
        """Name of the worker serving the session now; "" when none does."""
        worker = self.seat.worker
        return worker.name if worker else ""

    def record(self) -> dict[str, str | int | float]:
        """The live-session record as Redis holds it."""
        card, params = self.card, self.card.params
        return {
            "status": "live", "target_model": self.target_model, "fingerprint": self.seat.fingerprint,
            "draft_requested": self.requested_draft, "draft": self.serving_draft,
            "prompt_tokens": self.prompt_tokens, "committed_tokens": len(card.committed),
            "epoch": card.epoch, "tree_nodes": len(card.tree), "max_chain": params.max_chain,
            "min_path_prob": params.min_path_prob, "b_extension": int(params.b_extension),
            "opened_unix": self.opened_unix, "updated_unix": time.time(),
        }


class EarlierTurns:
    """The model-free lookups (PromptLookup) of recently closed sessions, LRU, bounded in entries
    and in tokens. A new session whose prompt extends one's text (a conversation's next turn: the
    earlier prompt, its answer, the new message) takes it and reads only the new tokens instead of
    the whole conversation again. What it then holds is exactly what reading its whole prompt gives
    (PromptLookup.open), so no session's text reaches another's chains beyond its own prompt."""

    def __init__(self, entries: int = EARLIER_TURNS, tokens: int = EARLIER_TURN_TOKENS) -> None:
        self.entries = entries
        self.max_tokens = tokens
        self._lock = threading.Lock()  # a leaf: nothing waits under it
        self._held: OrderedDict[int, tuple[object, PromptLookup]] = OrderedDict()  # by id(lookup)
        self._tokens = 0
        self.reused = 0  # tokens a new session did not read again

    def __len__(self) -> int:
        return len(self._held)

    def put(self, key: object, lookup: PromptLookup) -> None:
        """Keep a closed session's lookup (``key``: its tokenizer) for a next turn."""
        n = len(lookup.text)
        if not 0 < n <= self.max_tokens:
            return
        with self._lock:
            self._held[id(lookup)] = (key, lookup)
            self._tokens += n
            while len(self._held) > self.entries or self._tokens > self.max_tokens:
                _, (_, old) = self._held.popitem(last=False)
                self._tokens -= len(old.text)

    def take(self, key: object, prompt: Sequence[int]) -> PromptLookup | None:
        """The kept lookup with the longest text that ``prompt`` starts with, handed over (no
        longer kept); None if none."""
        with self._lock:
            best: tuple[int, PromptLookup] | None = None
            for ident, (k, lookup) in self._held.items():
                text = lookup.text
                n = len(text)
                if (k != key or n > len(prompt) or (best is not None and n <= len(best[1].text))
                        or text[-1] != prompt[n - 1] or list(prompt[:n]) != text):
                    continue
                best = (ident, lookup)
            if best is None:
                return None
            del self._held[best[0]]
            self._tokens -= len(best[1].text)
            self.reused += len(best[1].text)
            return best[1]


class SessionTable:
    """``records``: the writer of finished records (the cache's; started and stopped by it). Without
    one the table makes and starts its own. ``assignments`` decides which worker serves each."""

    def __init__(self, config: CacheConfig, store: MetadataStore, assignments: Assignments,
                 records: RecordWriter | None = None, pool_stats: PoolStats | None = None) -> None:
        self.config = config
        self.store = store
        self.assignments = assignments
        self.pool_stats = pool_stats or PoolStats()
        if records is None:
            records = RecordWriter(store)
            records.start()
        self.records = records
        self.lock = threading.Lock()  # the dict of sessions, nothing else
        self.device = torch.device(config.device)
        self._sessions: dict[str, Session] = {}
        # what the trees of each worker's sessions hold together (WORKER_TREE_ENTRIES): a budget
        # lives while a session's tree refers to it, so the map forgets workers that serve none
        self._budgets: weakref.WeakValueDictionary[str, TreeBudget] = weakref.WeakValueDictionary()
        self._budgets_lock = threading.Lock()  # a leaf: nothing waits under it
        self.closing = False  # set by close_all at shutdown: no new sessions
        # closed sessions' model-free lookups, for the next turn of their conversations
        self.earlier = EarlierTurns()
        # which worker drafted each closed session's text: a next turn goes back to it
        self.affinity = TurnAffinity()

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

    # ---- target side --------------------------------------------------------------------------
    def open(self, prompt_ids: Sequence[int], fingerprint: str, target_model: str,
             draft: str = "", chain: ChainPolicy | None = None, vocab_size: int = 0,
             context_window: int = 0, idle_timeout_s: float = 0.0, draw: ChainDraw | None = None,
             default_pool: str = "", paused: bool = False) -> Session:
        """``draft``: a pool or a worker's name (card.common.drafts.route_draft; "" = any pool,
        ``default_pool`` first); ``chain`` goes over the configured chain settings for this session
        (None: keep them); ``draw``: its chains are drawn (verify rejection; None: the best path);
        ``vocab_size`` / ``context_window``: the target's (0 = not told); ``idle_timeout_s``: how
        long the session lives without a Step or keepalive (0 = the cache's; it is also the cap);
        ``paused``: no worker drafts for it until a Step resumes it. InvalidArgument: an empty
        prompt, one at or past the context window, a token outside the vocabulary, no fingerprint,
        or a chain policy out of range. NotFound / FailedPrecondition: ``draft`` names no pool or
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
        measured = [p for p in self.pool_stats.names() if p != metrics.OTHER]  # no pool is named so
        route = self.assignments.route(draft, fingerprint, target_model or "the target", measured)
        # model-free chains from the session's own text where its tree holds nothing (a miss while
        # the draft restarts, no worker free): the target verifies something every step
        lookup = None
        if self.config.model_free_chains and vocab_size:  # an earlier turn's, read on from its end
            lookup = (self.earlier.take((fingerprint, vocab_size), prompt_ids) if draw is None else None
                      ) or PromptLookup(vocab_size)
        card = CardSession(params, self.device, draw=draw, lookup=lookup)
        card.open(prompt_ids)
        seat = Seat(uuid.uuid4().hex, fingerprint, card, route, default_pool, paused=paused,
                    prefers=self.affinity.prefer(fingerprint, prompt_ids))
        self.assignments.join(seat)  # ResourceExhausted: the worker it names is full
        session = Session(seat.session_id, target_model or "unknown", draft, seat, len(prompt_ids),
                          vocab_size=vocab_size, context_window=context_window,
                          idle_timeout_s=idle_timeout_s)
        with self.lock:
            self._sessions[session.session_id] = session
        # no Redis write here: the monitor writes the live record of a session that outlives a round
        metrics.SESSIONS_OPEN.inc()
        log.info("session %s opened (%d prompt tokens, draft %s)", session.session_id, len(prompt_ids),
                 session.serving_draft or "none", extra={"session_id": session.session_id})
        return session

    def step(self, session_id: str, correction: Correction,
             worker_off: bool = False) -> tuple[Chain, Outcome]:
        """Apply the target's correction and return the next chain; never waits for a draft.
        ``worker_off``: the target's drafting policy has no worker draft for the session now
        (``StepRequest.drafter`` none or lookup: its worker stops and its tree empties; the chain
        is the session's model-free lookup, empty without one); a Step naming the worker resumes
        it (a worker starts from the whole text)."""
        t0 = time.perf_counter()
        session = self.get(session_id)
        with session.lock:
            if session.card.closed:
                raise NotFound(f"session {session_id!r} is closed")
            self._check_grows(session, correction)
            result = session.card.step(correction)  # Aborted on a stale epoch
        if worker_off != session.seat.paused:
            self.assignments.pause(session.seat, worker_off)
            if worker_off:  # the tree is gone: what the session's own text suggests, if anything
                with session.lock:
                    chain, looked_up = session.card.offer()
                result = StepResult(chain, result.outcome, looked_up)
        with session.lock:
            now = time.monotonic()
            pool, chain_len, busy_s = session.chain_pool, session.chain_len, now - session.last_step
            session.last_active = session.last_step = now
            session.chain_len = len(result.chain.tokens)
            link = session.card.link
            # a looked-up chain is no pool's: its acceptance says nothing of the draft
            drafted = session.chain_len and not result.looked_up
            session.chain_pool = link.worker.pool if isinstance(link, WorkerLink) and drafted else ""
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

    @staticmethod
    def _check_grows(session: Session, correction: Correction) -> None:
        """InvalidArgument, before any work on it, for a correction that would grow the session's
        text past the context window its target declared, or by a token outside its vocabulary."""
        grown = len(correction.accepted_tokens) + 1
        window = session.context_window or MAX_SESSION_TOKENS
        room = window - len(session.card.committed)
        if grown > room:
            raise InvalidArgument(f"the step commits {grown} tokens but the session's text has room for "
                                  f"{max(room, 0)} more (context window {window})")
        vocab = session.vocab_size
        tokens = (*correction.accepted_tokens, correction.next_token)
        if min(tokens) < 0 or (vocab and max(tokens) >= vocab):
            raise InvalidArgument(f"the step commits a token outside the vocabulary [0, {vocab or '...'})")

    def close(self, session_id: str, stats: GenerationStats | None = None,
              status: str = "finished") -> tuple[int, float]:
        """End the session everywhere; returns the draft's (forwards, idle seconds). Its finished
        record (a bounded summary, whatever ``stats`` holds) goes to the RecordWriter: this never
        waits for Redis, and a record the writer cannot take is dropped and counted."""
        session = self._remove(session_id)
        forwards, idle = session.seat.totals()
        card = session.card
        cache_counts = {o.value: n for o, n in card.outcomes.items()}
        record: dict[str, str | int | float] = {
            **session.record(),  # the live fields: the live record may never have been written
            "status": status, "closed_unix": time.time(), "epoch": card.epoch,
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
        """Take the session out of the table (under the table lock alone), then close its card
        under its own lock (a Step in flight finishes first), then free its worker's place."""
        with self.lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFound(f"session {session_id!r} is not open on this cache service")
        session.card.close()  # StopDraft to the worker; the tree's tensors are freed now
        with session.card.lock:  # a Step still in flight no longer reads on
            lookup, session.card.lookup = session.card.lookup, None
        if isinstance(lookup, PromptLookup):  # for the conversation's next turn
            self.earlier.put((session.seat.fingerprint, session.vocab_size), lookup)
        worker = session.seat.worker
        if worker is not None:  # its pool holds this text's rows: the next turn goes there
            self.affinity.put(session.seat.fingerprint, session.card.committed, worker.worker_id,
                              session.prompt_tokens)
        self.assignments.leave(session.seat)  # the freed place may serve a waiting session
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
        budget = self._budget(worker_id)
        with session.lock:
            tree = session.card.tree
            before = Counter(tree.dropped)
            if not session.seat.linked(worker_id) or not session.card.apply_layer(layer, budget):
                return False  # another worker serves it (or none), it is closed, or an old tree's
            session.seat.forwards, session.seat.idle_s = draft_forwards, draft_idle_s
            dropped = tree.dropped - before
        for (kind, why), n in dropped.items():  # past the session's or the worker's bound
            metrics.TREE_DROPPED.labels(kind, why).inc(n)
        return True

    def _budget(self, worker_id: str) -> TreeBudget:
        """The tree budget of the sessions of worker ``worker_id``."""
        with self._budgets_lock:
            budget = self._budgets.get(worker_id)
            if budget is None:
                budget = self._budgets[worker_id] = TreeBudget(WORKER_TREE_ENTRIES)
            return budget

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
                if session.card.closed:
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

