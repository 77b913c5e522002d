"""verify rejection (engine.target.verify, engine.shared.tree.drawn_chain): speculative sampling
on chains drawn from the draft's distributions.

- the rule on fixed logits, over many seeds and two positions (so a rejection's next step is in
  it too): the committed tokens follow the target's distribution (chi-square), and a rule that
  resamples from p after a rejection (the classic bug) fails the same test;
- the draw: its tokens follow softmax(tier-B logp / T), it goes on below tier-C nodes only;
- a real generation (tiny models, draft-then-verify on a tree): the first two tokens fit the
  target over many seeds; greedy requests are plain decoding's; rejection keeps more drafted
  tokens than exact on the same chains; a proposal that does not hold up is verified exactly.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

import card.engine.target.verify as verify_module
from card.engine.inprocess.sources import SyncDraft
from card.engine.shared.config import (
    ChainDraw,
    GenerationRequest,
    SamplingParams,
    TreeParams,
    Verify,
    VerifyPolicy,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.sampling import filtered_probs
from card.engine.shared.tree import NO_NODE, Layer, Proposal, TwoTierTree
from card.engine.target.chain_source import NoDraft
from card.engine.target.verify import TargetState, proposal_holds
from tests.engine.support import VOCAB, assert_fits, chi_square, generate, plain_forward, target_model
from tests.tiny_models import sharpened, tiny_model

REJECTION = VerifyPolicy(Verify.REJECTION)
V = 12
PROMPT = [5, 17, 33, 2, 91, 40, 12]


# ---- the rule on fixed logits -------------------------------------------------------------------
class World:
    """Target logits at the first two positions (row 1 depends on token 0) and a draft that is
    near them but not equal, sparse (its top 4 at the request's temperature)."""

    def __init__(self, sampling: SamplingParams) -> None:
        g = torch.Generator().manual_seed(3)
        self.sampling = sampling
        self.p0 = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
        self.p1 = torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5  # [token 0, V]
        self.d0 = self.p0 + torch.randn(V, generator=g, dtype=torch.float64)
        self.d1 = self.p1 + torch.randn(V, V, generator=g, dtype=torch.float64)

    def q(self, draft_logits: torch.Tensor) -> tuple[list[int], list[float]]:
        top = torch.topk(draft_logits, 4)
        probs = torch.softmax(top.values / self.sampling.temperature, -1)
        return top.indices.tolist(), probs.tolist()

    def target(self) -> torch.Tensor:
        """p(t0, t1) [V * V]: what plain decoding commits at the two positions."""
        p0 = filtered_probs(self.p0, self.sampling)
        rows = torch.stack([filtered_probs(self.p1[t], self.sampling) for t in range(V)])
        return (p0[:, None] * rows).reshape(-1)

    def two_tokens(self, seed: int, rng: random.Random, chain_len: int = 2) -> tuple[int, int, int]:
        """Commit two tokens the way the engine does: step, and step again when a rejection
        ended the first after one token; returns (t0, t1, tokens kept from chains)."""
        sampling = SamplingParams(self.sampling.temperature, self.sampling.top_k, self.sampling.top_p, seed)
        state = TargetState([1, 2, 3], sampling, REJECTION)
        state.committed.append(7)  # the next token, committed by the prefill
        kept = 0
        while len(state.committed) < 6:
            t = len(state.committed) - 4  # index of the position the chain starts at
            chain, rows = [], []
            logits = [self.p0 if t == 0 else self.p1[state.committed[-1]]]
            for j in range(min(chain_len, 2 - t)):
                before = chain[-1] if chain else state.committed[-1]
                toks, probs = self.q(self.d0 if t + j == 0 else self.d1[before])
                chain.append(rng.choices(toks, probs)[0])
                rows.append((toks, probs))
                logits.append(self.p1[chain[-1]] if t + j == 0 else torch.zeros(V, dtype=torch.float64))
            accepted, _ = state.accept(chain, torch.stack(logits), Proposal.of_rows(rows) if chain else None)
            kept += accepted
        return state.committed[4], state.committed[5], kept

    def counts(self, trials: int) -> tuple[torch.Tensor, int]:
        counts = torch.zeros(V * V, dtype=torch.float64)
        rng = random.Random(11)
        kept = 0
        for seed in range(trials):
            t0, t1, k = self.two_tokens(seed, rng)
            counts[t0 * V + t1] += 1
            kept += k
        return counts, kept


def pooled(counts: torch.Tensor, probs: torch.Tensor, trials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cells expected below 5 times pooled into one (the chi-square needs it)."""
    small = (probs * trials < 5) & (probs > 0)
    keep = ~small
    c = torch.cat([counts[keep], counts[small].sum().view(1)])
    p = torch.cat([probs[keep], probs[small].sum().view(1)])
    return c, p


SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6),
             SamplingParams(temperature=1.3, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=repr)
def test_two_positions_follow_the_target_over_many_seeds(sampling: SamplingParams) -> None:
    world = World(sampling)
    trials = 5000
    counts, kept = world.counts(trials)
    assert kept > trials // 2, "drafted tokens were kept: the rule ran, not just the bonus draws"
    assert_fits(*pooled(counts, world.target(), trials))


def test_resampling_from_p_after_a_rejection_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the classic bug (after a rejection draw from p, not from max(0, p - q))
    over-weights the draft's tokens, and the test above sees it."""
    monkeypatch.setattr(verify_module, "residual", lambda p, tokens, q: p)
    world = World(SAMPLINGS[0])
    trials = 5000
    counts, _ = world.counts(trials)
    stat, df = chi_square(*pooled(counts, world.target(), trials))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_fits(*pooled(counts, world.target(), trials))
    assert stat > 3 * df, f"the control is not marginal: chi-square {stat:.0f} with {df} degrees of freedom"


def test_a_draft_equal_to_the_target_is_always_kept() -> None:
    """q == p (here: a one-hot-free p with all its mass on 4 tokens): every drafted token passes."""
    logits = torch.full((2, V), -1e9, dtype=torch.float64)
    logits[:, :4] = torch.tensor([2.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    sampling = SamplingParams(temperature=1.0)
    q = filtered_probs(logits[0], sampling)[:4].tolist()
    for seed in range(200):
        state = TargetState([1], SamplingParams(temperature=1.0, seed=seed), REJECTION)
        token = random.Random(seed).choices(range(4), q)[0]
        accepted, _ = state.accept([token], logits, Proposal.of_rows([(list(range(4)), q)]))
        assert accepted == 1


def test_a_proposal_that_does_not_hold_up_is_verified_exactly() -> None:
    chain = [3, 5]
    good = Proposal.of_rows([([3, 4], [0.5, 0.5]), ([5], [1.0])])
    assert proposal_holds(chain, good, 8)
    assert not proposal_holds(chain, good.head(1), 8), "a row short"
    assert not proposal_holds(chain, Proposal.of_rows([([3, 4], [0.5, 0.6]), ([5], [1.0])]), 8), "sums to 1.1"
    assert not proposal_holds(chain, Proposal.of_rows([([4, 6], [0.5, 0.5]), ([5], [1.0])]), 8), "3 not drawn"
    assert not proposal_holds(chain, Proposal.of_rows([([3, 4], [1.0, 0.0]), ([5, 6], [0.0, 1.0])]), 8)
    assert not proposal_holds(chain, Proposal.of_rows([([3, 99], [0.5, 0.5]), ([5], [1.0])]), 8), "past V"
    assert not proposal_holds(chain, good, 5), "the chain's own token 5 is past a vocabulary of 5"
    nan = Proposal.of_rows([([3, 4], [float("nan"), 0.5]), ([5], [1.0])])
    assert not proposal_holds(chain, nan, 8)
    # such a chain is judged by the exact rule: what plain decoding draws, token for token
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=g, dtype=torch.float64)
    for seed in range(50):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        state = TargetState([1], sampling, REJECTION)
        exact = TargetState([1], sampling, VerifyPolicy()).accept(chain, logits)
        assert state.accept(chain, logits, nan) == exact
        assert state.fallbacks == 1, "and the stats say so"


# ---- the draw ---------------------------------------------------------------------------------
def tree() -> TwoTierTree:
    """root -> C nodes 0 (token 10), 1 (token 11); node 0 -> C node 2 (token 20); tier B: the
    root's 10, 11, 12; node 0's 20, 21; node 2 unexpanded."""
    t = TwoTierTree()
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    root = t.root_id
    t.apply_layer(Layer(i64([root, root]), i64([0, 1]), i64([10, 11]), f32([-0.5, -1.2]),
                        i64([root] * 3), i64([10, 11, 12]), f32([-0.5, -1.2, -2.0])))
    t.apply_layer(Layer(i64([0]), i64([2]), i64([20]), f32([-0.3]),
                        i64([0, 0]), i64([20, 21]), f32([-0.3, -1.5])))
    return t


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_drawn_tokens_follow_tier_b_at_the_temperature(temperature: float) -> None:
    t = tree()
    rng = random.Random(5)
    root_q = torch.softmax(torch.tensor([-0.5, -1.2, -2.0], dtype=torch.float64) / temperature, -1)
    counts = torch.zeros(3, dtype=torch.float64)
    for _ in range(6000):
        chain = t.drawn_chain(8, temperature, rng)
        assert chain.proposal is not None and len(chain.proposal) == len(chain)
        assert torch.allclose(chain.proposal.probs[0, :3], root_q)
        assert proposal_holds(chain.tokens, chain.proposal, 32)
        first = chain.tokens[0]
        counts[[10, 11, 12].index(first)] += 1
        if first == 10:  # node 0: the draw goes on into its tier B
            assert chain.node_ids[0] == 0 and len(chain) == 2
            assert chain.node_ids[1] == (2 if chain.tokens[1] == 20 else NO_NODE)
        elif first == 11:  # node 1 is unexpanded: nothing below it to draw from
            assert chain.node_ids == (1,)
        else:  # a tier-B token: the last of the chain
            assert chain.node_ids == (NO_NODE,)
    assert_fits(counts, root_q)


def test_the_draw_stops_by_length_and_path_probability_before_drawing() -> None:
    t = tree()
    assert all(len(t.drawn_chain(1, 1.0, random.Random(s))) == 1 for s in range(20))
    assert len(t.drawn_chain(0, 1.0, random.Random(0))) == 0
    # the path probability is judged after each token: a first token is always drawn
    for s in range(50):
        chain = t.drawn_chain(8, 1.0, random.Random(s), min_path_prob=0.99)
        assert len(chain) == 1


def test_chain_draw_is_validated_and_only_sampled_rejection_requests_draw() -> None:
    with pytest.raises(InvalidArgument):
        ChainDraw(0.0)
    with pytest.raises(InvalidArgument):
        ChainDraw(float("nan"))
    sampled = SamplingParams(temperature=0.8, seed=4)
    assert GenerationRequest((1,), sampled, verify=REJECTION).chain_draw == ChainDraw(0.8, 4)
    assert GenerationRequest((1,), SamplingParams(), verify=REJECTION).chain_draw is None
    assert GenerationRequest((1,), sampled).chain_draw is None
    assert REJECTION.effective(SamplingParams()) is Verify.EXACT
    assert REJECTION.effective(sampled) is Verify.REJECTION


# ---- generations ------------------------------------------------------------------------------
TREE = TreeParams(width=3, branch=6, max_depth=3, max_chain=3)


@functools.cache
def near_draft() -> torch.nn.Module:
    """The sharpened target with noise 0.005 on its weights: near enough that drafted tokens are
    often kept (about half of them under rejection, a third under exact), far enough that the
    residual draw after a rejection is exercised as often."""
    return sharpened(tiny_model("llama", seed=0, vocab=VOCAB, perturb=0.005))


def rejection_run(draft: torch.nn.Module, sampling: SamplingParams, n: int, verify: VerifyPolicy = REJECTION):
    request = GenerationRequest(tuple(PROMPT), sampling, verify=verify)
    source = SyncDraft(draft, kv_len=128, draw=request.chain_draw, tree=TREE)
    return generate(target_model("llama", sharp=True), source, PROMPT, max_new_tokens=n, sampling=sampling,
                    verify=verify)


def test_greedy_rejection_is_plain_decoding() -> None:
    target, draft = target_model("llama", sharp=True), near_draft()
    want = generate(target, NoDraft(), PROMPT, max_new_tokens=16)
    got = rejection_run(draft, SamplingParams(), 16)
    assert got.tokens == want.tokens
    assert got.result.stats.verify == "exact" and got.result.stats.token_exact


def test_a_generation_follows_the_target_over_many_seeds() -> None:
    """The first two new tokens of a real generation (draft-then-verify on a tree, drawn chains):
    the second is the first judged by the rule."""
    target, draft = target_model("llama", sharp=True), near_draft()
    sampling = SamplingParams(temperature=1.0, top_k=8)
    logits, _ = plain_forward(target, PROMPT)
    p0 = filtered_probs(logits[-1], sampling)
    rows: dict[int, torch.Tensor] = {}
    counts: dict[tuple[int, int], int] = {}
    trials, kept = 700, 0
    for seed in range(trials):
        run = rejection_run(draft, SamplingParams(1.0, 8, 1.0, seed), 3)  # 2 would verify no chain
        pair = tuple(run.tokens[:2])
        counts[pair] = counts.get(pair, 0) + 1
        kept += run.result.stats.accepted_draft_tokens
        assert run.result.stats.verify == "rejection" and not run.result.stats.token_exact
    for t0 in {t for t, _ in counts}:
        rows[t0] = filtered_probs(plain_forward(target, [*PROMPT, t0])[0][-1], sampling)
    cells = sorted({(t0, t1) for t0 in rows for t1 in range(len(p0)) if p0[t0] * rows[t0][t1] > 0})
    probs = torch.tensor([float(p0[a] * rows[a][b]) for a, b in cells], dtype=torch.float64)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    assert sum(counts.values()) == observed.sum(), "a token pair outside the target's support"
    rest = 1 - float(probs.sum())  # first tokens never drawn: their whole row in one cell
    probs, observed = torch.cat([probs, torch.tensor([rest])]), torch.cat([observed, torch.zeros(1)])
    assert kept > trials // 4
    assert_fits(*pooled(observed, probs, trials))


def test_rejection_keeps_more_drafted_tokens_than_exact() -> None:
    draft = near_draft()
    rates = {}
    for policy in (VerifyPolicy(), REJECTION):
        drafted = accepted = 0
        for seed in range(6):
            stats = rejection_run(draft, SamplingParams(1.0, 0, 1.0, seed), 24, policy).result.stats
            drafted, accepted = drafted + stats.draft_tokens, accepted + stats.accepted_draft_tokens
        rates[policy.mode] = accepted / drafted
    assert rates[Verify.REJECTION] > 1.2 * rates[Verify.EXACT], rates
