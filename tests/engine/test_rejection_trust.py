"""verify rejection against a lying draft (engine.target.verify, the rule on fixed logits).

The rule divides by the q the draft claims; a compromised draft marks its favourite token drawn
and claims q = e^-600, and the classic rule (``c * q(x) < p(x)``) keeps it whatever p says. With
the server's settings (card-target: a floor on q, coins from a per-request secret):

- an honest draft's output still follows p exactly (chi-square over many seeds), the floor's
  own path (a draw below it) exercised;
- the e^-600 lie is harmless: the output fits p, where the classic rule (the negative control)
  emits the liar's token nearly every time;
- the best lie the floor still lets through (q(x) = f exactly) raises a token's probability, but
  never past the documented bound 2 p / f;
- a request verified exactly (card-target's default for rejection requests) ignores any
  proposal: plain decoding's tokens, seed for seed;
- secret coins differ per request, and are not the seed's (a draft that knows the seed, or that
  every unseeded request has seed 0, cannot predict them).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from card.engine.shared.config import SamplingParams, Verify, VerifyPolicy
from card.engine.shared.sampling import filtered_probs, position_uniform, private_seed
from card.engine.shared.tree import Proposal
from card.engine.target.verify import TargetState
from tests.engine.support import assert_fits, chi_square

V = 12
SAMPLING = SamplingParams(temperature=1.0)
TRIALS = 4000
FLOOR = 0.01  # card-target's default --rejection-q-floor
SERVED = VerifyPolicy(Verify.REJECTION, q_floor=FLOOR, secret_coins=True)  # --allow-rejection
CLASSIC = VerifyPolicy(Verify.REJECTION)  # no floor, the seed's coins: the negative control

# a draft's move: (its chain, the proposal it claims), drawn with the test's generator
Move = Callable[[random.Random], tuple[list[int], Proposal]]


def target_logits() -> torch.Tensor:
    """Logits [2, V] of [next token, chain token]: row 0 judges the chain's token; p has a
    likely head and a tail (the smallest entry well under 1 %, the liar's favourite)."""
    g = torch.Generator().manual_seed(7)
    row = torch.randn(V, generator=g, dtype=torch.float64) * 1.6
    return torch.stack([row, torch.zeros(V, dtype=torch.float64)])


LOGITS = target_logits()
P = filtered_probs(LOGITS[0], SAMPLING)
FAVOURITE = int(torch.argmin(P))  # the token the target likes least


def first_tokens(policy: VerifyPolicy | Callable[[list[int], Proposal], VerifyPolicy], move: Move,
                 trials: int = TRIALS) -> torch.Tensor:
    """Counts [V] of the token committed at the chain's position, one request per seed
    (``policy``: or the rule for each chain, chosen after it was drawn)."""
    counts = torch.zeros(V, dtype=torch.float64)
    rng = random.Random(13)
    for seed in range(trials):
        chain, proposal = move(rng)
        rule = policy if isinstance(policy, VerifyPolicy) else policy(chain, proposal)
        state = TargetState([1, 2, 3], SamplingParams(SAMPLING.temperature, seed=seed), rule)
        state.committed.append(7)  # the next token, committed by the prefill
        state.accept(chain, LOGITS, proposal)
        counts[state.committed[4]] += 1
    return counts


def _honest_row() -> tuple[list[int], list[float]]:
    d = LOGITS[0] + torch.randn(V, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.8
    top = torch.topk(d, 8)
    return top.indices.tolist(), torch.softmax(top.values * 1.5, -1).tolist()


HONEST_ROW = _honest_row()


def honest(rng: random.Random) -> tuple[list[int], Proposal]:
    """A draft near the target, its q over 8 tokens with a tail below the floor, x ~ q."""
    toks, q = HONEST_ROW
    return [rng.choices(toks, q)[0]], Proposal.of_rows([HONEST_ROW])


def e600_lie(rng: random.Random) -> tuple[list[int], Proposal]:
    """The lie of the issue: the favourite marked drawn with q = e^-600, the row's mass elsewhere."""
    others = [t for t in range(V) if t != FAVOURITE][:3]
    tiny = math.exp(-600)
    return [FAVOURITE], Proposal.of_rows([([FAVOURITE, *others], [tiny, *[(1 - tiny) / 3] * 3])])


def floor_lie(rng: random.Random) -> tuple[list[int], Proposal]:
    """The best lie the floor lets through: the favourite drawn with q exactly the floor, the rest
    of the row spread over the likely tokens (whose residual then cannot hold the favourite)."""
    rest = [t for t in range(V) if t != FAVOURITE and float(P[t]) >= FLOOR]
    weights = [float(P[t]) for t in rest]
    scale = (1 - FLOOR) / sum(weights)
    return [FAVOURITE], Proposal.of_rows([([FAVOURITE, *rest], [FLOOR, *[w * scale for w in weights]])])


HONEST_FLOOR = 0.1  # one the honest row often meets: every term of the floored rule is in play


def test_an_honest_draft_under_the_floor_still_follows_the_target() -> None:
    policy = VerifyPolicy(Verify.REJECTION, q_floor=HONEST_FLOOR, secret_coins=True)
    below = sum(w for w in HONEST_ROW[1] if w < HONEST_FLOOR)
    assert 0.1 < below < 0.5, f"the honest row's mass below the floor: {below:.3f}"
    assert_fits(first_tokens(policy, honest), P)


def test_negative_control_a_naive_floor_skews_an_honest_draft() -> None:
    """The floor as first proposed: a draw below it sends its chain to exact verification, the
    rest to the classic rule. Whether a chain is judged by the rule then depends on its token's
    own value, and the output leaves p (the floored rule above rescales and stays exact); the
    test above sees such a skew."""
    def naive(chain: list[int], proposal: Proposal) -> VerifyPolicy:
        q_x = float(proposal.probs[0][proposal.tokens[0] == chain[0]].sum())
        return VerifyPolicy() if q_x < HONEST_FLOOR else CLASSIC

    counts = first_tokens(naive, honest)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_fits(counts, P)
    stat, df = chi_square(counts, P)
    assert stat > 3 * df, f"the control is not marginal: chi-square {stat:.0f} with {df} degrees of freedom"


def test_a_lie_of_q_e600_cannot_choose_the_token() -> None:
    assert float(P[FAVOURITE]) < 0.01, "the favourite is a token the target rarely emits"
    assert_fits(first_tokens(SERVED, e600_lie), P)


def test_negative_control_the_classic_rule_emits_the_liars_token() -> None:
    counts = first_tokens(CLASSIC, e600_lie)
    assert counts[FAVOURITE] > 0.95 * TRIALS, "the lie is kept whatever p says"
    stat, df = chi_square(counts, P)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_fits(counts, P)
    assert stat > 100 * df, f"chi-square {stat:.0f} with {df} degrees of freedom"


def test_the_best_lie_past_the_floor_is_bounded_by_2p_over_the_floor() -> None:
    """What the docs promise with rejection allowed: a liar can skew sampled output, but a token
    comes out with probability at most 2 p / f. Here it gets p / f (the keep path; the residual
    cannot hold it), far above p and within the bound."""
    counts = first_tokens(SERVED, floor_lie)
    share, p = float(counts[FAVOURITE]) / TRIALS, float(P[FAVOURITE])
    sd = math.sqrt(p / FLOOR * (1 - p / FLOOR) / TRIALS)
    assert share <= 2 * p / FLOOR + 4 * sd, (share, p)
    assert abs(share - p / FLOOR) < 4 * sd + 1e-3, (share, p / FLOOR)
    assert share > 5 * p, "the lie does skew: the bound, not losslessness, is the promise"


@pytest.mark.parametrize("move", [honest, e600_lie, floor_lie], ids=lambda m: m.__name__)
def test_an_exact_request_ignores_every_proposal(move: Move) -> None:
    """card-target verifies rejection requests exactly unless --allow-rejection: plain
    decoding's token for each seed, whatever the draft claims."""
    rng = random.Random(5)
    for seed in range(300):
        sampling = SamplingParams(SAMPLING.temperature, seed=seed)
        state = TargetState([1, 2, 3, 7], sampling, VerifyPolicy())
        chain, proposal = move(rng)
        state.accept(chain, LOGITS, proposal)
        plain = TargetState([1, 2, 3, 7], sampling, VerifyPolicy())
        plain.accept([], LOGITS[:1])
        assert state.committed[4] == plain.committed[4]


def test_secret_coins_are_per_request_and_not_the_seeds() -> None:
    a, b = (TargetState([1], SamplingParams(1.0, seed=0), SERVED) for _ in range(2))
    seeded = TargetState([1], SamplingParams(1.0, seed=0), CLASSIC)
    assert seeded._coin_key == 0  # in process: the seed's coins (reproducible)
    assert a._coin_key != b._coin_key
    coins = [position_uniform(a._coin_key, t, stream=1) for t in range(8)]
    assert coins != [position_uniform(0, t, stream=1) for t in range(8)]
    seeds = {private_seed() for _ in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**63 for s in seeds)
