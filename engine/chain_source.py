"""The contract between the target loop and wherever its chains come from.

    open(prompt_ids)          the committed sequence at epoch 0
    step(correction) -> StepResult   apply the target's correction, return the next chain at once
    close(stats) -> SourceStats      end the session, given the target side's counters (a remote
                              source records them with the cache); the draft side's counters

A source owns its epoch (the target echoes ``chain.epoch`` back in the next correction) and its
own counters; it is told nothing else. The generation loop (engine.generate) owns the committed
sequence; a source that needs it (to restart a draft from the text so far) rebuilds it from the
corrections it is given, never from the loop's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.stats import GenerationStats
from engine.tree import Chain, Correction, Outcome


@dataclass(frozen=True)
class StepResult:
    """The next chain, and the verdict on the correction that this step applied (None: no tree
    judged it, e.g. plain decoding)."""

    chain: Chain
    outcome: Outcome | None = None


@dataclass
class SourceStats:
    """What a source measured over one generation, beside the target's own counters.

    step_rtt_ms: round trips of each step to a remote cache (empty in process).
    """

    draft_forwards: int = 0
    draft_idle_s: float = 0.0
    step_rtt_ms: list[float] = field(default_factory=list)


class ChainSource(Protocol):
    def open(self, prompt_ids: Sequence[int]) -> None: ...

    def step(self, correction: Correction) -> StepResult: ...

    def close(self, stats: GenerationStats) -> SourceStats: ...
