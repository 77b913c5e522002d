"""The speculation controller: engine-wide regime by measured throughput, per-generation pauses.

Unit tests drive the controller with made-up iterations; the engine tests run a tiny model with a
draft whose cost is known (it sleeps while it drafts), so which regime pays is not in doubt.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import pytest

from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.session import StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Chain, Correction
from card.engine.target.chain_source import NoDraft, Pausable, SourceStats
from card.engine.target.controller import (
    Regime,
    SessionControl,
    SpeculationControl,
    SpeculationController,
)
from card.engine.target.generation import Generation, GenerationResult
from card.engine.target.scheduler import run_alone
from tests.engine.support import generate, letters, target_model

CONTROL = SpeculationControl(first_hold=4, hold=(4, 32), settle=(1, 1), judge=4)


def _run(ctl: SpeculationController, iterations: int, spec: tuple[int, float], plain: tuple[int, float],
         batch: int = 4) -> list[Regime]:
    """Feed ``iterations``: (tokens, seconds) per iteration of each regime; the regimes seen."""
    seen = []
    for _ in range(iterations):
        tokens, seconds = spec if ctl.speculating else plain
        seen.append(ctl.regime)
        ctl.observe(batch, tokens, seconds, clean=True)
    return seen


def test_speculation_that_costs_more_than_it_returns_is_turned_off_and_probed_ever_less() -> None:
    decisions, probes = [], []

    def decided(d) -> None:
        decisions.append(d)
        if d.why == "probe" and d.regime is Regime.SPEC:
            probes.append(ctl.iteration)

    ctl = SpeculationController(CONTROL, on_decision=decided)
    # speculating: 6 tokens in 0.1 s (60 tok/s); plain: 4 tokens in 0.05 s (80 tok/s)
    seen = _run(ctl, 400, spec=(6, 0.1), plain=(4, 0.05))
    assert ctl.regime is Regime.PLAIN
    assert seen[-100:].count(Regime.SPEC) < 20  # probes only, rarer and rarer
    lost = [d for d in decisions if d.why == "lost" and d.regime is Regime.PLAIN]
    assert lost and lost[-1].plain_rate == pytest.approx(80) and lost[-1].spec_rate == pytest.approx(60)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # holds grow


def test_speculation_that_pays_holds_and_plain_is_probed_ever_less() -> None:
    ctl = SpeculationController(CONTROL)
    seen = _run(ctl, 400, spec=(10, 0.1), plain=(4, 0.05))
    assert ctl.regime is Regime.SPEC
    # probes of plain decoding only, each settle + judge long, once per longest hold at most
    probe = CONTROL.judge + CONTROL.settle[0]
    assert seen[-200:].count(Regime.PLAIN) <= (200 // CONTROL.hold[1] + 1) * probe
    assert seen[:100].count(Regime.PLAIN) > seen[-100:].count(Regime.PLAIN)


def test_the_regime_follows_a_change_of_load() -> None:
    ctl = SpeculationController(CONTROL)
    _run(ctl, 200, spec=(10, 0.1), plain=(4, 0.05), batch=1)
    assert ctl.regime is Regime.SPEC
    # a heavier load: at batch 8 speculation no longer pays; batch 8 was never measured plain, so
    # the controller measures it before it judges
    _run(ctl, 400, spec=(12, 0.2), plain=(8, 0.06), batch=8)
    assert ctl.regime is Regime.PLAIN and ctl.rate(Regime.PLAIN, 8) == pytest.approx(8 / 0.06)


def test_always_and_never_do_not_switch() -> None:
    for mode, regime in (("always", Regime.SPEC), ("never", Regime.PLAIN)):
        ctl = SpeculationController(SpeculationControl(mode=mode))
        seen = _run(ctl, 300, spec=(6, 0.1), plain=(4, 0.01) if mode == "always" else (4, 1.0))
        assert set(seen) == {regime} and ctl.switches == 0
    with pytest.raises(InvalidArgument, match="speculation must be one of"):
        SpeculationControl(mode="sometimes")


def test_iterations_with_a_prefill_are_not_measured() -> None:
    ctl = SpeculationController(CONTROL)
    for _ in range(100):  # prefill-laden plain iterations look slow: they must not count
        ctl.observe(4, 6 if ctl.speculating else 4, 0.1 if ctl.speculating else 5.0, clean=ctl.speculating)
    assert Regime.PLAIN not in ctl.rates or 4 not in ctl.rates[Regime.PLAIN]


def test_a_generation_whose_chains_are_rejected_or_never_verified_pauses_its_draft() -> None:
    ctl = SpeculationController(SpeculationControl(min_alpha=0.12, unpaid_steps=3, session_pause=(4, 16)))
    rejected = SessionControl()
    assert not ctl.session_step(rejected, offered=4, verified=4, alpha=0.05, judged=False)  # too soon
    assert ctl.session_step(rejected, offered=4, verified=4, alpha=0.05, judged=True)
    assert not ctl.drafting(rejected) and rejected.paused_left == 4
    assert [ctl.session_paused_step(rejected) for _ in range(4)] == [False, False, False, True]
    assert ctl.drafting(rejected)
    assert ctl.session_step(rejected, offered=4, verified=4, alpha=0.05, judged=True)
    assert rejected.paused_left == 8  # twice as long after a relapse
    unpaid = SessionControl()
    steps = [ctl.session_step(unpaid, offered=4, verified=0, alpha=0.5, judged=True) for _ in range(3)]
    assert steps == [False, False, True]
    no_chain = SessionControl()  # steps without a chain say nothing
    assert not any(ctl.session_step(no_chain, offered=0, verified=0, alpha=0.5, judged=True)
                   for _ in range(9))


# ---- the engine ----------------------------------------------------------------------------------
class OracleDraft:
    """A Pausable source that offers the right continuation (``reference``: the greedy output),
    ``chain`` tokens a step, and spends ``cost_s`` per step while drafting (a draft sharing the
    target's compute). ``junk``: offer wrong tokens instead."""

    def __init__(self, reference: Sequence[int], chain: int, cost_s: float, junk: bool = False) -> None:
        self.reference, self.chain, self.cost_s, self.junk = list(reference), chain, cost_s, junk
        self.paused = False
        self.drafted = self.steps = self.pauses = self.resumes = 0
        self.opened_paused: bool | None = None

    def open(self, committed: Sequence[int]) -> None:
        self.committed, self.prompt = committed, len(committed)
        self.opened_paused = self.paused

    def pause_drafting(self) -> None:
        self.paused, self.pauses = True, self.pauses + 1

    def resume_drafting(self) -> None:
        self.paused, self.resumes = False, self.resumes + 1

    def step(self, correction: Correction) -> StepResult:
        self.steps += 1
        if self.paused:
            return StepResult(Chain(epoch=correction.epoch + 1))
        self.drafted += 1
        time.sleep(self.cost_s)
        at = len(self.committed) - self.prompt
        tokens = self.reference[at:at + self.chain]
        if self.junk:
            tokens = [(t + 1) % 97 for t in tokens]
        return StepResult(Chain(tuple(tokens), tuple(range(len(tokens))), correction.epoch + 1))

    def close(self, stats: GenerationStats) -> SourceStats:
        return SourceStats()


PROMPT = [5, 17, 3, 9, 30, 2]


def _reference(n: int) -> list[int]:
    return generate(target_model("llama"), NoDraft(), PROMPT, max_new_tokens=n).tokens


def _card(source: OracleDraft, n: int, controller: SpeculationController) -> GenerationResult:
    model = target_model("llama")
    request = GenerationRequest(tuple(PROMPT), SamplingParams(),
                                StopParams(max_new_tokens=n, ignore_eos=True))
    gen = Generation(request, source, eos_ids=frozenset(), decode=letters, context_window=512, mode="card",
                     vocab_size=model.config.vocab_size)
    list(run_alone(model, gen, controller=controller))
    assert gen.result is not None
    return gen.result


def test_oracle_draft_is_pausable() -> None:
    assert isinstance(OracleDraft([], 1, 0.0), Pausable) and not isinstance(NoDraft(), Pausable)


def test_a_draft_that_slows_the_target_is_paused_and_the_output_stays_exact() -> None:
    n = 240
    reference = _reference(n)
    slow = OracleDraft(reference, chain=3, cost_s=0.03)  # 4 tokens per 30+ ms; plain: 1 per few ms
    result = _card(slow, n, SpeculationController())
    assert result.token_ids == reference
    stats = result.stats
    assert stats.speculation == "auto" and stats.drafting_pauses >= 1
    assert stats.drafting_paused_steps > stats.target_forwards // 2
    # paused means the draft stopped working, not only that its chains were ignored
    assert slow.drafted < slow.steps // 2 and slow.pauses >= 1


def test_a_draft_that_pays_keeps_drafting() -> None:
    """Negative control of the test above: a free draft whose chains are all accepted."""
    n = 240
    reference = _reference(n)
    free = OracleDraft(reference, chain=4, cost_s=0.0)
    result = _card(free, n, SpeculationController())
    assert result.token_ids == reference
    assert free.drafted > free.steps * 0.6
    assert result.stats.mean_accepted_length > 2.5


def test_a_draft_whose_chains_are_all_rejected_is_paused_for_that_generation() -> None:
    n = 120
    reference = _reference(n)
    junk = OracleDraft(reference, chain=4, cost_s=0.0, junk=True)
    result = _card(junk, n, SpeculationController(SpeculationControl(mode="auto", first_hold=10_000)))
    assert result.token_ids == reference
    assert result.stats.drafting_pauses >= 2  # paused, resumed, paused again for longer
    assert junk.drafted < junk.steps // 2


def test_never_opens_every_draft_paused_and_always_never_pauses() -> None:
    n = 60
    reference = _reference(n)
    off = OracleDraft(reference, chain=3, cost_s=0.0)
    result = _card(off, n, SpeculationController(SpeculationControl(mode="never")))
    assert result.token_ids == reference and off.opened_paused and off.drafted == 0
    stats = result.stats
    assert stats.speculation == "never" and stats.drafting_paused_steps == stats.target_forwards - 1
    on = OracleDraft(reference, chain=3, cost_s=0.01)
    result = _card(on, n, SpeculationController(SpeculationControl(mode="always")))
    assert result.token_ids == reference and on.pauses == 0 and on.drafted == on.steps


def test_speculation_is_measured_once_the_drafts_offer_chains() -> None:
    """Drafts that (re)start from the text offer nothing for a while: those iterations are not
    speculation's rate; after ``warm_cap`` of them it is measured anyway."""
    ctl = SpeculationController(SpeculationControl(warm_cap=5))
    for _ in range(4):
        ctl.observe(4, 4, 0.1, clean=True, warm=False)
    assert 4 not in ctl.rates[Regime.SPEC]
    ctl.observe(4, 9, 0.1, clean=True, warm=True)
    assert ctl.rates[Regime.SPEC][4].n == 1
    cold = SpeculationController(SpeculationControl(warm_cap=3))
    for _ in range(5):
        cold.observe(4, 4, 0.1, clean=True, warm=False)
    assert cold.rates[Regime.SPEC][4].n == 2  # the cap: a draft that never delivers is judged too
