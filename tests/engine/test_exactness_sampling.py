"""Seeded sampling (DESIGN.md §5): the token at committed position t is drawn with a uniform keyed
by (seed, t), so vanilla, sd and card with the same seed commit the same tokens; and the draws
follow the target's (temperature, top-k, top-p)-filtered softmax.

Models here are sharpened (peaked distributions) so that sampled runs actually accept drafted
tokens and the sampled verification path is exercised, not just the first-token one.
"""

from __future__ import annotations

import math

import pytest
import torch

from card.engine.inprocess.sources import SyncDraft
from card.engine.shared.config import SamplingParams, TreeParams
from card.engine.shared.sampling import position_uniform, select_token
from card.engine.target.chain_source import NoDraft
from tests.engine.support import assert_fits, card_source, draft_model, generate, plain_forward, target_model

SAMPLINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=8),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.8),
]
PROMPT = [5, 17, 33, 2, 91, 40, 12]


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_k, params.top_p, seed)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution, written independently of card.engine.shared.sampling: temperature, then the
    k most likely tokens, then the smallest most-likely set whose mass reaches top_p."""
    probs = torch.softmax(logits.double() / params.temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[: params.top_k] if params.top_k else order
    mass = sum(float(probs[i]) for i in keep)
    nucleus, acc = [], 0.0
    for i in keep:
        nucleus.append(i)
        acc += float(probs[i]) / mass
        if acc >= params.top_p - 1e-12:
            break
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    return out / out.sum()




# ---- the sampler on fixed logits -----------------------------------------------------------------
@pytest.mark.parametrize("params", [*SAMPLINGS, SamplingParams(temperature=1.0)], ids=repr)
def test_select_token_follows_the_filtered_softmax(params: SamplingParams) -> None:
    logits = torch.randn(24, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5
    probs = reference_probs(logits, params)
    counts = torch.zeros(24, dtype=torch.float64)
    for i in range(4000):
        # vary both the seed and the position, as generations do
        token = select_token(logits, position=i % 50, params=with_seed(params, i // 50))
        counts[token] += 1
    assert_fits(counts, probs)


def test_wrong_temperature_fails_the_fit() -> None:
    """The statistical check has teeth: draws at temperature 1.0 do not fit the 0.7 distribution."""
    logits = torch.randn(24, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5
    counts = torch.zeros(24, dtype=torch.float64)
    for i in range(4000):
        counts[select_token(logits, i % 50, SamplingParams(temperature=1.0, seed=i // 50))] += 1
    with pytest.raises(AssertionError, match="chi-square"):
        assert_fits(counts, reference_probs(logits, SamplingParams(temperature=0.7)))


def test_position_uniform_is_uniform_and_keyed_by_seed_and_position() -> None:
    u = torch.tensor([position_uniform(s, p) for s in range(80) for p in range(50)], dtype=torch.float64)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Kolmogorov-Smirnov distance against U(0, 1); 1.95 / sqrt(n) is the 0.1% critical value
    ks = float((torch.sort(u).values - torch.arange(1, u.numel() + 1) / u.numel()).abs().max())
    assert ks < 1.95 / math.sqrt(u.numel())
    assert position_uniform(1, 7) == position_uniform(1, 7)
    assert len({position_uniform(1, p) for p in range(100)} | {position_uniform(2, 0)}) == 101


def test_greedy_ignores_the_seed() -> None:
    logits = torch.randn(30, generator=torch.Generator().manual_seed(4))
    assert {select_token(logits, p, SamplingParams(seed=s)) for s in range(5) for p in range(5)} == {
        int(torch.argmax(logits))
    }


# ---- generations ---------------------------------------------------------------------------------
def test_first_token_over_many_seeds_follows_the_target() -> None:
    """Vanilla's first sampled token over 1000 seeds fits the target's filtered softmax, and each
    one is the draw at committed position len(prompt)."""
    model = target_model("llama", sharp=True)
    params = SamplingParams(temperature=1.0, top_k=12)
    logits, _ = plain_forward(model, PROMPT)
    probs = reference_probs(logits[-1], params)
    counts = torch.zeros_like(probs)
    for seed in range(1000):
        run = generate(model, NoDraft(), PROMPT, max_new_tokens=1, sampling=with_seed(params, seed))
        (token,) = run.tokens
        counts[token] += 1
        if seed < 20:
            assert token == select_token(logits[-1], len(PROMPT), with_seed(params, seed))
    assert_fits(counts, probs)


MODE_CASES = [
    *((kind, "self", i) for kind in ("llama", "qwen2") for i in range(len(SAMPLINGS))),
    ("llama", "perturbed", 0), ("llama", "perturbed", 3),
    ("qwen2", "perturbed", 1), ("qwen2", "perturbed", 2),
]


@pytest.mark.parametrize(("kind", "draft_name", "which"), MODE_CASES)
def test_same_seed_same_tokens_in_every_mode(kind: str, draft_name: str, which: int) -> None:
    target = target_model(kind, sharp=True)
    draft = draft_model(kind, draft_name, sharp=True)
    sampling = with_seed(SAMPLINGS[which], 11 + which)
    want = generate(target, NoDraft(), PROMPT, max_new_tokens=30, sampling=sampling)
    assert len(want.tokens) == 30
    sd = generate(target, SyncDraft(draft, 3), PROMPT, max_new_tokens=30, sampling=sampling)
    assert sd.tokens == want.tokens, "sd"
    with card_source(draft, TreeParams(width=4, max_depth=5, max_chain=3), lockstep_depth=4) as card:
        got = generate(target, card, PROMPT, max_new_tokens=30, sampling=sampling)
    assert got.tokens == want.tokens, "card"
    if draft_name == "self":
        # drafted tokens were accepted, so the sampled verification path ran, not just one draw
        assert sd.result.stats.target_forwards < 25 and got.result.stats.target_forwards < 25
        assert got.result.stats.hits > 0


def test_different_seeds_give_different_tokens() -> None:
    target = target_model("llama", sharp=True)
    outs = {
        tuple(generate(target, NoDraft(), PROMPT, max_new_tokens=30,
                       sampling=SamplingParams(temperature=1.0, seed=s)).tokens)
        for s in range(8)
    }
    assert len(outs) == 8


# ---- temperatures too small to divide by ---------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-6])
def test_a_vanishing_temperature_samples_greedily_in_every_mode(temperature: float) -> None:
    """Below SAMPLING_EPS a temperature is greedy: the output equals greedy decoding's in vanilla,
    sd and card (whatever the seed), never a run of one token drawn from NaN probabilities."""
    from card.engine.shared.sampling import filtered_probs

    target = target_model("llama")
    greedy = generate(target, NoDraft(), PROMPT, max_new_tokens=24).tokens
    tiny = SamplingParams(temperature=temperature, seed=5)
    assert tiny.greedy
    assert generate(target, NoDraft(), PROMPT, max_new_tokens=24, sampling=tiny).tokens == greedy
    assert generate(target, SyncDraft(target, 3), PROMPT, max_new_tokens=24, sampling=tiny).tokens == greedy
    with card_source(target, TreeParams(width=2, max_depth=4, max_chain=3), lockstep_depth=3) as card:
        assert generate(target, card, PROMPT, max_new_tokens=24, sampling=tiny).tokens == greedy
    assert len(set(greedy)) > 3, "the greedy output is not a constant token"
    logits, _ = plain_forward(target, PROMPT)
    probs = filtered_probs(logits[-1], tiny)
    assert torch.isfinite(probs).all() and int(torch.argmax(probs)) == greedy[0] and float(probs.sum()) == 1.0


def test_dividing_by_a_vanishing_temperature_gives_nan_which_is_why_it_is_greedy() -> None:
    """Negative control: the plain temperature scaling (what filtered_probs did for any temperature
    above 0) overflows at 1e-320 and its softmax is NaN; at SAMPLING_EPS it is still finite."""
    from card.engine.shared.config import SAMPLING_EPS

    logits, _ = plain_forward(target_model("llama"), PROMPT)
    scaled = logits[-1].double() / 1e-320
    assert not torch.isfinite(scaled).all()
    assert torch.isnan(torch.softmax(scaled, -1)).any()
    at_eps = torch.softmax(logits[-1].double() / SAMPLING_EPS, -1)
    assert torch.isfinite(at_eps).all() and not SamplingParams(temperature=SAMPLING_EPS).greedy
