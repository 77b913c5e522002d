"""The chain cut ``TreeParams.min_path_prob``: chains stop where the draft's prefix probability
falls below the floor; the output never changes, only how much each forward verifies."""

from __future__ import annotations

import pytest

from card.engine.shared.config import TreeParams
from card.engine.shared.errors import InvalidArgument
from card.engine.target.chain_source import NoDraft
from tests.engine.support import card_source, generate, prompt_cases, target_model


def _run(min_path_prob: float, prompt: list[int], budget: int) -> tuple[list[int], int]:
    """Tokens and target forwards of a lockstep card run (the tree is 3 deep before each verify)."""
    model, draft = target_model("llama"), target_model("llama", sharp=False)
    params = TreeParams(width=1, branch=2, max_depth=4, max_chain=3, min_path_prob=min_path_prob)
    with card_source(draft, params, lockstep_depth=3) as card:
        run = generate(model, card, prompt, max_new_tokens=budget)
    return run.tokens, run.result.stats.target_forwards


@pytest.mark.parametrize("case", range(3))
def test_cut_chains_keep_the_output(case: int) -> None:
    prompt, budget = prompt_cases(3, seed=11, max_new=40)[case]
    want = generate(target_model("llama"), NoDraft(), prompt, max_new_tokens=budget).tokens
    for floor in (0.0, 0.3, 0.9):
        assert _run(floor, prompt, budget)[0] == want


def test_a_floor_of_one_verifies_nothing_drafted() -> None:
    """No draft is ever certain, so every chain is cut to nothing: one token per forward."""
    prompt, budget = [2, 7, 1, 8, 2, 8], 30
    _, forwards = _run(1.0, prompt, budget)
    assert forwards == budget
    _, uncut_forwards = _run(0.0, prompt, budget)
    assert uncut_forwards < budget  # the same draft, uncut, does commit several tokens per forward


def test_min_path_prob_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="min_path_prob"):
        TreeParams(min_path_prob=1.5)
    with pytest.raises(InvalidArgument, match="min_path_prob"):
        TreeParams(min_path_prob=-0.1)


def test_overrides_apply_only_what_was_given() -> None:
    base = TreeParams(width=1, branch=4, max_depth=8, max_chain=6, min_path_prob=0.2)
    assert base.with_overrides(width=None, max_chain=None) == base
    assert base.with_overrides(max_chain=4, min_path_prob=0.0) == TreeParams(
        width=1, branch=4, max_depth=8, max_chain=4, min_path_prob=0.0)
    with pytest.raises(InvalidArgument, match="max_chain"):
        base.with_overrides(max_chain=-1)  # the merged params are checked
