"""Tree attention: every node's logits in a tree forward equal a plain causal forward over
committed + the node's path (DESIGN.md §5), layer after layer and across re-roots."""

from __future__ import annotations

import pytest

from card.engine.shared.config import TreeParams
from card.engine.shared.tree import Outcome
from tests.engine.support import KINDS, DraftSession, prompt_cases, target_model


def grow_and_check(s: DraftSession, layers: int) -> int:
    """Grow up to ``layers`` layers, checking every forward; returns nodes checked."""
    checked = 0
    for _ in range(layers):
        before = s.drafter.forwards
        if s.grow() is None:
            break
        if s.drafter.forwards > before:
            checked += s.check_last_logits()
    return checked


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_forward_logits_equal_plain_forward(kind: str, width: int) -> None:
    prompt, _ = prompt_cases(1, seed=width)[0]
    s = DraftSession(target_model(kind), TreeParams(width=width, max_depth=5), prompt, seed=width)
    checked = grow_and_check(s, 4)  # root forward, then three tree forwards

    outcomes = []
    deep = s.random_node(min_depth=2)
    outcomes.append(s.hit(deep).outcome)  # hit below an accepted path: the subtree survives
    checked += grow_and_check(s, 3)

    outcomes.append(s.miss(s.random_node()).outcome)  # miss after accepting a path
    checked += grow_and_check(s, 3)

    adv = s.secondary()
    if adv is not None:
        outcomes.append(adv.outcome)
        checked += grow_and_check(s, 3)

    outcomes.append(s.hit(s.random_node(min_depth=1)).outcome)
    checked += grow_and_check(s, 3)

    # hit on a frontier node (never expanded): the drafter forwards it as the new root
    frontier = s.drafter.tree.ids[s.drafter.kv_slot < 0]
    outcomes.append(s.hit(int(frontier[-1])).outcome)
    assert s.drafter.pending, "a hit on an unexpanded node leaves its token to forward"
    checked += grow_and_check(s, 3)

    outcomes.append(s.miss().outcome)  # miss at the root
    checked += grow_and_check(s, 3)

    assert outcomes.count(Outcome.HIT) == 3 and outcomes.count(Outcome.MISS) == 2
    assert checked >= 10 * width or checked >= 30
