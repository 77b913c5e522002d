"""Where the target's chains come from: one implementation of engine.chain_source.ChainSource
per decoding mode.

    vanilla  NoDraft:        every chain is empty, the target decodes alone
    sd       SyncDraft:      classic draft-then-verify; after each correction the drafter grows a
                             chain of ``gamma`` tokens while the target waits
    card     LocalCard:      a DraftWorker thread grows the tree continuously into a local
                             TwoTierTree; the target queries and corrects it without waiting
    card     NgramCard:      the model-free drafter in the target's own thread (in-process
                             ``--draft-model ngram``): it grows a chain's worth of layers in
                             microseconds after each correction, so no chain is ever empty for
                             want of a thread switch

The gRPC trio plugs in the same way (target_service's RemoteCard), so the generation loop in
``engine.generate`` is the only target loop in the project.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from engine.chain_source import SourceStats, StepResult
from engine.config import TreeParams
from engine.core_lending import CoreLender
from engine.drafter import Drafter
from engine.governor import Governor, Pace
from engine.ngram import NgramConfig, NgramDrafter, NgramTable
from engine.stats import GenerationStats
from engine.tree import Advance, Chain, Correction, Layer, TwoTierTree
from engine.worker import DraftWorker


class NoDraft:
    """Plain decoding: the target alone."""

    def open(self, committed: Sequence[int]) -> None:
        pass

    def step(self, correction: Correction) -> StepResult:
        return StepResult(Chain(epoch=correction.epoch))

    def close(self, stats: GenerationStats) -> SourceStats:
        return SourceStats()


class SyncDraft:
    """Classic speculative decoding: draft ``gamma`` tokens, then verify, in turn."""

    def __init__(self, model: torch.nn.Module, gamma: int = 4, kv_len: int | None = None) -> None:
        self.gamma = gamma
        self.drafter = Drafter(model, TreeParams(width=1, branch=1, max_depth=gamma, max_chain=gamma),
                               max_len=kv_len)

    def open(self, committed: Sequence[int]) -> None:
        self.drafter.start(committed)
        self.drafter.forwards = 0

    def step(self, correction: Correction) -> StepResult:
        outcome, hit = self.drafter.tree.classify(correction)
        self.drafter.advance(Advance(correction.epoch + 1, correction.accepted_tokens,
                                     correction.accepted_node_ids, correction.next_token, outcome, hit))
        while self.drafter.step() is not None:
            pass
        return StepResult(self.drafter.tree.best_chain(self.gamma, b_extension=False), outcome)

    def close(self, stats: GenerationStats) -> SourceStats:
        done = SourceStats(draft_forwards=self.drafter.forwards)
        self.drafter.release()
        return done


class LocalCard:
    """CARD in one process: a draft worker thread and a local candidate tree.

    Back-off (engine.governor): when the draft keeps missing, or the target commits tokens more
    slowly with it than alone, the draft session is stopped and the target decodes alone for a
    while, with the worker's cores lent to it; then drafting restarts from the committed text and
    is judged again. ``calibration_steps`` plain steps open each generation to measure the alone
    pace (0: draft from the first step, pace rule off until a pause); ``backoff=False`` drafts
    throughout. Output never depends on it.
    """

    def __init__(self, worker: DraftWorker | None, params: TreeParams, device: str = "cpu",
                 lender: CoreLender | None = None, calibration_steps: int = 0,
                 backoff: bool = True) -> None:
        self.worker = worker
        self.lender = lender
        self.params = params
        self.tree = TwoTierTree(torch.device(device))
        self.lock = threading.Condition()
        self.session_id = ""
        self.governor = Governor(calibration_steps, enabled=backoff)
        self._committed: Sequence[int] = ()  # the generation's, read when drafting (re)starts
        self._delivered = False  # the current draft session has published a layer
        self._done = SourceStats()  # stats of the draft sessions already stopped

    @property
    def backoffs(self) -> int:
        return self.governor.backoffs

    def publish(self, session_id: str, layer: Layer) -> None:
        """The worker's publish callback."""
        with self.lock:
            if session_id == self.session_id:
                self._delivered = True
                self.tree.apply_layer(layer)
                self.lock.notify_all()

    def open(self, committed: Sequence[int]) -> None:
        self._committed = committed
        self._done = SourceStats()
        if self.governor.open():
            self._start_drafting(0)
        if self.lender is not None:
            self.lender.attach()

    def _start_drafting(self, epoch: int) -> None:
        self.session_id = uuid.uuid4().hex
        with self.lock:
            self.tree.reset(epoch)
            self._delivered = False
        self.worker.start_session(self.session_id, self._committed, epoch)

    def _stop_drafting(self) -> None:
        stats = self.worker.session_stats(self.session_id)
        self.worker.stop_session(self.session_id)
        if stats is not None:
            self._done.draft_forwards += stats.forwards
            self._done.draft_idle_s += stats.idle_s
        with self.lock:
            self.session_id = ""

    def suspend(self) -> None:
        """Stop drafting (engine.sources.PolicyCard hands the session to another drafter)."""
        if self.session_id:
            self._stop_drafting()

    def resume(self, epoch: int) -> StepResult:
        """Draft again from the committed text at ``epoch`` (the chain is empty until it grows)."""
        self._start_drafting(epoch)
        return StepResult(Chain(epoch=epoch))

    def step(self, correction: Correction) -> StepResult:
        self.governor.timed(len(correction.accepted_tokens) + 1)
        if not self.session_id:  # paused (or calibrating): the target decodes alone
            if self.governor.resume():
                self._start_drafting(correction.epoch + 1)
            return StepResult(Chain(epoch=correction.epoch + 1))
        with self.lock:
            delivered = self._delivered
            advance = self.tree.apply_correction(correction)
        if not self.governor.keep(advance.outcome, delivered, len(correction.accepted_tokens)):
            self._stop_drafting()
            return StepResult(Chain(epoch=advance.epoch), advance.outcome)
        self.worker.advance(self.session_id, advance)
        with self.lock:
            return StepResult(self._chain(), advance.outcome)

    def _chain(self) -> Chain:
        """The best chain in the tree now (lock held)."""
        params = self.params
        return self.tree.best_chain(params.max_chain, params.b_extension, params.min_path_prob)

    def close(self, stats: GenerationStats) -> SourceStats:
        if self.lender is not None:
            self.lender.detach()
        if self.session_id:
            self._stop_drafting()
        with self.lock:
            self.tree.reset(0)
        return self._done


class NgramCard:
    """card with the model-free drafter (engine.ngram) run inline: each step applies the
    correction, re-roots, grows until the tree is a chain deep, and returns the best chain.

    The same tree, scores and chain rules as card through a worker; only the thread differs. A
    worker thread would leave the chain that follows a miss empty (the tree restarts at the new
    root while the target asks); inline, the lookups cost ~0.1 ms a layer against a target
    forward of tens of milliseconds. The governor pauses drafting whose chains keep failing
    (``backoff``), as for a neural draft; ``shared`` is the runner's table, used by the target's
    thread alone.
    """

    def __init__(self, params: TreeParams, vocab_size: int, config: NgramConfig, shared: NgramTable | None,
                 max_len: int, backoff: bool = True) -> None:
        self.params = params
        self.drafter = NgramDrafter(params, vocab_size, config, shared, max_len)
        self.governor = Governor(0, enabled=backoff)
        self._committed: Sequence[int] = ()
        self._offered = False  # the last chain held drafted tokens
        self._paused = False

    @property
    def tree(self) -> TwoTierTree:
        return self.drafter.tree

    def open(self, committed: Sequence[int]) -> None:
        self._committed = committed  # the generation's, read when drafting (re)starts
        self.governor.open()
        self.drafter.start(committed, 0)
        self._paused = False

    def suspend(self) -> None:
        self.drafter.release()

    def resume(self, epoch: int) -> StepResult:
        self.drafter.start(self._committed, epoch)
        self._paused = False
        return StepResult(self._grow())

    def step(self, correction: Correction) -> StepResult:
        self.governor.timed(len(correction.accepted_tokens) + 1)
        if self._paused:
            if not self.governor.resume():
                return StepResult(Chain(epoch=correction.epoch + 1))
            self._paused = False
            self.drafter.start(self._committed, correction.epoch + 1)
            return StepResult(self._grow(), None)
        outcome, hit = self.tree.classify(correction)
        advance = Advance(correction.epoch + 1, correction.accepted_tokens, correction.accepted_node_ids,
                          correction.next_token, outcome, hit)
        if not self.governor.keep(outcome, self._offered, len(correction.accepted_tokens)):
            self._paused = True
            self.drafter.release()
            self.drafter.tree.reset(advance.epoch)
            return StepResult(Chain(epoch=advance.epoch), outcome)
        self.drafter.advance(advance)
        return StepResult(self._grow(), outcome)

    def _grow(self) -> Chain:
        """Grow until the tree holds a chain as long as the target takes, then take it."""
        params = self.params
        tree = self.tree
        depth = tree.sizes().depth
        while depth < params.max_chain and self.drafter.plan() is not None:
            depth += 1
        chain = tree.best_chain(params.max_chain, params.b_extension, params.min_path_prob)
        self._offered = bool(chain.tokens)
        return chain

    def close(self, stats: GenerationStats) -> SourceStats:
        self.drafter.release()
        return SourceStats()


# PolicyCard: steps each drafter is judged on, and the steps before a losing drafter is tried
# again (doubling per failed try, up to the second value)
TRIAL_STEPS = 8
RETRY_STEPS = (32, 256)


class PolicyCard:
    """The drafter that pays, per session: the model-free drafter inline (NgramCard) or the
    draft model's worker (LocalCard: neural, or a cascade where the worker is one), each with its
    own governor that pauses it (the target then decodes alone) when its chains keep failing.

    The generation opens on the model-free drafter (it costs the target nothing and wins
    outright where the text repeats its input), tries the draft model for TRIAL_STEPS, then keeps
    whichever committed tokens faster (seconds per committed token, engine.governor.Pace, over
    its latest steps), and tries the other again after RETRY_STEPS. A switch restarts the new
    drafter from the committed text at the next epoch; the output never depends on any of this.
    """

    def __init__(self, ngram: NgramCard, neural: LocalCard,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sources: dict[str, NgramCard | LocalCard] = {"ngram": ngram, "neural": neural}
        self.clock = clock
        self.current = "ngram"
        self.pace: dict[str, Pace] = {}
        self.switches = 0
        self._left = TRIAL_STEPS  # steps until the next decision
        self._trial = True  # the current drafter is on trial (a decision follows)
        self._retry = RETRY_STEPS[0]
        self._last: float | None = None

    def open(self, committed: Sequence[int]) -> None:
        self.pace = {name: Pace() for name in self.sources}
        self.current, self._left, self._trial, self._retry = "ngram", TRIAL_STEPS, True, RETRY_STEPS[0]
        self._last, self.switches = None, 0
        self.sources["neural"].open(committed)
        self.sources["neural"].suspend()
        self.sources["ngram"].open(committed)

    def step(self, correction: Correction) -> StepResult:
        now = self.clock()
        if self._last is not None:
            self.pace[self.current].add(now - self._last, len(correction.accepted_tokens) + 1)
        self._last = now
        self._left -= 1
        if self._left > 0:
            return self.sources[self.current].step(correction)
        other = "neural" if self.current == "ngram" else "ngram"
        if not self._trial:  # the keeper's time is up: try the other again
            return self._switch(other, correction, trial=True)
        if not self.pace[other].steps:  # the other was never tried
            return self._switch(other, correction, trial=True)
        if self.pace[other].s_per_token < self.pace[self.current].s_per_token:
            # the trial lost: back to the other, and a longer wait before the next try
            self._retry = min(2 * self._retry, RETRY_STEPS[1]) if self.switches > 1 else self._retry
            return self._switch(other, correction, trial=False)
        self._trial, self._left, self._retry = False, self._retry, RETRY_STEPS[0]  # the trial won
        return self.sources[self.current].step(correction)

    def _switch(self, to: str, correction: Correction, trial: bool) -> StepResult:
        self.sources[self.current].suspend()
        self.current, self._trial, self.switches = to, trial, self.switches + 1
        self._left = TRIAL_STEPS if trial else self._retry
        if trial:
            self.pace[to] = Pace()  # judged on fresh steps
        self._last = None  # the switch's own step is not timed
        return self.sources[to].resume(correction.epoch + 1)

    def close(self, stats: GenerationStats) -> SourceStats:
        done = SourceStats()
        for source in self.sources.values():
            part = source.close(stats)
            done.draft_forwards += part.draft_forwards
            done.draft_idle_s += part.draft_idle_s
        return done
