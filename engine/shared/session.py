"""One session of query-and-correct (DESIGN.md §3): the only code that applies a target's
correction to a candidate tree.

    open(committed, epoch)   the committed text so far; the draft (if linked) starts from it
    step(correction)         1. classify the correction against the tree (hit / secondary / miss)
                             2. re-root the tree below the hit (or empty it), epoch + 1
                             3. the committed text grows by the accepted tokens and the next token
                             4. tell the draft: the advance, or the restart that was waiting
                             5. the next chain of what the tree holds now, at once (never waits):
                                the best path, or (``draw``, a rejection request) a drawn one;
                                where the tree holds nothing (a miss, the draft restarting, no
                                draft at all), the session's ``lookup`` continues its own text
    apply_layer(layer)       a layer the draft grew, added where its parents still are
    attach(link) / detach()  a draft starts serving the session / stops (restarts wait, see below)
    close()                  the draft stops, the tree is freed

Who runs it: the cache service's session table (the draft is a remote worker, its link a command
queue), and in one process the card sources of engine.inprocess (a draft worker thread, the
model-free drafter inline, classic draft-then-verify). The target side and the draft side meet
here and nowhere else.

A draft that starts serving a session whose tree still holds nodes waits for the next correction:
the target may be verifying a chain of those nodes right now, so the tree must still know them
when that correction arrives. Layers are refused meanwhile (they belong to the old tree).

``lock`` (re-entrant, a Condition) guards the session: the target's thread steps it while a
draft's thread applies layers; callers that check their own state beside it may hold it too.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from card.engine.shared.config import ChainDraw, TreeParams
from card.engine.shared.tree import (
    NO_NODE,
    Advance,
    Chain,
    Correction,
    Layer,
    Outcome,
    TreeBudget,
    TreeLimits,
    TwoTierTree,
)


class DraftLink(Protocol):
    """How a session reaches the draft that grows its tree (a queue to a worker, a drafter in
    the same thread). Layers come back through ``CardSession.apply_layer``."""

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        """Grow a fresh tree from ``committed`` under the virtual root of ``epoch``; ``draw``: give
        every expanded node a child drawn from its tier B (a rejection session, Drafter.start)."""

    def advance(self, advance: Advance) -> None:
        """Re-root on the session's verdict (a hit keeps the subtree below it)."""

    def stop(self) -> None:
        """The session no longer needs this draft: free what it holds."""


class Lookup(Protocol):
    """Model-free chains from the session's own committed text (card.engine.shared.ngram_stats'
    PromptLookup): the chain of a step whose tree holds nothing. Its tokens are no tree node's
    (``NO_NODE``); accepted, the next correction finds them by token in whatever the draft grew
    meanwhile (TwoTierTree.classify)."""

    def open(self, committed: Sequence[int]) -> None:
        """Start over from ``committed``."""

    def extend(self, tokens: Sequence[int]) -> None:
        """The committed text grew by ``tokens``."""

    def continuation(self, length: int, min_path_prob: float = 0.0) -> tuple[int, ...]:
        """The likeliest next tokens after the committed text (at most ``length``), cut where
        their path score falls below ``min_path_prob``."""


@dataclass(frozen=True)
class StepResult:
    """The next chain, and the verdict on the correction that this step applied (None: no tree
    judged it, e.g. plain decoding). ``looked_up``: the chain is the session's Lookup's, not the
    tree's."""

    chain: Chain
    outcome: Outcome | None = None
    looked_up: bool = False


class CardSession:
    """``params``: the chain rule (max_chain, b_extension, min_path_prob) of this session;
    ``device``: where the tree's columns live; ``draw``: chains are drawn (config.ChainDraw);
    ``lookup``: model-free chains where the tree holds nothing (best-path chains only: a drawn
    chain needs the distribution each token was drawn from); ``limits``: what its tree holds at most
    (a layer's excess is dropped and counted, ``tree.dropped``)."""

    def __init__(self, params: TreeParams, device: torch.device | str = "cpu",
                 link: DraftLink | None = None, draw: ChainDraw | None = None,
                 lookup: Lookup | None = None, limits: TreeLimits | None = None) -> None:
        self.params = params
        self.draw = draw
        self.lookup = lookup if draw is None else None
        self.looked_up = 0  # chains the lookup answered
        # its own stream, never the target's position-keyed uniforms (the rule needs the chain
        # independent of the target's coins)
        self._rng = random.Random(f"card-chain-draw:{draw.seed}") if draw is not None else None
        self.tree = TwoTierTree(torch.device(device), limits=limits or TreeLimits())
        self.committed: list[int] = []
        self.link = link
        self.restart_pending = False
        self.closed = False
        self.outcomes: dict[Outcome, int] = dict.fromkeys(Outcome, 0)
        self.steps = 0
        self.layers = 0
        self.lock = threading.Condition(threading.RLock())

    @property
    def epoch(self) -> int:
        return self.tree.epoch

    def open(self, committed: Sequence[int], epoch: int = 0) -> None:
        """Start (or start over) from ``committed`` at ``epoch`` with an empty tree."""
        with self.lock:
            self.committed = list(committed)
            self.closed = False
            if self.lookup is not None:
                self.lookup.open(self.committed)
            self._restart(epoch)

    def step(self, correction: Correction) -> StepResult:
        """Apply the target's correction and return the next chain. Aborted: a stale epoch;
        InvalidArgument: an accepted path the tree does not hold."""
        with self.lock:
            advance = self.tree.apply_correction(correction)  # classify, re-root, epoch + 1
            grown = (*correction.accepted_tokens, correction.next_token)
            self.committed += grown
            if self.lookup is not None:
                self.lookup.extend(grown)
            self.outcomes[advance.outcome] += 1
            self.steps += 1
            if self.restart_pending:
                self._restart(self.epoch)
            elif self.link is not None:
                self.link.advance(advance)
            chain, looked_up = self.offer()
            return StepResult(chain, advance.outcome, looked_up)

    def next_chain(self) -> Chain:
        """The chain to verify next: the tree's best path, or a drawn one (``draw``); where the
        tree has none, the lookup's continuation of the committed text."""
        return self.offer()[0]

    def offer(self) -> tuple[Chain, bool]:
        """The next chain, and whether the lookup made it (the tree had none)."""
        p = self.params
        with self.lock:
            if self.draw is not None and self._rng is not None:  # set together in __init__
                drawn = self.tree.drawn_chain(p.max_chain, self.draw.temperature, self._rng, p.min_path_prob)
                return drawn, False
            chain = self.tree.best_chain(p.max_chain, p.b_extension, p.min_path_prob)
            if chain.tokens or self.lookup is None:
                return chain, False
            tokens = self.lookup.continuation(p.max_chain, p.min_path_prob)
            if not tokens:
                return chain, False
            self.looked_up += 1
            return Chain(tokens, (NO_NODE,) * len(tokens), self.epoch), True

    def apply_layer(self, layer: Layer, budget: TreeBudget | None = None) -> bool:
        """Add a layer the draft grew; False when it was dropped whole (the session is closed,
        or a restart is waiting and the layer belongs to the old tree). ``budget``: what the trees
        of the draft's sessions hold together at most (the cache's, per worker)."""
        with self.lock:
            if self.closed or self.restart_pending:
                return False
            self.tree.apply_layer(layer, budget)
            self.layers += 1
            self.lock.notify_all()
            return True

    def attach(self, link: DraftLink) -> None:
        """``link``'s draft serves the session from now on: it starts from the committed text at
        once when the tree is empty, else right after the next correction."""
        with self.lock:
            self.link = link
            if len(self.tree) == 0 and not self.restart_pending:
                self._restart(self.epoch)
            else:
                self.restart_pending = True

    def detach(self, keep_tree: bool = True) -> DraftLink | None:
        """The draft stops serving the session (it left, or the caller pauses it; stopping it is
        the caller's: a draft that is gone cannot be told). With ``keep_tree`` the nodes it grew
        still serve the chain in flight and the tree empties after the next correction; without,
        it empties now (the caller hands the target no chain of it). Returns the link."""
        with self.lock:
            link, self.link = self.link, None
            if keep_tree and len(self.tree):
                self.restart_pending = True
            else:
                self.tree.reset(self.epoch)
                self.restart_pending = False
            return link

    def close(self) -> None:
        """End the session: the draft stops, the tree's tensors are freed now."""
        with self.lock:
            link, self.link = self.link, None
            self.closed = True
            self.restart_pending = False
            self.tree.reset(self.epoch)
        if link is not None:
            link.stop()

    def _restart(self, epoch: int) -> None:
        self.tree.reset(epoch)
        self.restart_pending = False
        if self.link is not None:
            self.link.start(tuple(self.committed), epoch, self.draw)
