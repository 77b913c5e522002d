"""TwoTierTree with hand-made layers: chains, hits, secondary hits, misses, late layers, epochs.

The tree used by most tests (probabilities are local, p = path score):

    root (virtual, epoch 0)                         B(root) = 10 .55, 11 .45
    ├── n0 tok 10 .55 (p .55)                       B(n0)   = 20 .5, 21 .4, 23 .1
    │   ├── n2 tok 20 .5  (p .275)                  B(n2)   = 30 .7, 32 .3   (n2 has no C child)
    │   └── n3 tok 21 .4  (p .22)
    └── n1 tok 11 .45 (p .45)                       B(n1)   = 22 .9, 24 .1
        └── n4 tok 22 .9  (p .405)                  B(n4)   = 31 .8, 33 .2
            └── n5 tok 31 .8 (p .324)

Greedy descent picks n0 then n2 (the best child at each step) although n4 and n5 have the higher
path scores at their depths; a chain ending at n2 is extended from B(n2) by token 30.
"""

from __future__ import annotations

import math

import pytest
import torch

from card.engine.shared.errors import Aborted, InvalidArgument
from card.engine.shared.tree import NO_NODE, Correction, Layer, Outcome, TwoTierTree, virtual_root_id

ROOT = virtual_root_id(0)


def layer(nodes: list[tuple[int, int, int, float]], b: list[tuple[int, int, float]] = (),
          epoch: int = 0) -> Layer:
    """nodes: (parent, node id, token, local prob); b: (parent, token, local prob)."""
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    return Layer(
        i64([n[0] for n in nodes]), i64([n[1] for n in nodes]), i64([n[2] for n in nodes]),
        f32([math.log(n[3]) for n in nodes]),
        i64([e[0] for e in b]), i64([e[1] for e in b]), f32([math.log(e[2]) for e in b]),
        epoch,
    )


LAYER1 = layer([(ROOT, 0, 10, 0.55), (ROOT, 1, 11, 0.45)], [(ROOT, 10, 0.55), (ROOT, 11, 0.45)])
LAYER2 = layer(
    [(0, 2, 20, 0.5), (0, 3, 21, 0.4), (1, 4, 22, 0.9)],
    [(0, 20, 0.5), (0, 21, 0.4), (0, 23, 0.1), (1, 22, 0.9), (1, 24, 0.1)],
)
LAYER3 = layer([(4, 5, 31, 0.8)], [(2, 30, 0.7), (2, 32, 0.3), (4, 31, 0.8), (4, 33, 0.2)])


def built(*layers: Layer) -> TwoTierTree:
    tree = TwoTierTree()
    for lay in layers or (LAYER1, LAYER2, LAYER3):
        tree.apply_layer(lay)
    return tree


def node(tree: TwoTierTree, nid: int) -> dict:
    (row,) = torch.nonzero(tree.ids == nid).flatten().tolist()
    return {"parent": int(tree.parents[row]), "token": int(tree.tokens[row]),
            "depth": int(tree.depth[row]), "p": math.exp(float(tree.path_logp[row]))}


def b_entries(tree: TwoTierTree) -> set[tuple[int, int]]:
    return set(zip(tree.b_parents.tolist(), tree.b_tokens.tolist(), strict=True))


# ---- building ------------------------------------------------------------------------------------
def test_layers_build_depths_and_path_scores() -> None:
    tree = built()
    assert tree.ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert node(tree, 5) == {"parent": 4, "token": 31, "depth": 3, "p": pytest.approx(0.45 * 0.9 * 0.8)}
    assert node(tree, 3)["p"] == pytest.approx(0.55 * 0.4)
    assert tree.sizes().nodes == 6 and tree.sizes().depth == 3 and tree.sizes().secondary == 11


def test_layer_delivered_twice_adds_nothing() -> None:
    tree = built()
    keep = tree.apply_layer(LAYER2)
    assert not bool(keep.any())
    assert tree.ids.tolist() == [0, 1, 2, 3, 4, 5]


def test_layers_arriving_out_of_id_order_keep_ids_ascending() -> None:
    tree = built(LAYER1, layer([(1, 7, 40, 0.5)]))
    tree.apply_layer(layer([(0, 6, 41, 0.5)]))  # a smaller id after a larger one
    assert tree.ids.tolist() == [0, 1, 6, 7]
    assert node(tree, 6)["parent"] == 0 and node(tree, 7)["parent"] == 1


def test_layer_with_unknown_parent_is_dropped() -> None:
    tree = built(LAYER1)
    keep = tree.apply_layer(layer([(0, 2, 20, 0.5), (99, 3, 21, 0.4)], [(99, 21, 0.4)]))
    assert keep.tolist() == [True, False]
    assert tree.ids.tolist() == [0, 1, 2]
    assert (99, 21) not in b_entries(tree)


# ---- chains --------------------------------------------------------------------------------------
def test_best_chain_is_greedy_descent_then_b_extension() -> None:
    chain = built().best_chain(8)
    assert chain.tokens == (10, 20, 30)
    assert chain.node_ids == (0, 2, NO_NODE)
    assert chain.epoch == 0


def test_best_chain_without_b_extension() -> None:
    chain = built().best_chain(8, b_extension=False)
    assert chain.tokens == (10, 20) and chain.node_ids == (0, 2)


@pytest.mark.parametrize(("max_len", "tokens"), [(0, ()), (1, (10,)), (2, (10, 20)), (3, (10, 20, 30))])
def test_best_chain_respects_max_len(max_len: int, tokens: tuple[int, ...]) -> None:
    assert built().best_chain(max_len).tokens == tokens


@pytest.mark.parametrize(("min_path_prob", "tokens"), [
    (0.0, (10, 20, 30)),  # no cut
    (0.19, (10, 20, 30)),  # n0 .55, n2 .275, B 30: .275 * .7 = .1925
    (0.2, (10, 20)),  # the B token's path .1925 falls below
    (0.3, (10,)),  # n2's .275 falls below
    (0.55, (10,)),  # a path exactly at the floor stays
    (0.6, ()),  # even the first token is too unlikely
])
def test_best_chain_cuts_below_min_path_prob(min_path_prob: float, tokens: tuple[int, ...]) -> None:
    assert built().best_chain(8, min_path_prob=min_path_prob).tokens == tokens


def test_chain_cut_does_not_extend_from_b_of_a_node_that_has_c_children() -> None:
    # cut at n0 (n2 is below the floor): n0's B children include n2's token, which was just
    # judged too unlikely; the chain must stop, not pick it up from tier B
    chain = built().best_chain(8, min_path_prob=0.3)
    assert chain.tokens == (10,) and chain.node_ids == (0,)


def test_min_path_prob_is_relative_to_the_current_root() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (), (), 11))  # hit on n1: n4 .9, n5 .72 from the new root
    assert tree.best_chain(8, min_path_prob=0.7).tokens == (22, 31)
    assert tree.best_chain(8, min_path_prob=0.75).tokens == (22,)


def test_best_chain_follows_the_best_child_not_the_first() -> None:
    tree = built(layer([(ROOT, 0, 10, 0.2), (ROOT, 1, 11, 0.7), (ROOT, 2, 12, 0.1)]))
    assert tree.best_chain(4, b_extension=False).tokens == (11,)


def test_empty_tree_gives_empty_chain_and_every_correction_misses() -> None:
    tree = TwoTierTree()
    assert len(tree.best_chain(8)) == 0
    advance = tree.apply_correction(Correction(0, (), (), 5))
    assert advance.outcome is Outcome.MISS and advance.hit_node_id is None
    assert advance.epoch == 1 and tree.epoch == 1
    assert tree.root_id == virtual_root_id(1) and len(tree) == 0
    assert tree.apply_correction(Correction(1, (), (), 7)).outcome is Outcome.MISS


def test_chain_from_b_alone_when_the_root_has_no_c_children() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (10,), (0,), 20))  # hit on n2, which has no C children
    chain = tree.best_chain(8)
    assert chain.tokens == (30,) and chain.node_ids == (NO_NODE,) and chain.epoch == 1
    # accepting the tier-B token leaves the tree without an anchor: a miss whatever comes next
    advance = tree.apply_correction(Correction(1, (30,), (NO_NODE,), 32))
    assert advance.outcome is Outcome.MISS


def test_a_catch_up_of_text_the_tree_never_saw_is_a_miss_that_empties_it() -> None:
    """A session that opened late is told the tokens committed meanwhile as a path of NO_NODE
    alone: a miss, the tree empties and the epoch moves on (the draft restarts from that text)."""
    tree = built()
    advance = tree.apply_correction(Correction(0, (10, 20, 30), (NO_NODE,) * 3, 40))
    assert advance.outcome is Outcome.MISS and advance.hit_node_id is None
    assert len(tree) == 0 and tree.epoch == 1 and advance.accepted_tokens == (10, 20, 30)


# ---- corrections ---------------------------------------------------------------------------------
def test_hit_keeps_subtree_rebases_depths_and_scores_and_keeps_b_of_survivors() -> None:
    tree = built()
    advance = tree.apply_correction(Correction(0, (), (), 11))
    assert advance.outcome is Outcome.HIT and advance.hit_node_id == 1 and advance.epoch == 1
    assert tree.root_id == 1 and tree.epoch == 1
    assert tree.ids.tolist() == [4, 5]
    assert node(tree, 4) == {"parent": 1, "token": 22, "depth": 1, "p": pytest.approx(0.9)}
    assert node(tree, 5) == {"parent": 4, "token": 31, "depth": 2, "p": pytest.approx(0.9 * 0.8)}
    assert b_entries(tree) == {(1, 22), (1, 24), (4, 31), (4, 33)}
    assert tree.best_chain(8).tokens == (22, 31)


def test_hit_below_an_accepted_path() -> None:
    tree = built()
    advance = tree.apply_correction(Correction(0, (11, 22), (1, 4), 31))
    assert advance.outcome is Outcome.HIT and advance.hit_node_id == 5
    assert advance.accepted_node_ids == (1, 4) and advance.next_token == 31
    assert tree.root_id == 5 and len(tree) == 0
    assert b_entries(tree) == set()  # n5 was never expanded


def test_hit_on_a_sibling_of_the_rejected_chain_token() -> None:
    # chain was (10, 20, 30); the target accepted 10 then said 21: n3, a C child of n0
    tree = built()
    advance = tree.apply_correction(Correction(0, (10,), (0,), 21))
    assert advance.outcome is Outcome.HIT and advance.hit_node_id == 3
    assert tree.root_id == 3 and len(tree) == 0 and b_entries(tree) == set()


def test_secondary_hit_starts_a_new_tree() -> None:
    tree = built()
    advance = tree.apply_correction(Correction(0, (10,), (0,), 23))  # only in B(n0)
    assert advance.outcome is Outcome.SECONDARY_HIT and advance.hit_node_id is None
    assert tree.root_id == virtual_root_id(1) and len(tree) == 0 and b_entries(tree) == set()


def test_miss_starts_the_virtual_root_of_the_new_epoch() -> None:
    tree = built()
    advance = tree.apply_correction(Correction(0, (10, 20), (0, 2), 99))
    assert advance.outcome is Outcome.MISS and advance.epoch == 1
    assert tree.root_id == virtual_root_id(1) != ROOT
    assert len(tree) == 0 and tree.sizes().secondary == 0


def test_token_that_is_a_c_child_elsewhere_is_not_a_hit() -> None:
    # 22 is n4's token, but n4 hangs below n1, not below the accepted n0
    assert built().apply_correction(Correction(0, (10,), (0,), 22)).outcome is Outcome.MISS


@pytest.mark.parametrize("epoch", [1, -1, 5])
def test_stale_or_future_epoch_is_aborted(epoch: int) -> None:
    tree = built()
    with pytest.raises(Aborted, match="epoch"):
        tree.apply_correction(Correction(epoch, (), (), 11))
    assert tree.epoch == 0 and len(tree) == 6  # untouched


def test_stale_epoch_after_a_correction() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (), (), 11))
    with pytest.raises(Aborted):
        tree.apply_correction(Correction(0, (), (), 11))


@pytest.mark.parametrize(
    ("tokens", "ids"), [((10, 20), (0,)), ((30, 20), (NO_NODE, 2))], ids=["length-mismatch", "back-into-tree"]
)
def test_malformed_accepted_path_is_invalid(tokens: tuple, ids: tuple) -> None:
    with pytest.raises(InvalidArgument):
        built().apply_correction(Correction(0, tokens, ids, 5))


@pytest.mark.parametrize(
    ("tokens", "ids"), [((22,), (4,)), ((11,), (0,)), ((10,), (77,)), ((10, 22), (0, 4))],
    ids=["not-below-root", "wrong-token", "unknown-node", "broken-path"],
)
def test_accepted_path_not_in_the_tree_is_invalid(tokens: tuple, ids: tuple) -> None:
    """Chains only ever name nodes of the current tree (a worker change empties the tree before
    the chain is chosen), so an accepted path that is not one is a caller's bug: refused, and the
    tree is left as it was."""
    tree = built()
    before = (tree.ids.tolist(), tree.epoch, tree.root_id)
    with pytest.raises(InvalidArgument, match="accepted node"):
        tree.apply_correction(Correction(0, tokens, ids, 31))
    assert (tree.ids.tolist(), tree.epoch, tree.root_id) == before


# ---- late layers ---------------------------------------------------------------------------------
def test_late_layer_kept_for_surviving_parents_and_dropped_for_pruned_ones() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (), (), 11))  # root n1: n4, n5 survive; n0, n2, n3 pruned
    late = layer([(2, 6, 40, 0.6), (5, 7, 41, 0.5), (3, 8, 42, 0.9)],
                 [(2, 40, 0.6), (5, 41, 0.5), (5, 43, 0.5), (3, 42, 0.9)])
    keep = tree.apply_layer(late)
    assert keep.tolist() == [False, True, False]
    assert tree.ids.tolist() == [4, 5, 7]
    # depth and score below the re-based parent n5 (depth 2, p .72)
    assert node(tree, 7) == {"parent": 5, "token": 41, "depth": 3, "p": pytest.approx(0.9 * 0.8 * 0.5)}
    assert {(5, 41), (5, 43)} <= b_entries(tree)
    assert not {p for p, _ in b_entries(tree)} & {2, 3}
    assert tree.best_chain(8).tokens == (22, 31, 41)


def test_late_layer_below_the_new_root_is_kept() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (10,), (0,), 21))  # root n3, nothing below it yet
    keep = tree.apply_layer(layer([(3, 6, 50, 0.5), (2, 7, 51, 0.5)], [(3, 50, 0.5), (3, 52, 0.5)]))
    assert keep.tolist() == [True, False]
    assert node(tree, 6) == {"parent": 3, "token": 50, "depth": 1, "p": pytest.approx(0.5)}
    assert b_entries(tree) == {(3, 50), (3, 52)}


def test_late_layer_of_an_old_epoch_is_dropped_after_a_miss() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (), (), 99))
    # a root layer of epoch 0 (parent = old virtual root) and children of pruned nodes
    assert not bool(tree.apply_layer(layer([(ROOT, 9, 12, 0.5), (5, 10, 13, 0.5)], [(ROOT, 12, 0.5)])).any())
    assert len(tree) == 0 and tree.sizes().secondary == 0
    # the drafter's first layer of the new epoch hangs below the new virtual root
    tree.apply_layer(layer([(virtual_root_id(1), 11, 14, 0.5)]))
    assert tree.best_chain(8).tokens == (14,)


def test_node_ids_not_above_the_root_are_refused() -> None:
    tree = built()
    tree.apply_correction(Correction(0, (), (), 11))  # root n1
    keep = tree.apply_layer(layer([(5, 0, 60, 0.5)]))  # id 0 belonged to a pruned node
    assert keep.tolist() == [False]


# ---- accepted tokens no chain node named (a model-free chain, a catch-up) -------------------------
def test_an_accepted_path_of_no_node_that_the_tree_holds_is_found_by_token() -> None:
    """A chain the tree never handed out (a model-free lookup's) whose tokens the draft grew
    meanwhile: the same tokens after the same path are the same nodes, so it is a hit and the
    drafter is told the nodes (it keeps their KV)."""
    tree = built()
    advance = tree.apply_correction(Correction(0, (11, 22), (NO_NODE, NO_NODE), 31))
    assert advance.outcome is Outcome.HIT and advance.hit_node_id == 5
    assert advance.accepted_node_ids == (1, 4) and tree.root_id == 5


def test_a_path_that_leaves_the_tree_by_token_is_a_miss_with_the_nodes_it_passed() -> None:
    tree = built()
    advance = tree.apply_correction(Correction(0, (11, 99, 5), (NO_NODE,) * 3, 31))
    assert advance.outcome is Outcome.MISS and advance.hit_node_id is None
    assert advance.accepted_node_ids == (1, NO_NODE, NO_NODE) and len(tree) == 0


def test_a_named_node_then_no_node_found_by_token_then_a_secondary_hit() -> None:
    tree = built()
    advance = tree.apply_correction(Correction(0, (10, 20), (0, NO_NODE), 32))
    assert advance.outcome is Outcome.SECONDARY_HIT  # 32 is in B(n2), n2 found by its token
    assert advance.accepted_node_ids == (0, 2)


def test_a_path_cannot_come_back_to_named_nodes_after_no_node() -> None:
    with pytest.raises(InvalidArgument, match="cannot come back"):
        built().apply_correction(Correction(0, (11, 22), (NO_NODE, 4), 31))
