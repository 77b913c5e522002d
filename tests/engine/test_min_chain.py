"""The in-process chain policy ``TreeParams.min_chain``: the target waits for a short chain while
the draft grows it, bounded in time, and the output is unchanged."""

from __future__ import annotations

import time

import pytest

from engine.config import TreeParams
from engine.errors import InvalidArgument
from engine.sources import LocalCard, NoDraft
from engine.tree import Correction
from engine.worker import DraftWorker
from tests.engine.support import card_source, generate, prompt_cases, target_model


@pytest.mark.parametrize("min_chain", [0, 2])
def test_with_a_self_draft_every_step_verifies_at_least_min_chain_tokens(min_chain: int) -> None:
    """A self-draft's chains are always accepted, so tokens per step = chain length + 1."""
    model = target_model("llama")
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3, min_chain=min_chain,
                        min_chain_wait_s=30.0)
    short_steps = 0
    for prompt, budget in prompt_cases(6, seed=5, max_new=40):
        want = generate(model, NoDraft(), prompt, max_new_tokens=budget).tokens
        with card_source(model, params) as card:
            run = generate(model, card, prompt, max_new_tokens=budget)
        assert run.tokens == want
        steps = run.result.stats.accepted_lengths[1:-1]  # not the prefill, not the budget-cut last
        short_steps += sum(n < 3 for n in steps)
    if min_chain:
        assert short_steps == 0
    else:  # the draft costs what the target costs: without waiting, some chains are short
        assert short_steps > 0


def test_the_wait_is_bounded_when_the_draft_cannot_deliver() -> None:
    params = TreeParams(width=1, max_depth=4, max_chain=3, min_chain=2, min_chain_wait_s=0.2)
    card = LocalCard(None, params)
    card.worker = DraftWorker(target_model("llama"), params, card.publish)  # never started
    card.open([1, 2, 3])
    t0 = time.monotonic()
    step = card.step(Correction(0, (), (), 7))
    assert len(step.chain) == 0 and time.monotonic() - t0 >= 0.2


def test_min_chain_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="min_chain"):
        TreeParams(max_chain=2, min_chain=3)
    with pytest.raises(InvalidArgument, match="min_chain_wait_s"):
        TreeParams(min_chain_wait_s=float("inf"))


def test_no_waiting_for_a_draft_that_is_always_wrong() -> None:
    """An unrelated draft's first tokens are rejected: after a few steps the target stops waiting."""
    target, wrong = target_model("llama"), target_model("qwen2")  # same vocabulary, unrelated
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3, min_chain=2, min_chain_wait_s=30.0)
    prompt, budget = [5, 9, 2, 7], 40
    want = generate(target, NoDraft(), prompt, max_new_tokens=budget).tokens
    with card_source(wrong, params) as card:
        assert generate(target, card, prompt, max_new_tokens=budget).tokens == want
        assert card.first_token_accept < 0.5


def test_a_draft_that_is_usually_wrong_is_not_waited_for() -> None:
    params = TreeParams(width=1, max_depth=4, max_chain=3, min_chain=2, min_chain_wait_s=30.0)
    card = LocalCard(None, params)
    card.worker = DraftWorker(target_model("llama"), params, card.publish)  # never started
    card.open([1, 2, 3])
    card.first_token_accept = 0.2
    t0 = time.monotonic()
    assert len(card.step(Correction(0, (), (), 7)).chain) == 0
    assert time.monotonic() - t0 < 10  # not the 30 s wait
