"""DrafterChoice (card-auto) on a hand clock: it opens model-free, tries the neural drafter, keeps
whichever commits faster, tries the loser again later, and never times a step no drafter served."""

from __future__ import annotations

from card.engine.target.drafter_choice import MODEL_FREE, NEURAL, RETRY_STEPS, TRIAL_STEPS, DrafterChoice


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(choice: DrafterChoice, clock: Clock, steps: int, s_per_step: dict[str, float],
         tokens: dict[str, int]) -> list[str]:
    """Steps at each drafter's pace; returns the drafters switched to, in order."""
    switched = []
    for _ in range(steps):
        clock.now += s_per_step[choice.current]
        to = choice.step(tokens[choice.current])
        if to is not None:
            switched.append(to)
    return switched


def test_the_faster_drafter_is_kept_and_the_loser_tried_again_later() -> None:
    clock = Clock()
    choice = DrafterChoice(clock)
    assert choice.current == MODEL_FREE
    # neural commits 3 tokens a step, model-free 1, both at the same step time: neural wins
    same_time, neural_more = {MODEL_FREE: 0.1, NEURAL: 0.1}, {MODEL_FREE: 1, NEURAL: 3}
    switched = _run(choice, clock, 2 * TRIAL_STEPS, same_time, neural_more)
    assert switched == [NEURAL] and choice.current == NEURAL
    # the winner holds RETRY_STEPS[0] steps, then model-free is tried again and loses again
    switched = _run(choice, clock, RETRY_STEPS[0] + TRIAL_STEPS, {MODEL_FREE: 0.1, NEURAL: 0.1},
                    {MODEL_FREE: 1, NEURAL: 3})
    assert switched == [MODEL_FREE, NEURAL] and choice.current == NEURAL


def test_a_neural_draft_that_slows_the_target_loses_to_the_model_free_one() -> None:
    """The same tokens a step, but the draft's forwards make each step twice as long (shared
    cores): model-free is kept."""
    clock = Clock()
    choice = DrafterChoice(clock)
    switched = _run(choice, clock, 2 * TRIAL_STEPS + 1, {MODEL_FREE: 0.1, NEURAL: 0.2},
                    {MODEL_FREE: 2, NEURAL: 2})
    assert switched == [NEURAL, MODEL_FREE] and choice.current == MODEL_FREE


def test_untimed_steps_do_not_count() -> None:
    clock = Clock()
    choice = DrafterChoice(clock)
    choice.step(1)
    clock.now += 100.0  # a pause the engine imposed: no drafter's pace
    choice.untimed()
    choice.step(1)
    clock.now += 0.1
    choice.step(1)
    assert choice.pace[MODEL_FREE].s_per_token < 1.0
