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


def test_the_target_waits_for_a_chain_of_min_chain_tokens() -> None:
    model = target_model("llama")
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3, min_chain=2, min_chain_wait_s=30.0)
    prompt = [3, 1, 4, 1, 5]
    first = generate(model, NoDraft(), prompt, max_new_tokens=1).tokens[0]
    with card_source(model, params) as card:
        card.open(prompt)
        step = card.step(Correction(0, (), (), first))  # the draft has barely started
        assert len(step.chain) >= 2
        card.close()


def test_min_chain_keeps_the_output() -> None:
    model, draft = target_model("llama"), target_model("llama", sharp=False)
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3, min_chain=2)
    for prompt, budget in prompt_cases(6, seed=5, max_new=40):
        want = generate(model, NoDraft(), prompt, max_new_tokens=budget).tokens
        with card_source(draft, params) as card:
            assert generate(model, card, prompt, max_new_tokens=budget).tokens == want


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
    """An unrelated draft's tree misses the target's tokens: the target soon stops waiting."""
    target, wrong = target_model("llama"), target_model("qwen2")  # same vocabulary, unrelated
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3, min_chain=2, min_chain_wait_s=30.0)
    prompt, budget = [5, 9, 2, 7], 40
    want = generate(target, NoDraft(), prompt, max_new_tokens=budget).tokens
    with card_source(wrong, params) as card:
        assert generate(target, card, prompt, max_new_tokens=budget).tokens == want
        assert card.first_token_accept < 0.5 or card.backoffs


def test_a_draft_that_is_usually_wrong_is_not_waited_for() -> None:
    params = TreeParams(width=1, max_depth=4, max_chain=3, min_chain=2, min_chain_wait_s=30.0)
    card = LocalCard(None, params)
    card.worker = DraftWorker(target_model("llama"), params, card.publish)  # never started
    card.open([1, 2, 3])
    card.first_token_accept = 0.2
    t0 = time.monotonic()
    assert len(card.step(Correction(0, (), (), 7)).chain) == 0
    assert time.monotonic() - t0 < 10  # not the 30 s wait


def test_a_useless_draft_is_paused_and_probed_again_with_unchanged_output() -> None:
    target, wrong = target_model("llama"), target_model("qwen2")  # same vocabulary, unrelated
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3)
    for prompt, budget in prompt_cases(4, seed=3, max_new=60)[:4]:
        budget = max(budget, 50)
        want = generate(target, NoDraft(), prompt, max_new_tokens=budget).tokens
        with card_source(wrong, params) as card:
            run = generate(target, card, prompt, max_new_tokens=budget)
            assert run.tokens == want
            assert card.backoffs >= 1  # ~9 straight misses, then 16 steps alone, then a probe
            assert run.result.stats.draft_forwards > 0


def test_a_good_draft_is_never_paused() -> None:
    """Right and always ahead (lockstep 3, chains of 2): every correction is a hit."""
    model = target_model("llama")
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=2)
    prompt, budget = [4, 8, 15, 16, 23, 42], 60
    with card_source(model, params, lockstep_depth=3) as card:
        run = generate(model, card, prompt, max_new_tokens=budget)
        assert card.backoffs == 0
    assert run.tokens == generate(model, NoDraft(), prompt, max_new_tokens=budget).tokens


def test_misses_before_the_first_layer_do_not_pause_the_draft() -> None:
    """A draft still prefilling has offered nothing yet: its misses are not held against it."""
    params = TreeParams(width=1, max_depth=4, max_chain=3)
    card = LocalCard(None, params)
    card.worker = DraftWorker(target_model("llama"), params, card.publish)  # never started: no layers
    card.open([1, 2, 3])
    for epoch in range(30):
        card.step(Correction(epoch, (), (), 7))
    assert card.backoffs == 0
    card.close()
