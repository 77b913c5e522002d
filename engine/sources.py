"""Where the target's chains come from: one interface, one implementation per decoding mode.

    vanilla  NoDraft:        every chain is empty, the target decodes alone
    sd       SyncDraft:      classic draft-then-verify; after each correction the drafter grows a
                             chain of ``gamma`` tokens while the target waits
    card     LocalCard:      a DraftWorker thread grows the tree continuously into a local
                             TwoTierTree; the target queries and corrects it without waiting

The gRPC trio plugs in the same way (target_service's RemoteCard), so the generation loop in
``engine.generate`` is the only target loop in the project.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import TreeParams
from engine.core_lending import CoreLender
from engine.drafter import Drafter
from engine.tree import Advance, Chain, Correction, Layer, Outcome, TwoTierTree
from engine.worker import DraftWorker


@dataclass(frozen=True)
class StepResult:
    chain: Chain
    outcome: Outcome | None = None  # verdict on the correction that this step applied


@dataclass
class SourceStats:
    draft_forwards: int = 0
    draft_idle_s: float = 0.0


class ChainSource(Protocol):
    def open(self, prompt_ids: Sequence[int]) -> None: ...

    def step(self, correction: Correction) -> StepResult: ...

    def close(self) -> SourceStats: ...


class NoDraft:
    """Plain decoding: the target alone."""

    def open(self, prompt_ids: Sequence[int]) -> None:
        self.epoch = 0

    def step(self, correction: Correction) -> StepResult:
        self.epoch = correction.epoch + 1
        return StepResult(Chain(epoch=self.epoch))

    def close(self) -> SourceStats:
        return SourceStats()


class SyncDraft:
    """Classic speculative decoding: draft ``gamma`` tokens, then verify, in turn."""

    def __init__(self, model: torch.nn.Module, gamma: int = 4) -> None:
        self.gamma = gamma
        self.drafter = Drafter(model, TreeParams(width=1, branch=1, max_depth=gamma, max_chain=gamma))

    def open(self, prompt_ids: Sequence[int]) -> None:
        self.drafter.start(prompt_ids)
        self.drafter.forwards = 0

    def step(self, correction: Correction) -> StepResult:
        outcome, hit = self.drafter.tree.classify(correction)
        self.drafter.advance(Advance(correction.epoch + 1, correction.accepted_tokens,
                                     correction.accepted_node_ids, correction.next_token, outcome, hit))
        while self.drafter.step() is not None:
            pass
        return StepResult(self.drafter.tree.best_chain(self.gamma, b_extension=False), outcome)

    def close(self) -> SourceStats:
        stats = SourceStats(draft_forwards=self.drafter.forwards)
        self.drafter.release()
        return stats


_ACCEPT_EMA = 0.2  # weight of the newest step in LocalCard.first_token_accept
_WAIT_MIN_ACCEPT = 0.5  # below this, a useless draft: never wait for its chains


class LocalCard:
    """CARD in one process: a draft worker thread and a local candidate tree.

    ``lockstep_depth > 0`` makes every step wait until the tree is that deep below the root
    (bounded by ``lockstep_timeout_s``): the paper's draft-R-layers-then-exchange rhythm. It is
    off by default; tests use it to drive hits and re-roots deterministically.
    """

    def __init__(self, worker: DraftWorker | None, params: TreeParams, device: str = "cpu",
                 lockstep_depth: int = 0, lockstep_timeout_s: float = 60.0,
                 lender: CoreLender | None = None) -> None:
        self.worker = worker
        self.lender = lender
        self.params = params
        self.tree = TwoTierTree(torch.device(device))
        self.lock = threading.Condition()
        self.session_id = ""
        self.lockstep_depth = min(lockstep_depth, params.max_depth)
        self.lockstep_timeout_s = lockstep_timeout_s
        # how often the target accepted the first token of a chain (moving average): waiting for
        # a chain (min_chain) pays only with a draft that is usually right
        self.first_token_accept = 1.0
        self._last_chain_len = 0

    def publish(self, session_id: str, layer: Layer) -> None:
        """The worker's publish callback."""
        with self.lock:
            if session_id == self.session_id:
                self.tree.apply_layer(layer)
                self.lock.notify_all()

    def open(self, prompt_ids: Sequence[int]) -> None:
        self.session_id = uuid.uuid4().hex
        with self.lock:
            self.tree.reset(0)
        self.worker.start_session(self.session_id, prompt_ids, 0)
        self.first_token_accept, self._last_chain_len = 1.0, 0
        if self.lender is not None:
            self.lender.attach()

    def step(self, correction: Correction) -> StepResult:
        if self._last_chain_len:
            hit = float(len(correction.accepted_tokens) > 0)
            self.first_token_accept += _ACCEPT_EMA * (hit - self.first_token_accept)
        with self.lock:
            advance = self.tree.apply_correction(correction)
        self.worker.advance(self.session_id, advance)
        params = self.params
        with self.lock:
            if self.lockstep_depth:
                self.lock.wait_for(lambda: self.tree.sizes().depth >= self.lockstep_depth,
                                   self.lockstep_timeout_s)
            chain = self.tree.best_chain(params.max_chain, params.b_extension)
            if len(chain) < params.min_chain and self.first_token_accept >= _WAIT_MIN_ACCEPT:
                chain = self._wait_for_chain(chain)
        self._last_chain_len = len(chain)
        return StepResult(chain, advance.outcome)

    def _wait_for_chain(self, chain: Chain) -> Chain:
        """Wait (lock held) until the chain is ``min_chain`` long, the draft idles or time is up."""
        params = self.params
        deadline = time.monotonic() + params.min_chain_wait_s
        while len(chain) < params.min_chain and not self.worker.idle.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not self.lock.wait(left):
                break
            chain = self.tree.best_chain(params.max_chain, params.b_extension)
        return chain

    def close(self) -> SourceStats:
        if self.lender is not None:
            self.lender.detach()
        stats = self.worker.session_stats(self.session_id)
        self.worker.stop_session(self.session_id)
        with self.lock:
            self.session_id = ""
            self.tree.reset(0)
        if stats is None:  # the worker dropped the session (it logged why)
            return SourceStats()
        return SourceStats(draft_forwards=stats.forwards, draft_idle_s=stats.idle_s)
