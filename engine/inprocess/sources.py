"""Where the target's chains come from in one process: one engine.target.chain_source.ChainSource
per decoding mode. Every card source is a CardSession (engine.shared.session, the one place a
correction meets a tree) with a link to the draft that grows it:

    vanilla  NoDraft:     every chain is empty (engine.target.chain_source: the target side owns it)
    sd       SyncDraft:   classic draft-then-verify: after each correction the drafter grows a chain
                          of ``gamma`` tokens while the target waits (SyncLink)
    card     LocalCard:   a DraftWorker thread grows the tree continuously (WorkerLink); the target
                          queries and corrects it without waiting
    card     NgramCard:   the model-free drafter in the target's own thread (in-process
                          ``--draft-model ngram``, InlineLink): it grows a chain's worth of layers
                          in microseconds after each correction, so no chain is ever empty for
                          want of a thread switch
    card     PolicyCard:  per session, whichever of NgramCard and LocalCard commits tokens faster

LocalCard and NgramCard are ``Governed``: engine.inprocess.governor pauses a draft that keeps missing or
slows the target (the session then follows the corrections with an empty tree) and restarts it
from the committed text later. The gRPC trio plugs in the same way (target_service's RemoteCard,
the CardSession in the cache service).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import torch

from card.engine.draft.drafter import Drafter
from card.engine.draft.ngram import NgramDrafter
from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.core_lending import CoreLender
from card.engine.inprocess.governor import Governor
from card.engine.shared.config import ChainDraw, NgramConfig, TreeParams
from card.engine.shared.ngram_stats import NgramTable
from card.engine.shared.session import CardSession, DraftLink, StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Advance, Chain, Correction, Layer
from card.engine.target.chain_source import SourceStats
from card.engine.target.drafter_choice import MODEL_FREE, NEURAL, DrafterChoice


# ---- links: how a session reaches its draft ------------------------------------------------------
class SyncLink:
    """A Drafter run in the caller's thread: every start or advance grows the tree to its
    ``max_depth`` before returning (the target waits: classic speculative decoding)."""

    def __init__(self, drafter: Drafter, session: CardSession) -> None:
        self.drafter = drafter
        self.session = session

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        self.drafter.start(committed, epoch, draw)
        self._grow()

    def advance(self, advance: Advance) -> None:
        self.drafter.advance(advance)
        self._grow()

    def stop(self) -> None:
        self.drafter.release()

    def _grow(self) -> None:
        while (layers := self.drafter.grow()) is not None:
            for layer in layers:
                self.session.apply_layer(layer)


class WorkerLink:
    """One draft session on a DraftWorker thread, under an id of its own: layers published for
    an id that is no longer the session's link (a stopped or restarted draft) are dropped.
    ``delivered``: a layer has arrived since it started. Its draft counters go to ``done`` when
    it stops."""

    def __init__(self, worker: DraftWorker, session: CardSession, done: SourceStats) -> None:
        self.worker = worker
        self.session = session
        self.done = done
        self.session_id = uuid.uuid4().hex
        self.delivered = False

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        self.delivered = False
        self.worker.start_session(self.session_id, committed, epoch, draw)

    def advance(self, advance: Advance) -> None:
        self.worker.advance(self.session_id, advance)

    def stop(self) -> None:
        stats = self.worker.session_stats(self.session_id)
        self.worker.stop_session(self.session_id)
        if stats is not None:
            self.done.draft_forwards += stats.forwards
            self.done.draft_idle_s += stats.idle_s

    def deliver(self, layer: Layer) -> None:
        if self.session.apply_layer(layer):
            self.delivered = True


class InlineLink(SyncLink):
    """The model-free drafter in the caller's thread: every start or advance grows the tree
    until it is ``depth`` deep (a chain's worth), a few dict probes a layer."""

    def __init__(self, drafter: NgramDrafter, session: CardSession, depth: int) -> None:
        super().__init__(drafter, session)
        self.depth = depth
        self.delivered = False

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        self.delivered = False
        super().start(committed, epoch, draw)

    def _grow(self) -> None:
        depth = self.drafter.tree.sizes().depth
        while depth < self.depth and (layer := self.drafter.plan()) is not None:
            depth += 1
            self.delivered = self.session.apply_layer(layer) or self.delivered


# ---- sources -------------------------------------------------------------------------------------
def stop_drafting(session: CardSession) -> None:
    """The engine's controller pauses a source's drafting (Pausable): its link stops now; the
    tree still serves the correction in flight and empties after it."""
    link = session.detach(keep_tree=True)
    if link is not None:
        link.stop()


class SyncDraft:
    """Classic speculative decoding: draft ``gamma`` tokens, then verify, in turn. ``tree``: grow
    this tree instead of one chain (draft-then-verify on a tree: deterministic, for tests)."""

    def __init__(self, model: torch.nn.Module, gamma: int = 4, kv_len: int | None = None,
                 draw: ChainDraw | None = None, tree: TreeParams | None = None) -> None:
        self.gamma = gamma
        params = tree or TreeParams(width=1, branch=1, max_depth=gamma, max_chain=gamma, b_extension=False)
        self.drafter = Drafter(model, params, max_len=kv_len)
        self.session = CardSession(params, draw=draw)
        self._held = False  # the engine's speculation controller paused drafting (Pausable)

    def open(self, committed: Sequence[int]) -> None:
        self.drafter.forwards = 0
        self.session.open(committed)
        if not self._held:
            self.session.attach(SyncLink(self.drafter, self.session))

    def step(self, correction: Correction) -> StepResult:
        return self.session.step(correction)

    def pause_drafting(self) -> None:
        self._held = True
        stop_drafting(self.session)

    def resume_drafting(self) -> None:
        self._held = False
        self.session.attach(SyncLink(self.drafter, self.session))

    def close(self, stats: GenerationStats) -> SourceStats:
        done = SourceStats(draft_forwards=self.drafter.forwards)
        self.session.close()
        return done


class Governed:
    """A card source whose draft the governor pauses and restarts (engine.inprocess.governor):
    paused, the session follows the corrections with an empty tree and the target decodes
    alone; restarted, a new link drafts from the committed text. ``calibration_steps`` plain
    steps open each generation to measure the alone pace (0: draft from the first step, pace
    rule off until a pause); ``backoff=False`` drafts throughout. Output never depends on it."""

    def __init__(self, params: TreeParams, device: str = "cpu", calibration_steps: int = 0,
                 backoff: bool = True, draw: ChainDraw | None = None) -> None:
        self.params = params
        self.session = CardSession(params, device, draw=draw)
        self.governor = Governor(calibration_steps, enabled=backoff)
        self._committed: Sequence[int] = ()  # the generation's, read when drafting (re)starts
        self._done = SourceStats()  # draft counters of the links already stopped
        self._held = False  # the engine's speculation controller paused drafting (Pausable)

    def _new_link(self) -> DraftLink:
        raise NotImplementedError

    @property
    def link(self) -> WorkerLink | InlineLink | None:
        return self.session.link  # type: ignore[return-value]

    @property
    def tree(self):
        return self.session.tree

    def open(self, committed: Sequence[int]) -> None:
        self._committed = committed
        self._done = SourceStats()
        self.session.open(committed)
        if self.governor.open() and not self._held:
            self.session.attach(self._new_link())

    def pause_drafting(self) -> None:
        """The engine's controller pauses drafting: the link stops now; the tree still serves
        the correction in flight and empties after it."""
        self._held = True
        stop_drafting(self.session)

    def resume_drafting(self) -> None:
        """Draft again from the committed text, unless the governor's own pause runs on."""
        self._held = False
        if self.governor.drafting and self.link is None and not self.session.closed:
            self.session.attach(self._new_link())

    def step(self, correction: Correction) -> StepResult:
        self.governor.timed(len(correction.accepted_tokens) + 1)
        session = self.session
        link = self.link
        if link is None:  # paused (or calibrating): the target decodes alone
            session.step(correction)
            if not self._held and self.governor.resume():
                session.attach(self._new_link())
            return StepResult(session.next_chain())
        delivered = link.delivered
        result = session.step(correction)
        if not self.governor.keep(result.outcome, delivered, len(correction.accepted_tokens)):
            self._pause()
            return StepResult(Chain(epoch=session.epoch), result.outcome)
        return result

    def _pause(self) -> None:
        link = self.session.detach(keep_tree=False)
        if link is not None:
            link.stop()

    def suspend(self) -> None:
        """Stop drafting (PolicyCard hands the session to another drafter)."""
        self._pause()

    def resume(self, epoch: int) -> StepResult:
        """Draft again from the committed text at ``epoch``."""
        self.session.open(self._committed, epoch)
        self.session.attach(self._new_link())
        return StepResult(self.session.next_chain())

    def close(self, stats: GenerationStats) -> SourceStats:
        self.session.close()
        return self._done


class LocalCard(Governed):
    """CARD in one process: a draft worker thread and a local candidate tree. The worker's
    ``publish`` reaches the session through ``publish`` (the runner routes every layer to every
    card; each keeps its current link's). With ``lender``, the target borrows the worker's cores
    while it idles (engine.inprocess.core_lending)."""

    def __init__(self, worker: DraftWorker | None, params: TreeParams, device: str = "cpu",
                 lender: CoreLender | None = None, calibration_steps: int = 0,
                 backoff: bool = True, draw: ChainDraw | None = None) -> None:
        super().__init__(params, device, calibration_steps, backoff, draw)
        self.worker = worker
        self.lender = lender

    def _new_link(self) -> WorkerLink:
        assert self.worker is not None
        return WorkerLink(self.worker, self.session, self._done)

    def publish(self, session_id: str, layer: Layer) -> None:
        """The worker's publish callback."""
        link = self.link
        if isinstance(link, WorkerLink) and link.session_id == session_id:
            link.deliver(layer)

    def open(self, committed: Sequence[int]) -> None:
        super().open(committed)
        if self.lender is not None:
            self.lender.attach()

    def close(self, stats: GenerationStats) -> SourceStats:
        if self.lender is not None:
            self.lender.detach()
        return super().close(stats)


class NgramCard(Governed):
    """card with the model-free drafter (engine.draft.ngram) run inline: the same tree, scores
    and chain rules as card through a worker; only the thread differs. A worker thread would
    leave the chain that follows a miss empty (the tree restarts at the new root while the target
    asks); inline, the lookups cost ~0.1 ms a layer against a target forward of tens of
    milliseconds. ``shared`` is the runner's table, used by the target's thread alone."""

    def __init__(self, params: TreeParams, vocab_size: int, config: NgramConfig, shared: NgramTable | None,
                 max_len: int, backoff: bool = True, draw: ChainDraw | None = None) -> None:
        super().__init__(params, backoff=backoff, draw=draw)
        self.drafter = NgramDrafter(params, vocab_size, config, shared, max_len)

    def _new_link(self) -> InlineLink:
        return InlineLink(self.drafter, self.session, self.params.max_chain)


class PolicyCard:
    """The drafter that pays, per session (card.engine.target.drafter_choice): the model-free
    drafter inline (NgramCard) or the draft model's worker (LocalCard: neural, or a cascade where
    the worker is one), each with its own governor that pauses it (the target then decodes alone)
    when its chains keep failing. A switch restarts the new drafter from the committed text at the
    next epoch; the output never depends on any of this."""

    def __init__(self, ngram: NgramCard, neural: LocalCard,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.sources: dict[str, NgramCard | LocalCard] = {MODEL_FREE: ngram, NEURAL: neural}
        self.clock = clock
        self.choice = DrafterChoice(clock)
        self._held = False  # the engine's speculation controller paused drafting (Pausable)

    @property
    def current(self) -> str:
        return self.choice.current

    @property
    def switches(self) -> int:
        return self.choice.switches

    def pause_drafting(self) -> None:
        self._held = True
        self.sources[self.current].pause_drafting()

    def resume_drafting(self) -> None:
        self._held = False
        self.sources[self.current].resume_drafting()

    def open(self, committed: Sequence[int]) -> None:
        self.choice = DrafterChoice(self.clock)
        self.sources[NEURAL].open(committed)
        self.sources[NEURAL].suspend()
        self.sources[MODEL_FREE].open(committed)

    def step(self, correction: Correction) -> StepResult:
        if self._held:  # no drafter runs: nothing to time or judge
            self.choice.untimed()
            return self.sources[self.current].step(correction)
        before = self.current
        to = self.choice.step(len(correction.accepted_tokens) + 1)
        if to is None:
            return self.sources[self.current].step(correction)
        self.sources[before].suspend()
        return self.sources[to].resume(correction.epoch + 1)

    def close(self, stats: GenerationStats) -> SourceStats:
        done = SourceStats()
        for source in self.sources.values():
            part = source.close(stats)
            done.draft_forwards += part.draft_forwards
            done.draft_idle_s += part.draft_idle_s
        return done
