"""Where the target's chains come from in one process: one engine.target.chain_source.ChainSource
per decoding mode. Every card source is a ``DraftedCard``: a CardSession (engine.shared.session,
the one place a correction meets a tree) per drafter it offers, each with the link to the draft
that grows it, and the one verb ``draft_with`` the engine's DraftingPolicy steers it with:

    vanilla  NoDraft:     every chain is empty (engine.target.chain_source: the target side owns it)
    sd       SyncDraft:   classic draft-then-verify: after each correction the drafter grows a chain
                          of ``gamma`` tokens while the target waits (SyncLink)
    card     LocalCard:   a DraftWorker thread grows the tree continuously (DraftThreadLink); the
                          target queries and corrects it without waiting
    card     NgramCard:   the model-free drafter in the target's own thread (in-process
                          ``--draft-model ngram``, InlineLink): it grows a chain's worth of layers
                          in microseconds after each correction, so no chain is ever empty for
                          want of a thread switch
    card     AutoCard:    both, the policy choosing per generation (card-auto)

Stopped (``draft_with(None)``), a source's link stops and its session follows the corrections
with an empty tree; started again, a new link drafts from the committed text. The gRPC trio plugs
in the same way (target_service's RemoteCard, the CardSession in the cache service).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import torch

from card.engine.draft.drafter import Drafter
from card.engine.draft.ngram import NgramDrafter
from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.core_lending import CoreLender
from card.engine.shared.config import ChainDraw, NgramConfig, TreeParams
from card.engine.shared.ngram_stats import NgramTable
from card.engine.shared.session import CardSession, DraftLink, StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Advance, Correction, Layer
from card.engine.target.chain_source import DraftKind, SourceStats


# ---- links: how a session reaches its draft ------------------------------------------------------
class SyncLink:
    """A Drafter run in the caller's thread: every start or advance grows the tree to its
    ``max_depth`` before returning (the target waits: classic speculative decoding)."""

    def __init__(self, drafter: Drafter | NgramDrafter, session: CardSession) -> None:
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
        assert isinstance(self.drafter, Drafter)  # InlineLink grows its NgramDrafter itself
        while (layers := self.drafter.grow()) is not None:
            for layer in layers:
                self.session.apply_layer(layer)


class DraftThreadLink:
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
        self.ngram = drafter
        self.depth = depth
        self.delivered = False

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        self.delivered = False
        super().start(committed, epoch, draw)

    def _grow(self) -> None:
        depth = self.ngram.tree.sizes().depth
        while depth < self.depth and (layer := self.ngram.plan()) is not None:
            depth += 1
            self.delivered = self.session.apply_layer(layer) or self.delivered


# ---- sources -------------------------------------------------------------------------------------
class DraftedCard:
    """A card source over one CardSession per drafter it offers (``drafts``: each kind's session
    and the factory of a new link to its draft). The active session follows the corrections;
    ``draft_with`` stops its link (the tree still serves the correction in flight, then
    empties), starts a new one from the committed text, or hands the generation to another
    drafter's session at the next step (a new epoch: that session's own tree)."""

    def __init__(self, drafts: dict[DraftKind, tuple[CardSession, Callable[[], DraftLink]]]) -> None:
        self.drafts = drafts
        self.drafters = tuple(drafts)
        self.active = self.drafters[0]
        self._kind: DraftKind | None = self.active  # what drafts now
        self._handoff: DraftKind | None = None  # the session that takes over at the next step
        self._committed: Sequence[int] = ()  # the generation's, read when a draft (re)starts
        self._opened = False

    @property
    def session(self) -> CardSession:
        return self.drafts[self.active][0]

    def draft_with(self, kind: DraftKind | None) -> None:
        if kind is self._kind:
            return
        self._kind, self._handoff = kind, None
        if not self._opened:
            self.active = kind or self.active
            return
        self._stop()
        if kind is None or self.session.closed:
            return
        if kind is self.active:
            self.session.attach(self.drafts[kind][1]())
        else:
            self._handoff = kind

    def _stop(self) -> None:
        link = self.session.detach(keep_tree=True)
        if link is not None:
            link.stop()

    def open(self, committed: Sequence[int]) -> None:
        self._committed, self._opened = committed, True
        self.session.open(committed)
        if self._kind is not None:
            self.session.attach(self.drafts[self._kind][1]())

    def step(self, correction: Correction) -> StepResult:
        result = self.session.step(correction)
        if self._handoff is None:
            return result
        self.active, self._handoff = self._handoff, None
        session = self.session
        session.open(self._committed, correction.epoch + 1)
        session.attach(self.drafts[self.active][1]())
        return StepResult(session.next_chain(), result.outcome)

    def close(self, stats: GenerationStats) -> SourceStats:
        for session, _ in self.drafts.values():
            session.close()
        return SourceStats()


class SyncDraft(DraftedCard):
    """Classic speculative decoding: draft ``gamma`` tokens, then verify, in turn. ``tree``: grow
    this tree instead of one chain (draft-then-verify on a tree: deterministic, for tests)."""

    def __init__(self, model: torch.nn.Module, gamma: int = 4, kv_len: int | None = None,
                 draw: ChainDraw | None = None, tree: TreeParams | None = None) -> None:
        self.gamma = gamma
        params = tree or TreeParams(width=1, branch=1, max_depth=gamma, max_chain=gamma, b_extension=False)
        self.drafter = Drafter(model, params, max_len=kv_len)
        session = CardSession(params, draw=draw)
        super().__init__({DraftKind.WORKER: (session, lambda: SyncLink(self.drafter, session))})

    def open(self, committed: Sequence[int]) -> None:
        self.drafter.forwards = 0
        super().open(committed)

    def close(self, stats: GenerationStats) -> SourceStats:
        super().close(stats)
        return SourceStats(draft_forwards=self.drafter.forwards)


class LocalCard(DraftedCard):
    """CARD in one process: a draft worker thread and a local candidate tree. The worker's
    ``publish`` reaches the session through ``publish`` (the runner routes every layer to every
    card; each keeps its current link's). With ``lender``, the target borrows the worker's cores
    while it idles (engine.inprocess.core_lending)."""

    def __init__(self, worker: DraftWorker | None, params: TreeParams, device: str = "cpu",
                 lender: CoreLender | None = None, draw: ChainDraw | None = None) -> None:
        self.worker = worker
        self.lender = lender
        self.params = params
        self._done = SourceStats()  # draft counters of the links already stopped
        session = CardSession(params, device, draw=draw)
        super().__init__({DraftKind.WORKER: (session, lambda: self._link(session))})

    def _link(self, session: CardSession) -> DraftThreadLink:
        assert self.worker is not None
        return DraftThreadLink(self.worker, session, self._done)

    @property
    def link(self) -> DraftLink | None:
        return self.drafts[DraftKind.WORKER][0].link

    def publish(self, session_id: str, layer: Layer) -> None:
        """The worker's publish callback."""
        link = self.link
        if isinstance(link, DraftThreadLink) and link.session_id == session_id:
            link.deliver(layer)

    def open(self, committed: Sequence[int]) -> None:
        self._done = SourceStats()
        super().open(committed)
        if self.lender is not None:
            self.lender.attach()

    def close(self, stats: GenerationStats) -> SourceStats:
        if self.lender is not None:
            self.lender.detach()
        super().close(stats)
        return self._done


class NgramCard(DraftedCard):
    """card with the model-free drafter (engine.draft.ngram) run inline: the same tree, scores
    and chain rules as card through a worker; only the thread differs. A worker thread would
    leave the chain that follows a miss empty (the tree restarts at the new root while the target
    asks); inline, the lookups cost ~0.1 ms a layer against a target forward of tens of
    milliseconds. ``shared`` is the runner's table, used by the target's thread alone."""

    def __init__(self, params: TreeParams, vocab_size: int, config: NgramConfig, shared: NgramTable | None,
                 max_len: int, draw: ChainDraw | None = None) -> None:
        self.params = params
        self.drafter = NgramDrafter(params, vocab_size, config, shared, max_len)
        session = CardSession(params, draw=draw)
        super().__init__({DraftKind.LOOKUP: (session, lambda: InlineLink(self.drafter, session,
                                                                         params.max_chain))})


class AutoCard(DraftedCard):
    """card-auto in process: the inline model-free drafter (NgramCard) and the draft model's
    worker (LocalCard: neural, or a cascade where the worker is one), each on its own session;
    the engine's DraftingPolicy chooses per generation by measured pace. A switch restarts the
    new drafter from the committed text at the next epoch; the output never depends on it."""

    def __init__(self, ngram: NgramCard, neural: LocalCard) -> None:
        self.parts = (ngram, neural)
        super().__init__({**ngram.drafts, **neural.drafts})

    def open(self, committed: Sequence[int]) -> None:
        self.parts[1]._done = SourceStats()
        super().open(committed)
        if self.parts[1].lender is not None:
            self.parts[1].lender.attach()

    def close(self, stats: GenerationStats) -> SourceStats:
        done = SourceStats()
        for part in self.parts:
            got = part.close(stats)
            done.draft_forwards += got.draft_forwards
            done.draft_idle_s += got.draft_idle_s
        return done
