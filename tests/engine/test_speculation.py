"""The speculation budget: chains cut by measured cost and each generation's acceptance."""

from __future__ import annotations

from card.engine.target.speculation import Acceptance, CostModel, chain_lengths


def test_cost_model_fits_a_line_and_waits_for_varied_sizes() -> None:
    cost = CostModel()
    for _ in range(5):
        cost.observe(8, 0.05)
    assert cost.fit() is None  # every forward the same size: no slope to see
    for rows in (1, 4, 16, 32):
        cost.observe(rows, 0.04 + 0.002 * rows)
    a, b = cost.fit()
    assert abs(b - 0.002) < 2e-4 and abs(a - 0.04) < 5e-3


def test_acceptance_follows_what_the_target_accepts() -> None:
    good, bad = Acceptance(), Acceptance()
    for _ in range(30):
        good.observe(offered=6, accepted=5)
        bad.observe(offered=6, accepted=0)
    assert good.alpha > 0.8 and bad.alpha < 0.1
    before = good.alpha
    good.observe(offered=0, accepted=0)  # nothing offered: nothing learned
    assert good.alpha == before


def test_alone_a_useful_chain_is_verified_whole() -> None:
    # one generation, a forward of 40 ms + 2 ms per row, acceptance 0.7
    assert chain_lengths([6], [0.7], fixed_rows=1, cost=(0.04, 0.002)) == [6]


def test_under_load_only_the_likeliest_rows_are_verified() -> None:
    alphas = [0.9, 0.5, 0.1, 0.5, 0.5, 0.5, 0.5, 0.5]
    lengths = chain_lengths([6] * 8, alphas, fixed_rows=8, cost=(0.04, 0.003))
    assert lengths[0] > lengths[1] > lengths[2] == 0  # the surest draft gets the longest chain
    assert sum(lengths) < 48
    # rows that cost nothing are all verified; unmeasured cost verifies what is offered
    assert chain_lengths([6] * 8, alphas, fixed_rows=8, cost=(0.04, 0.0)) == [6] * 8
    assert chain_lengths([3, 0, 5], [0.1, 0.9, 0.1], fixed_rows=3, cost=None) == [3, 0, 5]


def test_the_rule_maximises_expected_tokens_per_second() -> None:
    """Brute force over every cut of two chains: the greedy answer is the best one."""
    import itertools

    alphas, avail, a, b, fixed = [0.8, 0.4], [4, 4], 0.03, 0.01, 2
    def rate(ks):
        tokens = len(ks) + sum(alphas[i] ** j for i, k in enumerate(ks) for j in range(1, k + 1))
        return tokens / (a + b * (fixed + sum(ks)))
    best = max(itertools.product(range(5), range(5)), key=rate)
    assert rate(chain_lengths(avail, alphas, fixed, (a, b))) == rate(best)
