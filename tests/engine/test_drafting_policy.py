"""The drafting policy (card.engine.target.drafting_policy), the one owner of whether and with what
a generation drafts: the engine-wide regime by measured throughput, each generation's pause (its
acceptance, its pace), and card-auto's choice of drafter.

Unit tests drive the policy with made-up iterations on a hand clock, so every decision is exact;
the engine tests run a tiny model with a draft whose cost is known (it sleeps while it drafts), so
which regime pays is not in doubt.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence

import pytest

from card.engine.draft.worker import DraftWorker
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams, TreeParams
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.session import StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Chain, Correction, Outcome
from card.engine.target.chain_source import DraftKind, NoDraft, SourceStats
from card.engine.target.drafting_policy import (
    DraftingConfig,
    DraftingPolicy,
    Pace,
    Regime,
    Stepped,
)
from card.engine.target.generation import Generation, GenerationResult
from card.engine.target.scheduler import run_alone
from tests.engine.support import LockstepCard, generate, letters, target_model, wait_until

CONTROL = DraftingConfig(first_hold=4, hold=(4, 32), settle=(1, 1), judge=4)
LOOKUP, WORKER = DraftKind.LOOKUP, DraftKind.WORKER
PACE = DraftingConfig(speculation="always", pace_rule=True)  # the pace rule alone
JUDGE, BACKOFF = PACE.judge_steps, PACE.session_pause
TRIAL, RETRY = PACE.trial_steps, PACE.retry_steps


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Told(NoDraft):
    """A source offering ``drafters``; it keeps what the policy told it, in order."""

    def __init__(self, drafters: tuple[DraftKind, ...]) -> None:
        self.drafters = drafters
        self.told: list[DraftKind | None] = []

    def draft_with(self, kind: DraftKind | None) -> None:
        self.told.append(kind)


def _gen(source: object) -> Generation:
    request = GenerationRequest((1, 2, 3), SamplingParams(), StopParams(max_new_tokens=8))
    return Generation(request, source, eos_ids=frozenset(), decode=letters,  # type: ignore[arg-type]
                      context_window=512, mode="card")


def admitted(config: DraftingConfig, drafters: tuple[DraftKind, ...] = (WORKER,)
             ) -> tuple[DraftingPolicy, Clock, Generation]:
    clock = Clock()
    policy = DraftingPolicy(config, clock=clock)
    gen = _gen(Told(drafters))
    policy.admit(gen)
    return policy, clock, gen


def drive(policy: DraftingPolicy, clock: Clock, gen: Generation, seconds: float, committed: int,
          outcome: Outcome | None = Outcome.HIT, offered: int = 4, verified: int | None = None
          ) -> DraftKind | None:
    """One engine iteration of ``gen`` (steer, ``seconds`` of work, observe); what it drafts with
    in the next one."""
    policy.steer([gen])
    clock.now += seconds
    verified = offered if verified is None else verified
    policy.observe([Stepped(gen, offered, verified, committed, outcome)], seconds, clean=True)
    d = policy.drafting(gen)
    assert d is not None
    return policy.wanted(d)


def _state(policy: DraftingPolicy, gen: Generation):
    d = policy.drafting(gen)
    assert d is not None
    return d


# ---- the engine's regime --------------------------------------------------------------------------
def _run(policy: DraftingPolicy, iterations: int, spec: tuple[int, float], plain: tuple[int, float],
         batch: int = 4) -> list[Regime]:
    """Feed ``iterations``: (tokens, seconds) per iteration of each regime; the regimes seen."""
    seen = []
    for _ in range(iterations):
        tokens, seconds = spec if policy.speculating else plain
        seen.append(policy.regime)
        policy.tick(batch, tokens, seconds, clean=True)
    return seen


def test_speculation_that_costs_more_than_it_returns_is_turned_off_and_probed_ever_less() -> None:
    decisions, probes = [], []

    def decided(d) -> None:
        decisions.append(d)
        if d.why == "probe" and d.regime is Regime.SPEC:
            probes.append(policy.iteration)

    policy = DraftingPolicy(CONTROL, on_decision=decided)
    # speculating: 6 tokens in 0.1 s (60 tok/s); plain: 4 tokens in 0.05 s (80 tok/s)
    seen = _run(policy, 400, spec=(6, 0.1), plain=(4, 0.05))
    assert policy.regime is Regime.PLAIN
    assert seen[-100:].count(Regime.SPEC) < 20  # probes only, rarer and rarer
    lost = [d for d in decisions if d.why == "lost" and d.regime is Regime.PLAIN]
    assert lost and lost[-1].plain_rate == pytest.approx(80) and lost[-1].spec_rate == pytest.approx(60)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # holds grow


def test_speculation_that_pays_holds_and_plain_is_probed_ever_less() -> None:
    policy = DraftingPolicy(CONTROL)
    seen = _run(policy, 400, spec=(10, 0.1), plain=(4, 0.05))
    assert policy.regime is Regime.SPEC
    # probes of plain decoding only, each settle + judge long, once per longest hold at most
    probe = CONTROL.judge + CONTROL.settle[0]
    assert seen[-200:].count(Regime.PLAIN) <= (200 // CONTROL.hold[1] + 1) * probe
    assert seen[:100].count(Regime.PLAIN) > seen[-100:].count(Regime.PLAIN)


def test_the_regime_follows_a_change_of_load() -> None:
    policy = DraftingPolicy(CONTROL)
    _run(policy, 200, spec=(10, 0.1), plain=(4, 0.05), batch=1)
    assert policy.regime is Regime.SPEC
    # a heavier load: at batch 8 speculation no longer pays; batch 8 was never measured plain, so
    # the policy measures it before it judges
    _run(policy, 400, spec=(12, 0.2), plain=(8, 0.06), batch=8)
    assert policy.regime is Regime.PLAIN and policy.rate(Regime.PLAIN, 8) == pytest.approx(8 / 0.06)


def test_always_and_never_do_not_switch() -> None:
    for mode, regime in (("always", Regime.SPEC), ("never", Regime.PLAIN)):
        policy = DraftingPolicy(DraftingConfig(speculation=mode))
        seen = _run(policy, 300, spec=(6, 0.1), plain=(4, 0.01) if mode == "always" else (4, 1.0))
        assert set(seen) == {regime} and policy.switches == 0
    with pytest.raises(InvalidArgument, match="speculation must be one of"):
        DraftingConfig(speculation="sometimes")


def test_iterations_with_a_prefill_are_not_measured() -> None:
    policy = DraftingPolicy(CONTROL)
    for _ in range(100):  # prefill-laden plain iterations look slow: they must not count
        policy.tick(4, 6 if policy.speculating else 4, 0.1 if policy.speculating else 5.0,
                    clean=policy.speculating)
    assert 4 not in policy.rates[Regime.PLAIN]


def test_speculation_is_measured_once_the_drafts_offer_chains() -> None:
    """Drafts that (re)start from the text offer nothing for a while: those iterations are not
    speculation's rate; after ``warm_cap`` of them it is measured anyway."""
    policy = DraftingPolicy(DraftingConfig(warm_cap=5))
    for _ in range(4):
        policy.tick(4, 4, 0.1, clean=True, warm=False)
    assert 4 not in policy.rates[Regime.SPEC]
    policy.tick(4, 9, 0.1, clean=True, warm=True)
    assert policy.rates[Regime.SPEC][4].n == 1
    cold = DraftingPolicy(DraftingConfig(warm_cap=3))
    for _ in range(5):
        cold.tick(4, 4, 0.1, clean=True, warm=False)
    assert cold.rates[Regime.SPEC][4].n == 2  # the cap: a draft that never delivers is judged too


def test_a_plain_regime_stops_every_draft_and_a_generation_opens_so() -> None:
    policy, _, gen = admitted(DraftingConfig(speculation="never"))
    assert gen.source.told == [None] and gen.stats.drafting_pauses == 1  # type: ignore[attr-defined]
    assert gen.stats.speculation == "never" and policy.paused() == 1
    untold = _gen(NoDraft())
    policy.admit(untold)
    policy.steer([untold])
    assert not policy.stopped(untold) and policy.paused() == 1  # a source that cannot draft is not steered


# ---- a generation's acceptance --------------------------------------------------------------------
def test_a_generation_whose_chains_are_rejected_or_never_verified_pauses_its_draft() -> None:
    config = DraftingConfig(min_alpha=0.12, unpaid_steps=3, session_pause=(4, 16), first_hold=10_000)
    policy, clock, rejected = admitted(config)
    # every chain rejected: too soon to judge for 4 chains, then its acceptance is below min_alpha
    assert [drive(policy, clock, rejected, 0.1, 1) for _ in range(5)] == [WORKER] * 4 + [None]
    assert _state(policy, rejected).paused_left == 4
    assert [drive(policy, clock, rejected, 0.1, 1, offered=0) for _ in range(4)] == [None] * 3 + [WORKER]
    assert [drive(policy, clock, rejected, 0.1, 1) for _ in range(5)] == [WORKER] * 4 + [None]
    assert _state(policy, rejected).paused_left == 8  # twice as long after a relapse
    policy.steer([rejected])
    assert rejected.stats.drafting_pauses == 2 and rejected.stats.drafting_paused_steps == 4
    assert rejected.source.told == [WORKER, None, WORKER, None]  # type: ignore[attr-defined]
    # offered and all accepted, but the cost cut verified none of them for unpaid_steps steps
    policy, clock, unpaid = admitted(config)
    steps = [drive(policy, clock, unpaid, 0.1, 1, offered=4, verified=0) for _ in range(3)]
    assert steps == [WORKER, WORKER, None]
    policy, clock, no_chain = admitted(config)  # steps without a chain say nothing
    assert all(drive(policy, clock, no_chain, 0.1, 1, offered=0) is WORKER for _ in range(9))
    assert policy.session_pauses == 0


# ---- a generation's pace (in process) -------------------------------------------------------------
def calibrated(alone_s: float = 0.15, steps: int = 4, offered: int = 4
               ) -> tuple[DraftingPolicy, Clock, Generation]:
    policy, clock, gen = admitted(DraftingConfig(speculation="always", pace_rule=True, calibration=steps))
    assert gen.source.told == [None]  # type: ignore[attr-defined]  # calibration first: the draft starts late
    kinds = [drive(policy, clock, gen, alone_s, 1, offered=offered) for _ in range(steps)]
    assert kinds == [None] * (steps - 1) + [WORKER]
    assert _state(policy, gen).alone.steps == steps - 1  # the first interval held the prefill
    return policy, clock, gen


def test_pace_is_a_running_mean_then_a_moving_average() -> None:
    pace = Pace()
    for s in (1.0, 2.0, 3.0):
        pace.add(s, 1)
    assert pace.seconds == 2.0 and pace.s_per_token == 2.0
    assert Pace().s_per_token == float("inf")


def test_without_calibration_drafting_starts_at_once() -> None:
    _, _, gen = admitted(PACE)
    assert gen.source.told == [WORKER]  # type: ignore[attr-defined]
    _, _, model_free = admitted(DraftingConfig(pace_rule=True, calibration=4), (LOOKUP,))
    assert model_free.source.told == [LOOKUP]  # type: ignore[attr-defined]  # costs nothing: no calibration


def test_a_draft_that_makes_the_target_faster_is_never_paused() -> None:
    policy, clock, gen = calibrated(alone_s=0.15)
    for i in range(200):  # 0.27 s per forward for 2.5 tokens: 0.108 s/token against 0.15 alone
        assert drive(policy, clock, gen, 0.27, 2 + i % 2)
    assert _state(policy, gen).pauses == 0


def test_a_draft_that_makes_the_target_slower_is_paused_after_judge_steps() -> None:
    policy, clock, gen = calibrated(alone_s=0.15)
    for i in range(JUDGE - 1):  # 0.28 s for 1.5 tokens: 0.187 s/token, slower than alone
        assert drive(policy, clock, gen, 0.28, 1 + i % 2), "judged before judge_steps drafting steps"
    assert not drive(policy, clock, gen, 0.28, 2)
    assert _state(policy, gen).pauses == 1
    for _ in range(BACKOFF[0] - 1):
        assert not drive(policy, clock, gen, 0.15, 1)
    assert drive(policy, clock, gen, 0.15, 1), "probe after the first pause"
    for i in range(JUDGE):
        drive(policy, clock, gen, 0.28, 1 + i % 2)
    # the probe failed: the next pause is twice as long
    assert _state(policy, gen).pauses == 2 and _state(policy, gen).paused_left
    paused = 0
    while not drive(policy, clock, gen, 0.15, 1):
        paused += 1
    assert paused == 2 * BACKOFF[0] - 1


def test_misses_pause_the_draft_even_before_its_pace_is_judged() -> None:
    policy, clock, gen = calibrated()
    drafting = [drive(policy, clock, gen, 0.2, 1, Outcome.MISS) for _ in range(6)]
    assert drafting == [WORKER] * 5 + [None] and _state(policy, gen).pauses == 1


def test_undelivered_misses_do_not_count() -> None:
    """A verdict after a step that verified no chain (the draft had delivered nothing) is none."""
    policy, clock, gen = calibrated(offered=0)
    for _ in range(20):
        assert drive(policy, clock, gen, 0.1, 1, Outcome.MISS, offered=0)
    assert _state(policy, gen).useful == 0.5


def test_a_chain_accepted_to_its_tier_b_end_is_not_held_against_the_draft() -> None:
    """The tree calls it a miss (the next token has no node), but every drafted token was right."""
    policy, clock, gen = calibrated()
    for _ in range(30):
        assert drive(policy, clock, gen, 0.1, 5, Outcome.MISS)
    assert _state(policy, gen).pauses == 0


def test_a_probe_is_judged_on_fewer_misses_than_a_new_session() -> None:
    policy, clock, gen = admitted(PACE)
    drive(policy, clock, gen, 0.2, 1, None)  # the step after the prefill judges no chain
    steps = 0
    while drive(policy, clock, gen, 0.2, 1, Outcome.MISS):
        steps += 1
    assert steps == 5  # the 6th miss paused it
    while not drive(policy, clock, gen, 0.2, 1):
        pass
    probe = 0
    while drive(policy, clock, gen, 0.2, 1, Outcome.MISS):
        probe += 1
    assert probe == 3  # the 4th miss paused the probe
    assert _state(policy, gen).pauses == 2


def test_without_an_alone_pace_the_pace_rule_is_off() -> None:
    policy, clock, gen = admitted(PACE)
    for _ in range(50):  # very slow, but useful: nothing to compare with, keep drafting
        assert drive(policy, clock, gen, 5.0, 1)


def test_without_the_pace_rule_a_draft_drafts_throughout() -> None:
    policy, clock, gen = admitted(DraftingConfig(speculation="always", calibration=4))
    assert gen.source.told == [WORKER]  # type: ignore[attr-defined]  # no calibration
    for _ in range(50):
        assert drive(policy, clock, gen, 1.0, 1, Outcome.MISS)
    assert _state(policy, gen).pauses == 0


# ---- card-auto: the drafter chosen by pace --------------------------------------------------------
def _choose(policy: DraftingPolicy, clock: Clock, gen: Generation, steps: int,
            s_per_step: dict[DraftKind, float], tokens: dict[DraftKind, int]) -> None:
    """Steps at each drafter's pace."""
    for _ in range(steps):
        policy.steer([gen])
        kind = _state(policy, gen).told
        assert kind is not None
        clock.now += s_per_step[kind]
        policy.observe([Stepped(gen, 4, 4, tokens[kind], Outcome.HIT)], s_per_step[kind], clean=True)


def _auto() -> tuple[DraftingPolicy, Clock, Generation, list[DraftKind]]:
    switched: list[DraftKind] = []
    clock = Clock()
    policy = DraftingPolicy(DraftingConfig(speculation="always"), on_switch=switched.append, clock=clock)
    gen = _gen(Told((LOOKUP, WORKER)))
    policy.admit(gen)
    return policy, clock, gen, switched


def test_the_faster_drafter_is_kept_and_the_loser_tried_again_later() -> None:
    policy, clock, gen, switched = _auto()
    assert gen.source.told == [LOOKUP]  # type: ignore[attr-defined]  # it opens model-free
    # the worker commits 3 tokens a step, the lookup 1, both at the same step time: the worker wins
    same_time, worker_more = {LOOKUP: 0.1, WORKER: 0.1}, {LOOKUP: 1, WORKER: 3}
    _choose(policy, clock, gen, 2 * TRIAL, same_time, worker_more)
    assert switched == [WORKER] and _state(policy, gen).current is WORKER
    # the winner holds RETRY[0] steps, then the lookup is tried again and loses again
    _choose(policy, clock, gen, RETRY[0] + TRIAL, same_time, worker_more)
    assert switched == [WORKER, LOOKUP, WORKER] and _state(policy, gen).current is WORKER
    policy.steer([gen])
    assert gen.source.told == [LOOKUP, WORKER, LOOKUP, WORKER]  # type: ignore[attr-defined]


def test_a_worker_that_slows_the_target_loses_to_the_lookup() -> None:
    """The same tokens a step, but the draft's forwards make each step twice as long (shared
    cores): the lookup is kept."""
    policy, clock, gen, switched = _auto()
    _choose(policy, clock, gen, 2 * TRIAL + 1, {LOOKUP: 0.1, WORKER: 0.2}, {LOOKUP: 2, WORKER: 2})
    assert switched == [WORKER, LOOKUP] and _state(policy, gen).current is LOOKUP


def test_steps_no_drafter_served_do_not_count() -> None:
    policy, clock, gen, _ = _auto()
    _choose(policy, clock, gen, 1, {LOOKUP: 0.1, WORKER: 0.1}, {LOOKUP: 1, WORKER: 1})
    _state(policy, gen).paused_left = 1  # the engine stopped its drafting for a step
    assert drive(policy, clock, gen, 100.0, 1) is LOOKUP
    _choose(policy, clock, gen, 1, {LOOKUP: 0.1, WORKER: 0.1}, {LOOKUP: 1, WORKER: 1})
    assert _state(policy, gen).paced[LOOKUP].s_per_token < 1.0


# ---- the engine ----------------------------------------------------------------------------------
class OracleDraft:
    """A source that offers the right continuation (``reference``: the greedy output), ``chain``
    tokens a step, and spends ``cost_s`` per step while drafting (a draft sharing the target's
    compute). ``junk``: offer wrong tokens instead."""

    drafters = (WORKER,)

    def __init__(self, reference: Sequence[int], chain: int, cost_s: float, junk: bool = False) -> None:
        self.reference, self.chain, self.cost_s, self.junk = list(reference), chain, cost_s, junk
        self.paused = False
        self.drafted = self.steps = self.pauses = 0
        self.opened_paused: bool | None = None

    def open(self, committed: Sequence[int]) -> None:
        self.committed, self.prompt = committed, len(committed)
        self.opened_paused = self.paused

    def draft_with(self, kind: DraftKind | None) -> None:
        self.pauses += kind is None
        self.paused = kind is None

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


def _card(source: object, n: int, policy: DraftingPolicy) -> GenerationResult:
    model = target_model("llama")
    request = GenerationRequest(tuple(PROMPT), SamplingParams(),
                                StopParams(max_new_tokens=n, ignore_eos=True))
    gen = Generation(request, source, eos_ids=frozenset(), decode=letters,  # type: ignore[arg-type]
                     context_window=512, mode="card", vocab_size=model.config.vocab_size)
    list(run_alone(model, gen, policy=policy))
    assert gen.result is not None
    return gen.result


def test_a_draft_that_slows_the_target_is_paused_and_the_output_stays_exact() -> None:
    n = 240
    reference = _reference(n)
    slow = OracleDraft(reference, chain=3, cost_s=0.03)  # 4 tokens per 30+ ms; plain: 1 per few ms
    result = _card(slow, n, DraftingPolicy())
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
    result = _card(free, n, DraftingPolicy())
    assert result.token_ids == reference
    assert free.drafted > free.steps * 0.6
    assert result.stats.mean_accepted_length > 2.5


def test_a_draft_whose_chains_are_all_rejected_is_paused_for_that_generation() -> None:
    n = 120
    reference = _reference(n)
    junk = OracleDraft(reference, chain=4, cost_s=0.0, junk=True)
    result = _card(junk, n, DraftingPolicy(DraftingConfig(first_hold=10_000)))
    assert result.token_ids == reference
    assert result.stats.drafting_pauses >= 2  # paused, resumed, paused again for longer
    assert junk.drafted < junk.steps // 2


def test_never_opens_every_draft_paused_and_always_never_pauses() -> None:
    n = 60
    reference = _reference(n)
    off = OracleDraft(reference, chain=3, cost_s=0.0)
    result = _card(off, n, DraftingPolicy(DraftingConfig(speculation="never")))
    assert result.token_ids == reference and off.opened_paused and off.drafted == 0
    stats = result.stats
    assert stats.speculation == "never" and stats.drafting_paused_steps == stats.target_forwards - 1
    on = OracleDraft(reference, chain=3, cost_s=0.01)
    result = _card(on, n, DraftingPolicy(DraftingConfig(speculation="always")))
    assert result.token_ids == reference and on.pauses == 0 and on.drafted == on.steps


def test_calibration_steps_decode_alone_then_the_draft_starts_and_output_is_unchanged() -> None:
    model = target_model("llama")
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3)
    prompt, budget = [3, 14, 15, 92, 65], 40
    want = generate(model, NoDraft(), prompt, max_new_tokens=budget).tokens
    # lockstep once drafting: each step waits for a layer, so the draft runs whatever the load
    card = LockstepCard(None, params, depth=1)
    card.worker = worker = DraftWorker(model, params, card.publish, slots=8, max_len=512, name="test")
    started: list[int] = []  # committed length at each draft session start
    start_session = worker.start_session
    worker.start_session = lambda sid, ids, epoch, draw=None: (started.append(len(ids)),  # type: ignore[method-assign]
                                                               start_session(sid, ids, epoch, draw))
    worker.start()
    policy = DraftingPolicy(DraftingConfig(speculation="always", pace_rule=True, calibration=4))
    with contextlib.ExitStack() as stack:
        stack.callback(worker.close)
        run = generate(model, card, prompt, max_new_tokens=budget, policy=policy)
        assert run.tokens == want
        assert run.result.stats.accepted_lengths[:5] == [1] * 5  # prefill + 4 plain steps: no chains
        assert started[0] == len(prompt) + 4  # from the text the session holds after the 4th step
        assert run.result.stats.draft_forwards > 0  # then the draft ran
        assert wait_until(lambda: worker.active_sessions == 0)
