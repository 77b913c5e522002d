"""Bounds on every knob a caller sets and every structure a peer fills, in the engine:

- a chain is at most MAX_CHAIN tokens and a tree at most MAX_TREE_DEPTH layers deep, whoever asks
  (TreeParams, so a request's ChainPolicy and every flag), and the target verifies no longer a
  chain whatever a source hands it (Generation.take_step);
- the model-free lookup, which would continue a repeating text forever, stops at max_chain;
- a session's tree holds at most its TreeLimits (nodes, tier-B entries, entries under one parent)
  and the trees of one worker's sessions at most their TreeBudget, whatever layers arrive: the
  excess is dropped and counted, and one session's Step stays far below a StepBatch deadline;
- an iteration's decoding rows fit ``max_batch_tokens`` (chains cut, longest first), with every
  output unchanged.

Each bound has its negative control: without it, the same input goes past it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from card.engine.shared.config import (
    MAX_CHAIN,
    MAX_TREE_DEPTH,
    ChainDraw,
    ChainPolicy,
    GenerationRequest,
    SamplingParams,
    StopParams,
    TreeParams,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.ngram_stats import PromptLookup
from card.engine.shared.session import CardSession
from card.engine.shared.tree import (
    MAX_Q_WIDTH,
    MAX_TREE_NODES,
    MAX_TREE_SECONDARY,
    NO_NODE,
    Advance,
    Chain,
    Correction,
    Layer,
    Outcome,
    TreeBudget,
    TreeLimits,
    TwoTierTree,
    virtual_root_id,
)
from card.engine.target.chain_source import NoDraft, StepResult
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine, finish_alone, level_rows
from tests.engine.support import letters, prompt_cases, target_model

ROOT = virtual_root_id(0)


def i64(xs: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64)


def flat_layer(parents: Sequence[int], ids: Sequence[int], b_parents: Sequence[int] = (),
               drawn: bool = False, seed: int = 0) -> Layer:
    """Nodes (token = id % 1000) under ``parents``, tier-B entries under ``b_parents`` (one entry
    per listed parent, list a parent k times for k entries; their tokens differ under a parent)."""
    g = torch.Generator().manual_seed(seed)
    n, m = len(ids), len(b_parents)
    return Layer(i64(parents), i64(ids), i64([i % 1000 for i in ids]),
                 -torch.rand(n, generator=g) - 0.01,
                 i64(b_parents), i64([j % 1000 for j in range(m)]), -torch.rand(m, generator=g) - 0.01,
                 drawn=torch.ones(n, dtype=torch.bool) if drawn else None)


# ---- knobs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, cap", [("max_chain", MAX_CHAIN), ("max_depth", MAX_TREE_DEPTH)])
def test_chain_and_depth_are_capped_wherever_tree_params_are_built(field: str, cap: int) -> None:
    assert getattr(TreeParams(**{field: cap}), field) == cap  # the cap itself is a value
    for huge in (cap + 1, 1_000_000):
        with pytest.raises(InvalidArgument, match=f"{field} must be in"):
            TreeParams(**{field: huge})
    with pytest.raises(InvalidArgument, match="max_chain must be in"):  # a request's, over anything
        ChainPolicy(max_chain=1_000_000).over(TreeParams())


def test_the_lookup_of_a_repeating_text_stops_at_max_chain() -> None:
    """A text that repeats has a continuation without end: the lookup walks max_chain steps (it
    did a million under the session's lock when the knob had no bound)."""
    text = [1, 2, 3, 4] * 8
    for max_chain in (5, MAX_CHAIN):
        session = CardSession(TreeParams(max_chain=max_chain), lookup=PromptLookup(10))
        session.open(text)
        chain = session.next_chain()
        assert len(chain.tokens) == max_chain and session.looked_up == 1
        assert list(chain.tokens) == (text * 20)[len(text):len(text) + max_chain]


class _Long(NoDraft):
    """A source (a broken or hostile cache) that hands out a chain of ``n`` tokens every step."""

    def __init__(self, n: int) -> None:
        self.n = n

    def step(self, correction: Correction) -> StepResult:
        return StepResult(Chain(tuple(range(3, 3 + self.n)), (NO_NODE,) * self.n, correction.epoch))


def test_the_target_verifies_at_most_max_chain_whatever_a_source_hands_out() -> None:
    request = GenerationRequest((1, 2, 3), stop=StopParams(max_new_tokens=4000, ignore_eos=True))

    def tokens(source_len: int) -> int:
        gen = Generation(request, _Long(source_len), eos_ids=frozenset(), decode=letters,
                         context_window=8192, mode="card")
        gen.open()
        inputs, _ = gen.take_step(gen.source.step(gen.correction()), 0.0)
        return len(inputs) - 1  # [t_next, *chain]

    assert tokens(10) == 10  # a chain within the bound is taken whole
    assert tokens(1000) == MAX_CHAIN


# ---- trees ----------------------------------------------------------------------------------------
def test_a_session_tree_keeps_at_most_its_nodes_and_counts_the_rest() -> None:
    limits = TreeLimits(nodes=10, secondary=1000, q_width=64)
    tree = TwoTierTree(limits=limits)
    keep = tree.apply_layer(flat_layer([ROOT] * 6, range(6)))
    assert bool(keep.all()) and len(tree) == 6
    keep = tree.apply_layer(flat_layer(list(range(6)), range(6, 12)))
    assert keep.tolist() == [True] * 4 + [False] * 2  # the layer's first nodes, as many as fit
    assert len(tree) == 10 and tree.dropped["node", "session"] == 2
    tree.apply_layer(flat_layer([6], [12]))
    assert len(tree) == 10 and tree.dropped["node", "session"] == 3
    unbounded = TwoTierTree()  # negative control: a drafter's own mirror takes them all
    unbounded.apply_layer(flat_layer([ROOT] * 6, range(6)))
    unbounded.apply_layer(flat_layer(list(range(6)), range(6, 12)))
    assert len(unbounded) == 12 and not unbounded.dropped


def test_tier_b_is_capped_a_whole_parent_at_a_time() -> None:
    limits = TreeLimits(nodes=100, secondary=10, q_width=4)
    tree = TwoTierTree(limits=limits)
    tree.apply_layer(flat_layer([ROOT] * 4, range(4)))
    # parent 0: 5 entries, over the width: none of them; parent 1: 4, at the width: all
    tree.apply_layer(flat_layer([0], [4], b_parents=[0] * 5 + [1] * 4))
    held = tree.b_parents.tolist()
    assert held.count(0) == 0 and held.count(1) == 4 and tree.dropped["secondary", "width"] == 5
    # parent 1 already has 4: one more would pass the width
    tree.apply_layer(flat_layer([0], [5], b_parents=[1]))
    assert tree.b_parents.tolist().count(1) == 4 and tree.dropped["secondary", "width"] == 6
    # 10 entries at most: parent 2's four fit (8), parent 3's four do not, whole
    tree.apply_layer(flat_layer([1], [6], b_parents=[2] * 4 + [3] * 4))
    held = tree.b_parents.tolist()
    assert held.count(2) == 4 and held.count(3) == 0 and tree.dropped["secondary", "session"] == 4


def test_a_drawn_chain_proposal_is_never_wider_than_the_q_width() -> None:
    """A parent with more tier-B entries than the q-row width has none: the draw stops there
    (its q row would be a part of the draft's, misstating q); at the width the draw goes on."""
    session = CardSession(TreeParams(max_chain=8), draw=ChainDraw(1.0, 3))
    session.open([1, 2])
    session.apply_layer(flat_layer([ROOT], [0], b_parents=[ROOT] * MAX_Q_WIDTH, drawn=False))
    chain = session.next_chain()
    assert len(chain.tokens) >= 1 and chain.proposal is not None
    assert chain.proposal.tokens.shape[1] == MAX_Q_WIDTH
    wide = CardSession(TreeParams(max_chain=8), draw=ChainDraw(1.0, 3))
    wide.open([1, 2])
    wide.apply_layer(flat_layer([ROOT], [0], b_parents=[ROOT] * (MAX_Q_WIDTH + 1)))
    assert wide.next_chain().tokens == () and wide.tree.dropped["secondary", "width"] == MAX_Q_WIDTH + 1


def test_the_trees_of_one_worker_share_its_budget_and_give_back_what_they_free() -> None:
    budget = TreeBudget(limit=20)
    limits = TreeLimits(nodes=100, secondary=100, q_width=64)
    a, b = TwoTierTree(limits=limits), TwoTierTree(limits=limits)
    a.apply_layer(flat_layer([ROOT] * 8, range(8), b_parents=[ROOT] * 4), budget)
    assert budget.used == a.entries == 12
    b.apply_layer(flat_layer([ROOT] * 12, range(12), b_parents=[ROOT] * 4), budget)
    # 8 nodes left: b gets 8 of its 12 nodes and none of its tier B (a whole parent or nothing)
    assert len(b) == 8 and b.b_tokens.numel() == 0 and budget.used == 20
    assert b.dropped["node", "worker"] == 4 and b.dropped["secondary", "worker"] == 4
    a.reset(1)  # a miss: a's entries go back
    assert budget.used == b.entries == 8
    b.apply_layer(flat_layer(list(range(4)), range(100, 104)), budget)
    assert budget.used == b.entries == 12
    b.reroot(Advance(1, (0,), (0,), 100, Outcome.HIT, 100))  # node 100's subtree is empty

    assert budget.used == b.entries == 0
    # negative control: without the budget the same layers all fit
    c = TwoTierTree(limits=limits)
    c.apply_layer(flat_layer([ROOT] * 12, range(12), b_parents=[ROOT] * 4))
    assert len(c) == 12 and c.b_tokens.numel() == 4


def _flood(session: CardSession, layers: int) -> None:
    """Full-size layers (1024 nodes, 16 tier-B entries under each) down one spine and across."""
    ids = iter(range(10**9))
    frontier = [ROOT]
    for i in range(layers):
        parents = [frontier[j % len(frontier)] for j in range(1024)]
        nodes = [next(ids) for _ in parents]
        b = [p for p in dict.fromkeys(parents) for _ in range(16)]
        session.apply_layer(flat_layer(parents, nodes, b_parents=b, seed=i))
        frontier = nodes


def test_a_flooded_session_stays_within_its_limits_and_its_step_stays_fast() -> None:
    session = CardSession(TreeParams(max_chain=MAX_CHAIN))
    session.open([1, 2, 3])
    _flood(session, 12)
    sizes = session.tree.sizes()
    assert sizes.nodes == MAX_TREE_NODES and sizes.secondary <= MAX_TREE_SECONDARY
    assert session.tree.dropped["node", "session"] > 0
    chain = session.next_chain()
    started = time.perf_counter()
    # the worst Step: every accepted token looked up by token (NO_NODE), then a miss
    result = session.step(Correction(0, chain.tokens, (NO_NODE,) * len(chain), 999_999))
    took = time.perf_counter() - started
    assert result.outcome is not None and took < 0.25, f"a Step over a full tree took {took:.3f}s"
    # negative control: unbounded, the same flood makes a tree past the limits
    unbounded = CardSession(TreeParams(max_chain=MAX_CHAIN), limits=TreeLimits(10**9, 10**9, 10**9))
    unbounded.open([1, 2, 3])
    _flood(unbounded, 12)
    assert len(unbounded.tree) == 12 * 1024


# ---- the iteration's token budget -----------------------------------------------------------------
def test_level_rows_cuts_the_longest_first_and_never_below_one_row() -> None:
    assert level_rows([3, 5], 10) == [3, 5]
    assert level_rows([65, 65, 2], 20) == [9, 9, 2]
    assert level_rows([65, 10, 2], 20) == [9, 9, 2]
    assert level_rows([65, 64], 20) == [10, 10]
    assert level_rows([5, 5, 5], 2) == [1, 1, 1]
    assert sum(level_rows([64, 33, 17, 1], 50)) == 50


class _Oracle(NoDraft):
    """Chains of the very tokens plain decoding commits (``want``: the whole output), ``n`` long:
    every one is accepted, so every step offers a full chain."""

    def __init__(self, prompt: Sequence[int], want: Sequence[int], n: int) -> None:
        self.prompt, self.want, self.n = len(prompt), list(want), n
        self.committed: Sequence[int] = ()

    def open(self, committed: Sequence[int]) -> None:
        self.committed = committed

    def step(self, correction: Correction) -> StepResult:
        done = len(self.committed) - self.prompt
        tokens = tuple(self.want[done:done + self.n])
        return StepResult(Chain(tokens, (NO_NODE,) * len(tokens), correction.epoch))


def _rows_per_iteration(max_batch_tokens: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Plain decoding's outputs, the rows of each iteration that only decoded, and the outputs of
    the same requests under ``_Oracle`` chains of 40 in one engine of that token budget."""
    model = target_model("llama")
    cases = prompt_cases(3, seed=11, max_prompt=20, max_new=60)
    requests = [GenerationRequest(tuple(p), SamplingParams(), StopParams(max_new_tokens=60, ignore_eos=True))
                for p, _ in cases]

    def gen(r: GenerationRequest, source: NoDraft) -> Generation:
        return Generation(r, source, eos_ids=frozenset(), decode=letters, context_window=512,
                          mode="card", vocab_size=model.config.vocab_size)

    want = [finish_alone(model, gen(r, NoDraft())).token_ids for r in requests]
    engine = TargetEngine(model, KVPool(model, slots=3, max_len=512), max_batch_tokens=max_batch_tokens,
                          adaptive=False)
    gens = [gen(r, _Oracle(r.prompt_ids, w, 40)) for r, w in zip(requests, want, strict=True)]
    for g in gens:
        engine.add(g)
    rows = []
    while not engine.idle:
        decoding_only = not engine.waiting and not any(g.prefilling for g in engine.running)
        engine.step()
        if decoding_only and engine.last is not None:
            rows.append(engine.last.rows)
    got = [g.result.token_ids if g.result else [] for g in gens]
    return want, rows, got


def test_decoding_rows_count_against_the_iterations_token_budget_and_outputs_stay_exact() -> None:
    want, rows, got = _rows_per_iteration(max_batch_tokens=24)
    assert got == want
    assert rows and max(rows) <= 24
    # negative control: with room, the same chains make iterations past that budget
    want, rows, got = _rows_per_iteration(max_batch_tokens=2048)
    assert got == want and max(rows) > 24


def test_the_budget_never_starves_a_generation_of_its_next_token() -> None:
    """Below one row per generation the budget still gives each its t_next (no chain)."""
    want, rows, got = _rows_per_iteration(max_batch_tokens=1)
    assert got == want and rows and max(rows) <= 3
