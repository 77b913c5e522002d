"""The target engine: one loop owns the model; each iteration is one forward over every live
generation (continuous batching, nano-vllm's shape). An iteration has seven phases:

    admit    waiting generations take a free KV slot (card.engine.shared.kv_pool.KVPool), in
             arrival order, with prefix caching the one holding their longest cached prompt
             prefix (card.engine.shared.prefix_cache: prefill starts after it); the drafting
             policy tells each one's source what it opens with
             (card.engine.target.drafting_policy), then the source opens
    steer    the policy tells each running source whose drafting it changed after the last
             iteration (``draft_with``: a drafter, or none)
    plan     each running generation gives its next input: a prefill chunk, or [t_next, *chain]
             after its chain source's step; steps first, their chains cut (longest first) so that
             their rows fit the iteration's token budget (``max_batch_tokens``; t_next always
             goes), then prefill chunks, shortest prompt first and as many as pay at the
             measured cost (card.engine.target.prefill_order), while the budget lasts (the first
             input always goes) and, beside decoding rows, while the prefill pacer allows
             (``PrefillPacer``)
    budget   each chain is cut to what pays at this iteration's measured cost
             (card.engine.target.speculation); a generation not drafting verifies none
    forward  one flattened forward over all of them (card.engine.shared.kv_pool.forward), timed
    commit   each generation absorbs its rows' logits and streams what it committed; finished
             ones close and give their slot back
    observe  the policy takes the iteration: each decoding generation's step (its own rules)
             and the engine's committed tokens and seconds (the regime)

Requests join and leave between iterations. A prompt is prefilled in chunks of ``prefill_chunk``
tokens, so a long prompt does not stall everyone else's decoding; the chunk size is fixed (not a
function of the load), so a generation's arithmetic is the same alone and in any batch. One chunk
can still cost many decoding steps (on a CPU, a 256-token chunk at position 7k of SmolLM2-135M
takes ~20 of them), so beside decoding rows chunks are paced, not packed: ``PrefillPacer`` lets a
chunk in only once the time earlier chunks added to decoding iterations has been paid back, so a
decoding stream's mean time between tokens stays within ``max_decode_slowdown`` of its time alone.
Only *when* a chunk runs changes, never its boundaries: outputs are the same bits.

One generation failing (its source raised, its input was bad) ends that generation only.

Decoding rows count against ``max_batch_tokens`` like prefill chunks: a long chain (up to
MAX_CHAIN) is verified in one forward, and several of them must not make one iteration that
stalls every generation's next token. Cutting a chain changes the speed, never an exact output.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from card.engine.shared.kv_pool import PREFILL_CHUNK, KVPool, Segment, forward
from card.engine.shared.static_step import DecodeRows, StaticStep, static_step_for
from card.engine.shared.tree import Outcome
from card.engine.target.chain_source import step_all
from card.engine.target.drafting_policy import DraftingConfig, DraftingPolicy, Stepped
from card.engine.target.generation import Chunk, Generation, GenerationResult
from card.engine.target.prefill_order import PrefillOrder
from card.engine.target.speculation import CostModel, chain_lengths
from card.engine.target.verify import RowPicks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Planned:
    """One generation's part of an iteration: ``tokens`` forwarded from position ``start``;
    ``decoding``: a step (``[t_next, *chain]``, every row judged) or a prefill chunk (only the
    prompt's last row, in its last chunk); ``rows``: how many logits rows it gets back."""

    gen: Generation
    tokens: list[int]
    start: int
    decoding: bool
    rows: int = 0
    offered: int = 0  # chain tokens the source offered (a step), before the cost cut
    committed: int = 0  # tokens it committed (a step that went through)
    outcome: Outcome | None = None  # the tree's verdict on the correction its source applied
    picks: RowPicks | None = None  # its rows' own tokens and accepted count, from a static step


@dataclass(frozen=True)
class IterationTimes:
    """Where one iteration's wall time went, in seconds: ``plan`` (admission, chain sources'
    steps, chain cut), ``forward`` (the model: every layer and the LM head), ``commit`` (sampling,
    acceptance, stop checks, detokenizing, finishing); ``rows`` forwarded, ``generations`` in it.
    Everything but ``forward`` is the engine's host cost (docs/performance.md)."""

    plan: float
    forward: float
    commit: float
    rows: int
    generations: int

    @property
    def total(self) -> float:
        return self.plan + self.forward + self.commit


@dataclass
class Event:
    """What one iteration did for one generation: a chunk it committed (None while prefilling),
    and, when it ended, ``done`` (``error``: the exception that ended it early)."""

    generation: Generation
    chunk: Chunk | None = None
    done: bool = False
    error: BaseException | None = None


# Prompt rows another prompt must share (and compute) before a prompt follows it instead of
# computing them itself (TargetEngine._follows): a block's worth, below which a copy buys nothing
MIN_FOLLOW = 16


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``: a bisection over slices
    (C-speed comparisons, no Python loop over tokens)."""
    lo, hi = 0, min(limit, len(a), len(b))  # a[:lo] == b[:lo]; they differ before hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Decoding iterations a pending prefill chunk waits at most, whatever the pacer's clock says: a
# prompt's progress has a bound counted in iterations, not only in seconds
MAX_PREFILL_WAIT = 1024


class PrefillPacer:
    """When a prefill chunk may join an iteration that has decoding rows: a deficit counter in
    seconds (a token bucket without a burst). An iteration with decoding rows and a chunk costs the
    decoding streams its time minus a decoding iteration's (``decode_s``, a moving average of
    iterations without chunks): that is ``debt``. Each decoding iteration without a chunk pays back
    (``slowdown`` - 1) times its time. A chunk may go while nothing is owed, so over any stretch the
    decoding streams' time between tokens averages at most ``slowdown`` times their time alone (and
    its median, the iterations without chunks, is theirs alone), while prompts get the rest: 1/3 of
    the time at 1.5. Nothing decoding: prompts take every iteration and the debt is forgiven.
    ``slowdown`` <= 1: off (chunks go whenever the token budget holds them). A chunk never waits
    more than MAX_PREFILL_WAIT iterations (``waited``). Only prompts of more than one chunk wait
    (TargetEngine._one_chunk); a one-chunk prompt's cost counts all the same."""

    DECAY = 0.2  # weight of the newest decoding iteration in ``decode_s``

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.debt = 0.0
        self.decode_s: float | None = None
        self.waited = 0  # decoding iterations a pending chunk was held back since the last chunk

    @property
    def on(self) -> bool:
        return self.slowdown > 1

    def admits(self) -> bool:
        """Whether a chunk may join this iteration's decoding rows."""
        return not self.on or self.debt <= 0 or self.waited >= MAX_PREFILL_WAIT

    def observe(self, seconds: float, decoding: bool, prefilled: bool, held: bool) -> None:
        """One iteration of ``seconds``: it had decoding rows, prefill chunks, or held a chunk back."""
        if not decoding:
            self.debt, self.waited = 0.0, 0
            return
        if prefilled:
            self.debt = max(self.debt, 0.0) + seconds - (self.decode_s or 0.0)
        else:
            self.decode_s = seconds if self.decode_s is None else (
                self.DECAY * seconds + (1 - self.DECAY) * self.decode_s)
            if self.on:
                self.debt = max(self.debt - (self.slowdown - 1) * seconds, 0.0)
        self.waited = self.waited + 1 if held else 0


class TargetEngine:
    def __init__(self, model: torch.nn.Module, pool: KVPool, max_batch_tokens: int = 2048,
                 prefill_chunk: int = PREFILL_CHUNK, adaptive: bool = True, exact: bool = True,
                 policy: DraftingPolicy | None = None, decode_step: str = "eager",
                 max_decode_slowdown: float = 0.0, prefill_order: str = "shortest") -> None:
        self.model = model
        self.pool = pool
        # decoding rows at static shapes (card.engine.shared.static_step), or None: every input
        # through the eager forward. Prefill chunks always take the eager forward
        self.static: StaticStep | None = static_step_for(model, pool, decode_step, check=exact)
        self.adaptive = adaptive  # cut chains by measured cost (card.engine.target.speculation)
        # whether each generation drafts, and with what; without the measured-cost cut every
        # chain is verified whole and nothing is paused (forwards depend on the draft alone)
        self.policy = policy or DraftingPolicy(DraftingConfig(speculation="auto" if adaptive else "always"))
        # decoding rows through card.engine.shared.exact_attention: a row's logits are the same
        # alone, in a chain or in any batch (False: the vendor SDPA, faster, outputs marked inexact)
        self.exact = exact
        self.cost = CostModel()
        self.max_batch_tokens = max(max_batch_tokens, 1)
        self.prefill_chunk = prefill_chunk
        # beside decoding rows, prefill chunks wait until the time earlier ones cost is paid back
        self.pacer = PrefillPacer(max_decode_slowdown)
        self._held = False  # this iteration held a prefill chunk back (the pacer)
        # which prompts an iteration prefills: shortest first, grouped where that pays at the
        # measured cost (card.engine.target.prefill_order), or in arrival order
        self.prefill_order = PrefillOrder(prefill_order)
        # a prompt's rows through exact_attention.attend_blocks where that gives a decoding row's
        # bits on this device (KVPool.prefill_invariant): a row's keys and values are then the same
        # whatever chunk computed them, prefill or decoding, so a prompt may start from any cached
        # row, the rows a session decoded included (a chat's next turn); else SDPA, whose bits
        # depend on the chunking: prompts reuse whole prefill chunks only, at their boundaries
        self.prefill_exact = exact and pool.prefill_invariant
        # prefix caching where the pool keeps an index (KVPool(prefix_caching=True)): a prompt
        # starts from its longest cached prefix (card.engine.shared.prefix_cache)
        self.prefix_caching = pool.prefix is not None and (
            self.prefill_exact or prefill_chunk % pool.prefix.block == 0)
        # rows a prompt may reuse come in whole multiples of this many (KVPool.acquire_prefix)
        self._reuse_unit = 1 if self.prefill_exact else prefill_chunk
        # a session's decoded rows are a prefill's bits too where its decoding rows take the eager
        # exact attention (the static step's block tree is another arithmetic): indexed as it ends
        self._index_decoded = self.prefix_caching and self.prefill_exact and self.static is None
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self.forwards = 0
        self.last: IterationTimes | None = None  # the latest iteration that ran a forward

    @classmethod
    def alone(cls, model: torch.nn.Module, kv_len: int, adaptive: bool = True, exact: bool = True,
              policy: DraftingPolicy | None = None, decode_step: str = "eager") -> TargetEngine:
        """An engine of one slot of ``kv_len`` rows: one generation run by itself (``policy``:
        one that outlives it, so what it measured serves the next generation)."""
        return cls(model, KVPool(model, slots=1, max_len=max(kv_len, 2)), adaptive=adaptive, exact=exact,
                   policy=policy, decode_step=decode_step)

    # ---- queue -------------------------------------------------------------------------------
    def add(self, gen: Generation) -> None:
        self.waiting.append(gen)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def prefill_pending(self) -> bool:
        """Whether the next iteration computes a prompt chunk: a running generation still
        prefilling, or a waiting one that a free slot admits (its forward's shape, for the thread
        governor: card.engine.shared.thread_governor.ShapeGovernors)."""
        return (bool(self.waiting) and self.pool.free_slots > 0) or any(g.prefilling for g in self.running)

    def cancel(self, gen: Generation) -> Event:
        """End ``gen`` now (its client went away): it leaves the queue or the batch, closes its
        source and gives its slot back. Between iterations only (the engine's thread)."""
        if gen in self.waiting:
            self.waiting.remove(gen)
        self.policy.release(gen)
        return self._finish(gen)

    # ---- one iteration: admit, steer, plan, budget, forward, commit, observe -----------------
    def step(self) -> list[Event]:
        t0 = time.perf_counter()
        events = self._admit()
        try:
            self.policy.steer(self.running)
            plan = self._plan(events)
            if plan:
                self._budget(plan)
                logits, model_s = self._forward(plan)
                t1 = time.perf_counter()
                self._commit(plan, logits, events)
                t2 = time.perf_counter()
                self.last = IterationTimes(t1 - t0 - model_s, model_s, t2 - t1,
                                           sum(len(p.tokens) for p in plan), len(plan))
                clean = all(p.decoding for p in plan) and not any(e.error is not None for e in events)
                steps = [Stepped(p.gen, p.offered, len(p.tokens) - 1, p.committed, p.outcome)
                         for p in plan if p.decoding]
                self.policy.observe(steps, t2 - t0, clean)
                self.pacer.observe(t2 - t0, bool(steps), any(not p.decoding for p in plan), self._held)
        finally:  # the policy forgets the generations that ended (after their last step counted)
            for event in events:
                if event.done:
                    self.policy.release(event.generation)
        return events

    def _plan(self, events: list[Event]) -> list[Planned]:
        """Every running generation's input: decoding steps first (a token or a short chain each,
        all sources stepped together), then prefill chunks while the iteration has token budget
        (the first input always goes)."""
        plan: list[Planned] = []
        budget = self.max_batch_tokens
        decoding = [g for g in self.running if not g.prefilling]
        t_step = time.perf_counter()
        steps = step_all([g.source for g in decoding], [g.correction() for g in decoding])
        waited = time.perf_counter() - t_step
        for gen, step in zip(decoding, steps, strict=True):
            try:
                if isinstance(step, Exception):
                    raise step
                tokens, start = gen.take_step(step, waited)
            except Exception as exc:  # its source failed: this generation ends, the batch goes on
                events.append(self._fail(gen, exc))
                continue
            planned = Planned(gen, list(tokens), start, decoding=True, offered=len(tokens) - 1,
                              outcome=step.outcome)
            if planned.offered and self.policy.stopped(gen):  # a chain in flight when its draft stopped
                planned.tokens = gen.trim_chain(0)
            plan.append(planned)
        fit_rows(plan, budget)  # decoding rows are tokens of this forward too
        decoding_rows = sum(len(p.tokens) for p in plan)
        budget -= decoding_rows
        paced = bool(plan) and not self.pacer.admits()  # beside decoding rows, chunks may wait
        self._held = False
        streams, cost, finishing = len(plan), self.cost.fit(), 0
        offered = self.prefill_order.ordered([g for g in self.running if g.prefilling])
        taken: list[Generation] = []
        for i, gen in enumerate(offered):
            if self.prefix_caching and self.prefill_exact and self._follows(gen):
                continue  # another prompt is computing its next rows: copied once they are
            if paced and not self._one_chunk(gen):
                self._held = True
                continue
            rows = min(self.prefill_chunk, gen.prefill_left)
            if plan and budget < rows:
                continue
            if taken and not self.prefill_order.joins(gen, rows, finishing, streams, decoding_rows,
                                                      len(offered) - i, cost):
                break  # it and the longer ones after it: the next iteration
            finishing += rows == gen.prefill_left
            tokens, start = gen.next_input(self.prefill_chunk)
            plan.append(Planned(gen, list(tokens), start, decoding=False))
            taken.append(gen)
            budget -= len(tokens)
        self.prefill_order.planned(offered, taken)
        return plan

    def _follows(self, gen: Generation) -> bool:
        """Prompts admitted together over one new document (a RAG burst, an agent's parallel
        calls): the cache holds none of it yet, and each would prefill it. Instead ``gen`` takes
        the rows an earlier-admitted prompt sharing its next tokens has computed (copied by index:
        an exact prefill's rows are the same bits whichever prompt computed them), and waits while
        that prompt computes more of them; True: it waits this iteration. The earliest never waits,
        so every wait ends."""
        assert gen.slot is not None
        prompt = gen.request.prompt_ids
        start, last = gen.settled_rows, len(prompt) - 1  # its last token is always its own
        for lead in self.running:
            if lead is gen:
                return False  # only earlier ones lead
            theirs = lead.request.prompt_ids
            # the next MIN_FOLLOW tokens first: most leads share nothing there, and are passed
            # over in one short comparison instead of a bisection over the whole prompt
            if lead.slot is None or prompt[start:start + MIN_FOLLOW] != theirs[start:start + MIN_FOLLOW]:
                continue
            shared = _common(prompt, theirs, last)
            if shared <= start:
                continue
            ready = min(shared, lead.settled_rows)  # rows the lead has computed of the shared part
            if ready - start >= MIN_FOLLOW:
                self.pool.copy_span(lead.slot, gen.slot, start, ready)
                self.pool.computed(gen.slot, start, prompt[start:ready])
                gen.adopt(ready - start)
                start = ready
            if lead.prefilling and shared - start >= MIN_FOLLOW:
                return True
        return False

    def _one_chunk(self, gen: Generation) -> bool:
        """Whether ``gen``'s whole prefill (after its cached prefix) is one chunk: such a prompt
        (a chat turn, a cached document's question) is not paced, its first token is one forward
        away, and each costs the decoding streams one iteration once (its cost still counts)."""
        return len(gen.request.prompt_ids) - gen.stats.cached_tokens <= self.prefill_chunk

    def _budget(self, plan: list[Planned]) -> None:
        """Cut each step's chain to what pays at this iteration's measured cost (``adaptive``);
        a generation not drafting verifies none."""
        steps = [p for p in plan if p.decoding]
        if self.static is not None and fit_rows(steps, self.static.max_rows):
            # one row each always fits: the largest bucket holds every session (StaticStep)
            raise RuntimeError(f"{len(steps)} decoding rows exceed the static step's {self.static.max_rows}")
        if not self.adaptive:
            return
        fixed = sum(len(p.tokens) for p in plan if not p.decoding) + len(steps)
        lengths = chain_lengths([len(p.tokens) - 1 for p in steps],
                                [self.policy.alpha(p.gen) for p in steps], fixed, self.cost.fit())
        for p, length in zip(steps, lengths, strict=True):
            if length < len(p.tokens) - 1:
                p.tokens = p.gen.trim_chain(length)

    def _forward(self, plan: list[Planned]) -> tuple[torch.Tensor, float]:
        """One forward over every input: the logits of the rows that need them, in plan order
        (``Planned.rows`` of each), and the model's seconds. Decoding rows go through the static
        step where the engine has one (each also gets its rows' own tokens, argmax or seeded draw,
        and its accepted count, ``Planned.picks``, read from the device once for the whole step),
        everything else through the eager forward."""
        for p in plan:
            assert p.gen.slot is not None
            if p.decoding:  # every row of [t_next, *chain] is judged
                p.rows = len(p.tokens)
                # the static step's rows too (eager: _Batch)
                self.pool.written(p.gen.slot, p.start, p.start + p.rows)
            elif p.start + len(p.tokens) == len(p.gen.request.prompt_ids):  # the prompt's last chunk
                p.rows = 1
        t0 = time.perf_counter()
        if self.static is None:
            logits = self._eager(plan)
        else:
            parts = self._static(plan)
            eager = [p for p in plan if not p.decoding]
            if eager:
                logits, first = self._eager(eager), 0
                for p in eager:
                    parts[id(p)], first = logits[first:first + p.rows], first + p.rows
            kept = [parts[id(p)] for p in plan if p.rows]
            logits = torch.cat(kept) if kept else torch.empty(0, 0)
        seconds = time.perf_counter() - t0
        self.cost.observe(sum(len(p.tokens) for p in plan), seconds)
        self.forwards += 1
        return logits, seconds

    def _eager(self, plan: list[Planned]) -> torch.Tensor:
        """The flattened eager forward over ``plan``'s inputs: [sum of rows, V]."""
        segments, rows, offset = [], [], 0
        for p in plan:
            assert p.gen.slot is not None
            exact = self.exact if p.decoding else self.prefill_exact
            segments.append(Segment(p.gen.slot, p.start, len(p.tokens), exact=exact, prefill=not p.decoding))
            rows.append(torch.arange(offset + len(p.tokens) - p.rows, offset + len(p.tokens)))
            offset += len(p.tokens)
        flat = torch.tensor([t for p in plan for t in p.tokens], dtype=torch.int64)  # [sum n_i]
        return forward(self.model, self.pool, segments, flat, torch.cat(rows))  # [sum rows_i, V]

    def _static(self, plan: list[Planned]) -> dict[int, torch.Tensor]:
        """The decoding rows of ``plan`` through the static step: each one's logits, by id."""
        assert self.static is not None
        steps = [p for p in plan if p.decoding]
        parts: dict[int, torch.Tensor] = {}
        if not steps:
            return parts
        sampling = [p.gen.device_sampling() for p in steps]
        out = self.static.run([DecodeRows(p.gen.slot or 0, p.start, p.tokens, s)
                               for p, s in zip(steps, sampling, strict=True)])
        (picks, accepted), first = out.read(), 0  # the step's one read: own tokens, accepted counts
        for p, s in zip(steps, sampling, strict=True):
            parts[id(p)] = out.logits[first:first + p.rows]
            p.picks = RowPicks(picks[first:first + p.rows], drawn=s is not None, accepted=accepted[first])
            first += p.rows
        return parts

    def _commit(self, plan: list[Planned], logits: torch.Tensor, events: list[Event]) -> None:
        """Each generation absorbs its rows' logits and streams what it committed; finished ones
        close and give their slot back."""
        first = 0
        for p in plan:
            mine = logits[first:first + p.rows]
            first += p.rows
            if self.prefix_caching and not p.decoding and p.gen.slot is not None:
                self.pool.computed(p.gen.slot, p.start, p.tokens)  # a prompt chunk's rows are final
            try:
                chunk = p.gen.absorb(mine, p.picks)
            except Exception as exc:
                events.append(self._fail(p.gen, exc))
                continue
            if p.decoding:
                p.committed = p.gen.stats.accepted_lengths[-1]
            if p.gen.done:
                event = self._finish(p.gen)
                event.chunk = chunk
                events.append(event)
            elif chunk is not None:
                events.append(Event(p.gen, chunk))

    def _admit(self) -> list[Event]:
        events = []
        while self.waiting and self.pool.free_slots:
            gen = self.waiting.popleft()
            if gen.kv_len > self.pool.max_len:  # the servicer sizes context windows; a guard
                events.append(self._fail(gen, ValueError(
                    f"generation needs {gen.kv_len} KV rows, the cache holds {self.pool.max_len}")))
                continue
            got = (self.pool.acquire_prefix(gen.request.prompt_ids, self._reuse_unit) if self.prefix_caching
                   else None)
            gen.slot, cached = got if got is not None else (self.pool.acquire(), 0)
            gen.reuse(cached)
            gen.stats.exact = self.exact
            self.running.append(gen)
            try:
                self.policy.admit(gen)
                gen.open()
            except Exception as exc:
                events.append(self._fail(gen, exc))
        return events

    def _fail(self, gen: Generation, exc: BaseException) -> Event:
        log.warning("generation ended by an error: %s", exc)
        event = self._finish(gen)
        event.error = exc
        return event

    def _finish(self, gen: Generation) -> Event:
        if gen in self.running:
            self.running.remove(gen)
        if gen.slot is not None:
            if self._index_decoded:
                self.pool.settled(gen.slot, gen.target.committed[:gen.settled_rows])
            self.pool.release(gen.slot)
            gen.slot = None
        try:
            gen.close()
        except Exception:  # closing the source is best effort; the output stands
            log.exception("closing a generation's chain source failed")
        return Event(gen, done=True)

    # ---- one generation, here and now --------------------------------------------------------
    def stream(self, gen: Generation) -> Iterator[Chunk]:
        """Run ``gen`` to its end, yielding its chunks; an error it met is raised; a consumer that
        stops early cancels it."""
        self.add(gen)
        try:
            while True:
                for event in self.step():
                    if event.generation is not gen:
                        continue
                    if event.chunk is not None:
                        yield event.chunk
                    if event.error is not None:
                        raise event.error
                    if event.done:
                        return
        finally:
            if gen.result is None:
                self.cancel(gen)


def level_rows(rows: Sequence[int], limit: int) -> list[int]:
    """``rows`` cut from the longest down (water-filling) until they sum to at most ``limit``,
    none below one: the highest level c with sum(min(r, c)) <= limit, then one more row for the
    first of those above it while rows are left. Where one row each is already past ``limit``,
    one row each."""
    if sum(rows) <= limit:
        return list(rows)
    lo, hi = 1, max(rows)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(r, mid) for r in rows) <= limit:
            lo = mid
        else:
            hi = mid - 1
    out = [min(r, lo) for r in rows]
    spare = limit - sum(out)
    for i, r in enumerate(rows):
        if spare <= 0:
            break
        if r > lo:
            out[i] += 1
            spare -= 1
    return out


def fit_rows(steps: Sequence[Planned], max_rows: int) -> int:
    """Cut the decoding steps' chains, longest first, until their rows fit ``max_rows`` (a shorter
    chain changes the speed, never the tokens); every step keeps its t_next row. Returns the rows
    still over ``max_rows`` (0: they fit)."""
    rows = [len(p.tokens) for p in steps]
    fitted = level_rows(rows, max_rows)
    for p, n, was in zip(steps, fitted, rows, strict=True):
        if n < was:
            p.tokens = p.gen.trim_chain(n - 1)
    return max(0, sum(fitted) - max_rows)


def run_alone(model: torch.nn.Module, gen: Generation, adaptive: bool = True,
              exact: bool = True, policy: DraftingPolicy | None = None,
              decode_step: str = "eager") -> Iterator[Chunk]:
    """Run ``gen`` by itself on ``model`` (an engine of one slot), yielding its chunks.
    ``adaptive=False`` verifies every chain whole (the measured-cost cut is off, and the
    drafting policy pauses nothing): the forward count then depends on the draft alone, not on
    how busy the machine is. ``policy``: one that outlives this generation."""
    yield from TargetEngine.alone(model, gen.kv_len, adaptive, exact, policy, decode_step).stream(gen)


def finish_alone(model: torch.nn.Module, gen: Generation, exact: bool = True,
                 policy: DraftingPolicy | None = None, decode_step: str = "eager") -> GenerationResult:
    """Run ``gen`` by itself to its end; its result."""
    for _ in run_alone(model, gen, exact=exact, policy=policy, decode_step=decode_step):
        pass
    assert gen.result is not None
    return gen.result
