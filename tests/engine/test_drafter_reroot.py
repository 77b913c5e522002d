"""Drafter re-root (DESIGN.md §5): after any correction the drafter's tree holds the same node ids
as the cache's tree, and its KV cache holds exactly committed + surviving expanded nodes, each slot
equal to a fresh causal forward. Also the frontier regrow from tier B (no forward)."""

from __future__ import annotations

import pytest
import torch

from card.engine.draft.drafter import Drafter
from card.engine.shared.config import TreeParams
from card.engine.shared.errors import Aborted
from card.engine.shared.tree import Advance, Outcome
from tests.engine.support import KINDS, DraftSession, prompt_cases, same_tree, target_model


def correct_and_check(s: DraftSession, make) -> Advance | None:
    """Apply a correction built by ``make()``; check KV, survivors, and (when nothing is in
    flight) that drafter and cache hold the same tree."""
    expanded_before = s.expanded_ids()
    advance = make()
    if advance is None:
        return None
    survivors = set(s.drafter.tree.ids.tolist())
    assert s.expanded_ids() == expanded_before & survivors, "an expanded survivor lost its KV"
    s.check_kv()
    if not s.in_flight:
        same_tree(s.drafter.tree, s.mirror)
    return advance


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_random_corrections_keep_tree_and_kv_in_step(kind: str, width: int) -> None:
    """A random walk of growth, delayed layer delivery and corrections of every kind."""
    prompt, _ = prompt_cases(1, seed=100 + width)[0]
    s = DraftSession(target_model(kind), TreeParams(width=width, max_depth=4), prompt, seed=width)
    rng = torch.Generator().manual_seed(width)
    outcomes: list[Outcome] = []
    for _ in range(60):
        action = int(torch.randint(10, (1,), generator=rng))
        if action < 4:
            s.grow(deliver=action != 0)  # one in four layers reaches the cache only later
        elif action == 4:
            s.deliver()
            same_tree(s.drafter.tree, s.mirror)
        else:
            node = s.random_node()
            makers = {5: lambda n=node: s.hit(n) if n is not None else None,
                      6: lambda n=node: s.hit(n) if n is not None else None,
                      7: lambda n=node: s.miss(n),
                      8: lambda: s.miss(),
                      9: lambda: s.secondary()}
            adv = correct_and_check(s, makers[action])
            if adv is not None:
                outcomes.append(adv.outcome)
            s.deliver()
            same_tree(s.drafter.tree, s.mirror)
    assert Outcome.HIT in outcomes and Outcome.MISS in outcomes
    s.check_kv()


@pytest.mark.parametrize("kind", KINDS)
def test_hit_keeps_surviving_kv_and_late_layers(kind: str) -> None:
    prompt, _ = prompt_cases(1, seed=7)[0]
    s = DraftSession(target_model(kind), TreeParams(width=4, max_depth=6), prompt)
    for _ in range(3):
        s.grow()
    s.grow(deliver=False)  # layer 4 is on the wire when the correction lands
    depth1 = int(s.mirror.ids[s.mirror.depth == 1][0])
    kept_before = set(s.mirror.ids.tolist())
    adv = correct_and_check(s, lambda: s.hit(depth1))
    assert adv.outcome is Outcome.HIT and adv.hit_node_id == depth1
    assert s.drafter.pending == [] and s.drafter.n_committed == len(s.committed)
    s.deliver()
    same_tree(s.drafter.tree, s.mirror)
    assert set(s.mirror.ids.tolist()) - kept_before, "the late layer's surviving nodes were dropped"
    # the next layers grow from the survivors and stay consistent
    for _ in range(2):
        s.grow()
        s.check_last_logits()
        s.check_kv()
    same_tree(s.drafter.tree, s.mirror)


@pytest.mark.parametrize("kind", KINDS)
def test_node_only_the_drafter_has_is_still_a_miss(kind: str) -> None:
    """The target's token is a child in a layer the cache has not received: the cache says miss,
    and the drafter must follow the cache, not its own tree."""
    prompt, _ = prompt_cases(1, seed=8)[0]
    s = DraftSession(target_model(kind), TreeParams(width=2, max_depth=6), prompt)
    s.grow()
    s.grow()
    layer = s.grow(deliver=False)
    parent, token = int(layer.parent_ids[0]), int(layer.tokens[0])
    adv = correct_and_check(s, lambda: s.correct(DraftSessionPath(s, parent), token))
    assert adv.outcome is Outcome.MISS
    s.deliver()  # arrives for parents that no longer exist
    same_tree(s.drafter.tree, s.mirror)
    assert len(s.mirror) == 0
    s.grow()
    s.check_last_logits()


def DraftSessionPath(s: DraftSession, node: int) -> list[int]:
    from tests.engine.support import path_nodes

    return path_nodes(s.mirror, node)


def find_regrow_case(kind: str, prune: str) -> tuple[DraftSession, int]:
    """A session whose newest layer hangs below one node X of the layer above while another node
    Y of that layer survives the hit we are about to make; returns (session, node to hit).

    prune="self":   hit Y itself (Y becomes the root, X is pruned).
    prune="parent": hit Y's parent, which is not X's parent.
    """
    for seed in range(200):
        prompt, _ = prompt_cases(1, seed=1000 + seed, max_prompt=8)[0]
        s = DraftSession(target_model(kind), TreeParams(width=2, branch=3, max_depth=6), prompt)
        for _ in range(5):
            layer = s.grow()
            tree = s.mirror
            parents = set(layer.parent_ids.tolist())
            if len(parents) != 1 or tree.sizes().depth < 3:
                continue
            (x,) = parents
            x_row = int(torch.nonzero(tree.ids == x)[0])
            siblings = tree.ids[(tree.depth == tree.depth[x_row]) & (tree.ids != x)].tolist()
            for y in siblings:
                y_row = int(torch.nonzero(tree.ids == y)[0])
                if prune == "self":
                    return s, y
                if tree.parents[y_row] != tree.parents[x_row] and int(tree.parents[y_row]) >= 0:
                    return s, int(tree.parents[y_row])
    raise AssertionError("no regrow case found; widen the search")


@pytest.mark.parametrize("prune", ["self", "parent"])
@pytest.mark.parametrize("kind", KINDS)
def test_frontier_regrows_from_b_without_a_forward(kind: str, prune: str) -> None:
    s, hit = find_regrow_case(kind, prune)
    correct_and_check(s, lambda: s.hit(hit))
    tree = s.drafter.tree
    assert not bool((s.drafter.kv_slot < 0).any()), "every survivor is expanded: no frontier"
    deepest = tree.sizes().depth
    # what the regrow must promote: the best B children (by path score) of the deepest survivors
    _, known_depth, known_path = tree._known()
    rows, _ = tree.rows_of(tree.b_parents)
    cand = torch.nonzero(known_depth[rows] == deepest).flatten()
    score = known_path[rows[cand]] + tree.b_logp[cand]
    best = cand[torch.topk(score, min(2, cand.numel())).indices]
    expected = sorted(zip(tree.b_parents[best].tolist(), tree.b_tokens[best].tolist(), strict=True))
    assert expected

    forwards = s.drafter.forwards
    layer = s.grow()
    assert s.drafter.forwards == forwards, "a regrow must not run a forward"
    assert layer is not None and layer.b_tokens.numel() == 0
    got = sorted(zip(layer.parent_ids.tolist(), layer.tokens.tolist(), strict=True))
    assert got == expected
    same_tree(s.drafter.tree, s.mirror)
    assert s.mirror.best_chain(8).tokens, "the regrown layer gives the target a chain again"
    # the regrown nodes are the frontier: the next step expands them with one forward
    s.grow()
    assert s.drafter.forwards == forwards + 1
    s.check_last_logits()
    s.check_kv()
    same_tree(s.drafter.tree, s.mirror)


def test_advance_twice_is_ignored_and_a_skipped_epoch_is_aborted() -> None:
    prompt, _ = prompt_cases(1, seed=9)[0]
    s = DraftSession(target_model("llama"), TreeParams(width=2, max_depth=4), prompt)
    s.grow()
    s.grow()
    adv = s.hit(int(s.mirror.ids[0]))
    s.drafter.advance(adv)  # delivered twice
    same_tree(s.drafter.tree, s.mirror)
    s.check_kv()
    with pytest.raises(Aborted):
        s.drafter.advance(Advance(adv.epoch + 2, (), (), 5, Outcome.MISS))


def test_release_frees_kv_and_tree() -> None:
    drafter = Drafter(target_model("llama"), TreeParams(width=2))
    drafter.start([1, 2, 3])
    drafter.grow()
    drafter.grow()
    assert drafter.kv_length() > 0
    drafter.release()
    assert drafter.kv_length() == 0 and len(drafter.tree) == 0 and not drafter.pending
