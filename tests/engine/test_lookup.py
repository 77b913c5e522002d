"""Model-free chains where the tree holds nothing (engine.shared.ngram_stats.PromptLookup in a
CardSession): the chain right after a miss is the session's own text continued, never empty
where that text repeats itself; accepted, it lands on what the draft grew meanwhile."""

from __future__ import annotations

import math

import torch

from card.engine.shared.config import ChainDraw, TreeParams
from card.engine.shared.ngram_stats import PromptLookup
from card.engine.shared.session import CardSession
from card.engine.shared.tree import NO_NODE, Correction, Layer, Outcome, virtual_root_id

VOCAB = 100
# "5 6 7 8 9" twice: after "5 6" the text says "7 8 9"
TEXT = [1, 5, 6, 7, 8, 9, 2, 3, 5, 6]
PARAMS = TreeParams(max_chain=4, min_path_prob=0.0)


def _session(lookup: bool = True, draw: ChainDraw | None = None) -> CardSession:
    session = CardSession(PARAMS, lookup=PromptLookup(VOCAB) if lookup else None, draw=draw)
    session.open(TEXT)
    return session


def _layer(nodes: list[tuple[int, int, int]], epoch: int) -> Layer:
    """nodes: (parent, node id, token), each with local probability .9."""
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    empty = torch.empty(0, dtype=torch.int64)
    return Layer(i64([n[0] for n in nodes]), i64([n[1] for n in nodes]), i64([n[2] for n in nodes]),
                 torch.full((len(nodes),), math.log(0.9)), empty, empty, torch.empty(0), epoch)


def test_an_empty_tree_answers_with_the_text_continued() -> None:
    session = _session()
    chain = session.next_chain()
    assert chain.tokens == (7, 8, 9, 2) and chain.node_ids == (NO_NODE,) * 4
    assert session.looked_up == 1


def test_without_a_lookup_the_chain_of_an_empty_tree_is_empty() -> None:  # negative control
    assert _session(lookup=False).next_chain().tokens == ()


def test_after_a_miss_the_chain_follows_the_grown_text() -> None:
    session = _session()
    result = session.step(Correction(0, (7,), (NO_NODE,), 8))  # "... 5 6 7 8": then "9 2 3 5"
    assert result.outcome is Outcome.MISS and result.looked_up
    assert result.chain.tokens == (9, 2, 3, 5) and result.chain.epoch == 1


def test_a_tree_with_a_chain_is_never_overridden() -> None:
    session = _session()
    session.apply_layer(_layer([(virtual_root_id(0), 0, 42)], epoch=0))
    chain = session.next_chain()
    assert chain.tokens == (42,) and chain.node_ids == (0,) and session.looked_up == 0


def test_an_accepted_lookup_chain_lands_on_the_nodes_the_draft_grew_meanwhile() -> None:
    session = _session()
    chain = session.next_chain()  # (7, 8, 9, 2), no nodes
    session.apply_layer(_layer([(virtual_root_id(0), 0, 7)], epoch=0))
    session.apply_layer(_layer([(0, 1, 8)], epoch=0))
    session.apply_layer(_layer([(1, 2, 9)], epoch=0))
    result = session.step(Correction(0, chain.tokens[:2], chain.node_ids[:2], 9))
    assert result.outcome is Outcome.HIT and session.tree.root_id == 2


def test_drawn_chains_take_no_lookup() -> None:
    # a drawn chain's tokens must come with the distribution they were drawn from
    session = _session(draw=ChainDraw(temperature=1.0, seed=3))
    assert session.lookup is None and session.next_chain().tokens == ()


def test_the_path_score_floor_cuts_the_continuation() -> None:
    lookup = PromptLookup(VOCAB)
    lookup.open(TEXT)
    # each follower seen once: Witten-Bell 1/2 per token, path scores .5, .25, .125
    assert lookup.continuation(4, min_path_prob=0.2) == (7, 8)
    assert lookup.continuation(4, min_path_prob=0.6) == ()
