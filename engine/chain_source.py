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
    def open(self, committed: Sequence[int]) -> None: ...

    def step(self, correction: Correction) -> StepResult: ...

    def close(self, stats: GenerationStats) -> SourceStats: ...


def step_all(sources: Sequence[ChainSource], corrections: Sequence[Correction]
             ) -> list[StepResult | Exception]:
    """Step every source of one engine iteration. Sources of a kind that can travel together (a
    ``step_batch(sources, corrections)`` staticmethod: the remote cache's StepBatch) go in one call;
    a source that fails gets its exception in its place, the others their results."""
    results: list[StepResult | Exception | None] = [None] * len(sources)
    kinds: dict[type, list[int]] = {}
    for i, source in enumerate(sources):
        kinds.setdefault(type(source), []).append(i)
    for kind, idx in kinds.items():
        batch = getattr(kind, "step_batch", None)
        if batch is not None and len(idx) > 1:
            try:
                answers = batch([sources[i] for i in idx], [corrections[i] for i in idx])
                for i, result in zip(idx, answers, strict=True):
                    results[i] = result
            except Exception as exc:
                for i in idx:
                    results[i] = exc
            continue
        for i in idx:
            try:
                results[i] = sources[i].step(corrections[i])
            except Exception as exc:
                results[i] = exc
    return results  # type: ignore[return-value]
