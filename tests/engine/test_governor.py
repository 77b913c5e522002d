"""engine.inprocess.governor: when in-process card drafts and when the target decodes alone. Driven with a
fake clock: each step's duration and token count are given, so every decision is exact."""

from __future__ import annotations

from card.engine.inprocess.governor import BACKOFF_STEPS, JUDGE_STEPS, Governor, Pace
from card.engine.shared.tree import Outcome


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(gov: Governor, clock: Clock, seconds: float, tokens: int,
          outcome: Outcome = Outcome.HIT) -> bool:
    """One step as LocalCard takes it; returns whether the draft was running after it."""
    clock.now += seconds
    gov.timed(tokens)
    if gov.drafting:
        gov.keep(outcome, delivered=True)
    else:
        gov.resume()
    return gov.drafting


def calibrated(alone_s: float = 0.15, steps: int = 4) -> tuple[Governor, Clock]:
    clock = Clock()
    gov = Governor(calibration_steps=steps, clock=clock)
    assert gov.open() is False  # calibration first: the draft starts late
    for _ in range(steps):
        drive(gov, clock, alone_s, 1)
    assert gov.drafting and gov.alone.steps == steps - 1  # the first interval held the prefill
    return gov, clock


def test_pace_is_a_running_mean_then_a_moving_average() -> None:
    pace = Pace()
    for s in (1.0, 2.0, 3.0):
        pace.add(s, 1)
    assert pace.seconds == 2.0 and pace.s_per_token == 2.0
    assert Pace().s_per_token == float("inf")


def test_without_calibration_drafting_starts_at_once() -> None:
    gov = Governor(calibration_steps=0, clock=Clock())
    assert gov.open() is True and gov.drafting


def test_a_draft_that_makes_the_target_faster_is_never_paused() -> None:
    gov, clock = calibrated(alone_s=0.15)
    for i in range(200):  # 0.27 s per forward for 2.5 tokens: 0.108 s/token against 0.15 alone
        assert drive(gov, clock, 0.27, 2 + i % 2)
    assert gov.backoffs == 0


def test_a_draft_that_makes_the_target_slower_is_paused_after_judge_steps() -> None:
    gov, clock = calibrated(alone_s=0.15)
    for i in range(JUDGE_STEPS - 1):  # 0.28 s for 1.5 tokens: 0.187 s/token, slower than alone
        assert drive(gov, clock, 0.28, 1 + i % 2), "judged before JUDGE_STEPS drafting steps"
    assert not drive(gov, clock, 0.28, 2)
    assert gov.backoffs == 1
    for _ in range(BACKOFF_STEPS[0] - 1):
        assert not drive(gov, clock, 0.15, 1)
    assert drive(gov, clock, 0.15, 1), "probe after the first pause"
    for i in range(JUDGE_STEPS):
        drive(gov, clock, 0.28, 1 + i % 2)
    assert gov.backoffs == 2 and not gov.drafting  # the probe failed: the next pause is 32 steps
    paused = 0
    while not drive(gov, clock, 0.15, 1):
        paused += 1
    assert paused == 2 * BACKOFF_STEPS[0] - 1


def test_misses_pause_the_draft_even_before_its_pace_is_judged() -> None:
    gov, clock = calibrated()
    drafting = [drive(gov, clock, 0.2, 1, Outcome.MISS) for _ in range(6)]
    assert drafting == [True] * 5 + [False] and gov.backoffs == 1


def test_undelivered_misses_do_not_count() -> None:
    gov, clock = calibrated()
    for _ in range(20):
        clock.now += 0.1
        gov.timed(1)
        assert gov.keep(Outcome.MISS, delivered=False)
    assert gov.useful == 0.5


def test_a_chain_accepted_to_its_tier_b_end_is_not_held_against_the_draft() -> None:
    """The tree calls it a miss (the next token has no node), but every drafted token was right."""
    gov, clock = calibrated()
    for _ in range(30):
        clock.now += 0.1
        gov.timed(5)
        assert gov.keep(Outcome.MISS, delivered=True, accepted=4)
    assert gov.backoffs == 0


def test_a_probe_is_judged_on_fewer_misses_than_a_new_session() -> None:
    clock = Clock()
    gov = Governor(calibration_steps=0, clock=clock)
    gov.open()
    steps = 0
    while drive(gov, clock, 0.2, 1, Outcome.MISS):
        steps += 1
    assert steps == 5  # the 6th miss paused it
    while not drive(gov, clock, 0.2, 1):
        pass
    probe = 0
    while drive(gov, clock, 0.2, 1, Outcome.MISS):
        probe += 1
    assert probe == 3  # the 4th miss paused the probe
    assert gov.backoffs == 2


def test_without_an_alone_pace_the_pace_rule_is_off() -> None:
    clock = Clock()
    gov = Governor(calibration_steps=0, clock=clock)
    gov.open()
    for _ in range(50):  # very slow, but useful: nothing to compare with, keep drafting
        assert drive(gov, clock, 5.0, 1)


def test_a_disabled_governor_drafts_throughout() -> None:
    clock = Clock()
    gov = Governor(calibration_steps=4, clock=clock, enabled=False)
    assert gov.open() is True  # no calibration
    for _ in range(50):
        assert drive(gov, clock, 1.0, 1, Outcome.MISS)
    assert gov.backoffs == 0


# ---- in LocalCard --------------------------------------------------------------------------------
def test_calibration_steps_decode_alone_then_the_draft_starts_and_output_is_unchanged() -> None:
    import contextlib

    from card.engine.draft.worker import DraftWorker
    from card.engine.inprocess.sources import LocalCard
    from card.engine.shared.config import TreeParams
    from card.engine.target.chain_source import NoDraft
    from tests.engine.support import generate, target_model, wait_until

    model = target_model("llama")
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3)
    prompt, budget = [3, 14, 15, 92, 65], 40
    want = generate(model, NoDraft(), prompt, max_new_tokens=budget).tokens
    card = LocalCard(None, params, calibration_steps=4)
    card.worker = worker = DraftWorker(model, params, card.publish, slots=8, max_len=512, name="test")
    started: list[int] = []  # committed length at each draft session start
    start_session = worker.start_session
    worker.start_session = lambda sid, ids, epoch, draw=None: (started.append(len(ids)),
                                                               start_session(sid, ids, epoch, draw))
    worker.start()
    with contextlib.ExitStack() as stack:
        stack.callback(worker.close)
        run = generate(model, card, prompt, max_new_tokens=budget)
        assert run.tokens == want
        assert run.result.stats.accepted_lengths[:5] == [1] * 5  # prefill + 4 plain steps: no chains
        assert started[0] == len(prompt) + 4  # from the committed text, at the 4th step
        assert run.result.stats.draft_forwards > 0  # then the draft ran
        assert wait_until(lambda: worker.active_sessions == 0)
