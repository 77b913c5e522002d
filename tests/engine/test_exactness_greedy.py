"""Greedy exactness (DESIGN.md §5): `card` and `sd` produce `vanilla`'s tokens, token for token,
for every tree width, depth and draft (the target itself, an unrelated model, a perturbed copy),
on tiny random Llama and Qwen2 models in float64, over many prompts and token budgets.

card runs twice per shape: asynchronously (lockstep 0: chains are whatever the tree holds when
the target asks, up to 8 tokens, cut by the engine's measured cost as in serving) and in
lockstep 3 with chains of at most 2, so that the tree is always deeper than the chain and a
self-draft's corrections are hits every time.
"""

from __future__ import annotations

import functools
import math

import pytest

from card.engine.inprocess.sources import SyncDraft
from card.engine.shared.config import TreeParams
from card.engine.target.chain_source import NoDraft
from tests.engine.support import (
    DRAFTS,
    KINDS,
    card_source,
    draft_model,
    generate,
    prompt_cases,
    target_model,
)

POOL = prompt_cases(96, seed=2024)  # prompt lengths 1..30, budgets 1..60


@functools.cache
def vanilla(kind: str, case: int) -> tuple[int, ...]:
    prompt, budget = POOL[case]
    run = generate(target_model(kind), NoDraft(), prompt, max_new_tokens=budget)
    assert run.result.finish_reason == "length" and len(run.tokens) == budget
    assert run.result.stats.target_forwards == budget
    return tuple(run.tokens)


def cases_for(*key: object, n: int) -> list[int]:
    """``n`` pool cases for one parameter combination (different combinations get different
    ones); the first is a long one (budget >= 40), so there is room for hits."""
    start = sum(ord(c) * (i + 1) for i, c in enumerate(repr(key)))
    long_cases = [i for i, (_, budget) in enumerate(POOL) if budget >= 40]
    return [long_cases[start % len(long_cases)], *((start + 7 * j) % len(POOL) for j in range(1, n))]


def check_run(kind: str, case: int, run) -> None:
    want = vanilla(kind, case)
    assert tuple(run.tokens) == want, f"prompt {POOL[case][0]} budget {POOL[case][1]}"
    assert run.result.finish_reason == "length"


def full_chain_forwards(budget: int, chain: int) -> int:
    """Target forwards of a run whose every chain has ``chain`` tokens and is accepted in full:
    the prefill commits one token, each verification ``chain + 1`` (the last one fewer)."""
    return 1 + math.ceil((budget - 1) / (chain + 1))


@pytest.mark.parametrize("lockstep", [0, 3])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("kind", KINDS)
def test_card_equals_vanilla(kind: str, draft: str, width: int, lockstep: int) -> None:
    params = TreeParams(width=width) if not lockstep else TreeParams(width=width, max_depth=5, max_chain=2)
    hits = secondary = misses = new = forwards = 0
    with card_source(draft_model(kind, draft), params, lockstep_depth=lockstep) as card:
        for case in cases_for(kind, draft, width, lockstep, n=2):
            prompt, budget = POOL[case]
            # adaptive when asynchronous: a chain cut by the clock must not change the output
            run = generate(target_model(kind), card, prompt, max_new_tokens=budget,
                           adaptive=not lockstep)
            check_run(kind, case, run)
            stats = run.result.stats
            hits, secondary, misses = (hits + stats.hits, secondary + stats.secondary_hits,
                                       misses + stats.misses)
            new, forwards = new + stats.new_tokens, forwards + stats.target_forwards
            if lockstep and draft == "self" and width == 1:
                # the tree is always deeper than the 2-token chain and its only C child is the
                # target's own token: every chain is accepted in full and every correction is a
                # hit, but maybe the first (a miss unless the root layer beat the target's prefill)
                assert stats.target_forwards == full_chain_forwards(budget, 2)
                assert stats.misses <= 1 and stats.secondary_hits == 0
                assert stats.hits + stats.misses == stats.target_forwards - 1
    print(f"{kind} {draft} K={width} lockstep={lockstep}: {new} tokens in {forwards} target forwards, "
          f"hits {hits} secondary {secondary} misses {misses}")
    # hits need the draft to agree with the target: always for self, often enough for the
    # perturbed copy in a wide tree (the tree's shape depends on timing, so not in every run)
    if lockstep and (draft == "self" or (draft == "perturbed" and width == 8)):
        assert hits > 0, "the tree path (hits and re-roots) was not exercised"
    if lockstep and draft == "self":
        assert forwards < new


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("kind", KINDS)
def test_sd_equals_vanilla(kind: str, draft: str, gamma: int) -> None:
    for case in cases_for(kind, draft, gamma, n=4):
        prompt, budget = POOL[case]
        run = generate(target_model(kind), SyncDraft(draft_model(kind, draft), gamma), prompt,
                       max_new_tokens=budget)
        check_run(kind, case, run)
        if draft == "self":
            # the draft is the target: every chain of gamma tokens is accepted in full
            assert run.result.stats.target_forwards == full_chain_forwards(budget, gamma)


@pytest.mark.parametrize("kind", KINDS)
def test_idle_layers_keep_the_logits_and_only_raise_the_cost(kind):
    """The service tests' dearer twin (tests.tiny_models.with_idle_layers) gives its base's logits
    bit for bit, which is what lets it serve as the target of a draft that must stay ahead; the
    same layers left un-zeroed change them (the control)."""
    import torch

    from tests.tiny_models import tiny_model, with_idle_layers

    base = tiny_model(kind, seed=0)
    twin = with_idle_layers(base, 6)
    ids = torch.tensor([[5, 17, 3, 88, 41, 2, 60]])
    with torch.no_grad():
        want = base(ids).logits
        assert len(twin.model.layers) == len(base.model.layers) + 6
        assert torch.equal(twin(ids).logits, want)
        for layer in twin.model.layers[-6:]:
            layer.mlp.down_proj.weight.fill_(0.01)
        assert not torch.equal(twin(ids).logits, want)
