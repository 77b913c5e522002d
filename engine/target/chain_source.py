"""The contract between the target engine and wherever its chains come from.

    drafters                  the DraftKinds it can draft with, the first the one it opens on
                              (none: it never drafts)
    draft_with(kind | None)   draft with ``kind`` from now on, or not at all (None); the engine's
                              DraftingPolicy (card.engine.target.drafting_policy) says which,
                              between iterations, and before ``open`` (it then opens so)
    open(committed)           the generation's committed sequence, at epoch 0
    step(correction) -> StepResult   apply the target's correction, return the next chain at once
    close(stats) -> SourceStats      end the session, given the target side's counters (a remote
                              source records them with the cache); the draft side's counters

``committed`` is the generation's own list, live: it grows as the target commits, and a source
may read it (to restart a draft from the text so far, after a pause or a lost cache session) but
never writes it. A source owns its epoch (the target echoes ``chain.epoch`` back in the next
correction) and its own counters; it is told nothing else. The tree work behind a card source is
engine.shared.session.CardSession, in process or in the cache service.

Sources whose steps can travel together (the remote cache's StepBatch: one round trip for every
generation of an engine iteration) declare it with ``BatchStepping``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, cast, runtime_checkable

from card.engine.shared.session import StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Chain, Correction


class DraftKind(Enum):
    """What drafts a generation's chains (the values are the metrics' labels).

        LOOKUP  model-free: the text's own n-grams (the cache's lookup, the inline n-gram drafter);
                no forward, no cores
        WORKER  the draft model (or a cascade) on a draft worker
    """

    LOOKUP = "model-free"
    WORKER = "neural"


@dataclass
class SourceStats:
    """What a source measured over one generation, beside the target's own counters.

    step_rtt_ms: round trips of each step to a remote cache (empty in process).
    """

    draft_forwards: int = 0
    draft_idle_s: float = 0.0
    step_rtt_ms: list[float] = field(default_factory=list)


class ChainSource(Protocol):
    @property
    def drafters(self) -> tuple[DraftKind, ...]: ...

    def draft_with(self, kind: DraftKind | None) -> None: ...

    def open(self, committed: Sequence[int]) -> None: ...

    def step(self, correction: Correction) -> StepResult: ...

    def close(self, stats: GenerationStats) -> SourceStats: ...


@runtime_checkable
class BatchStepping(Protocol):
    """A source whose kind steps many of its sources in one call (one round trip)."""

    @classmethod
    def step_batch(cls, sources: Sequence[BatchStepping], corrections: Sequence[Correction]
                   ) -> list[StepResult]: ...


class NoDraft:
    """Plain decoding: every chain is empty, the target decodes alone."""

    drafters: tuple[DraftKind, ...] = ()

    def draft_with(self, kind: DraftKind | None) -> None:
        pass

    def open(self, committed: Sequence[int]) -> None:
        pass

    def step(self, correction: Correction) -> StepResult:
        return StepResult(Chain(epoch=correction.epoch))

    def close(self, stats: GenerationStats) -> SourceStats:
        return SourceStats()


def step_all(sources: Sequence[ChainSource], corrections: Sequence[Correction]
             ) -> list[StepResult | Exception]:
    """Step every source of one engine iteration. Sources of a ``BatchStepping`` kind go in one
    call per kind; a source that fails gets its exception in its place, the others their results."""
    results: list[StepResult | Exception] = [StepResult(Chain())] * len(sources)
    kinds: dict[type, list[int]] = {}
    for i, source in enumerate(sources):
        kinds.setdefault(type(source), []).append(i)
    for kind, idx in kinds.items():
        if issubclass(kind, BatchStepping) and len(idx) > 1:
            try:
                # every source of this kind is one (issubclass above): the list is of BatchStepping
                batch = [cast(BatchStepping, sources[i]) for i in idx]
                answers = kind.step_batch(batch, [corrections[i] for i in idx])
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
    return results
