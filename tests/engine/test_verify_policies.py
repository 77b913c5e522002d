"""Acceptance rules and logprobs (engine.target.verify).

- logprobs: the target's own log-probabilities of each committed token, the same in every mode
  (vanilla, sd, card), greedy and seeded, and the ones a plain forward gives;
- ``loose`` (FLy): the rule on hand-made logits (a mismatch kept only behind its window and above
  the entropy gate), equal to ``exact`` with its gate closed, lossy and faster with it open.
"""

from __future__ import annotations

import math

import pytest
import torch

from card.engine.inprocess.sources import SyncDraft
from card.engine.shared.config import GenerationRequest, SamplingParams, TreeParams, Verify, VerifyPolicy
from card.engine.shared.errors import InvalidArgument
from card.engine.target.chain_source import NoDraft
from card.engine.target.verify import TargetState, top3_entropy
from tests.engine.support import card_source, draft_model, generate, plain_forward, target_model

PROMPT = [5, 17, 33, 2, 91, 40, 12]
V = 16
LOOSE = VerifyPolicy(Verify.LOOSE)


# ---- logprobs ------------------------------------------------------------------------------------
def _close(a: list, b: list) -> None:
    assert [lp.token for lp in a] == [lp.token for lp in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) <= 1e-5, (x, y)
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert all(abs(u - v) <= 1e-5 for (_, u), (_, v) in zip(x.top, y.top, strict=True))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=12, seed=7)],
                         ids=["greedy", "seeded"])
def test_logprobs_are_the_same_in_every_mode(sampling: SamplingParams) -> None:
    target, draft = target_model("llama", sharp=True), draft_model("llama", "perturbed", sharp=True)
    want = generate(target, NoDraft(), PROMPT, max_new_tokens=24, sampling=sampling, logprobs=5)
    assert len(want.result.logprobs) == 24 and all(len(lp.top) == 5 for lp in want.result.logprobs)
    assert [lp.token for lp in want.result.logprobs] == want.tokens
    sd = generate(target, SyncDraft(draft, 3), PROMPT, max_new_tokens=24, sampling=sampling, logprobs=5)
    with card_source(draft, TreeParams(width=3, max_depth=5, max_chain=4), lockstep_depth=4) as card:
        got = generate(target, card, PROMPT, max_new_tokens=24, sampling=sampling, logprobs=5)
    assert got.result.stats.accepted_draft_tokens > 0, "the chains were verified, not just one row"
    assert sd.tokens == want.tokens and got.tokens == want.tokens
    _close(sd.result.logprobs, want.result.logprobs)
    _close(got.result.logprobs, want.result.logprobs)


def test_greedy_logprobs_are_a_plain_forwards_log_softmax() -> None:
    target = target_model("qwen2")
    run = generate(target, NoDraft(), PROMPT, max_new_tokens=6, logprobs=3)
    logits, _ = plain_forward(target, PROMPT + run.tokens)
    ref = torch.log_softmax(logits.double(), -1)[len(PROMPT) - 1:-1]
    for row, lp in zip(ref, run.result.logprobs, strict=True):
        assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-5)
        assert [i for i, _ in lp.top] == torch.topk(row, 3).indices.tolist()
        assert lp.top[0][0] == lp.token  # greedy: the chosen token is the likeliest


def test_sampled_logprobs_are_of_the_filtered_distribution() -> None:
    """top_k 3: the alternatives are the three kept tokens and they sum to probability 1."""
    run = generate(target_model("llama"), NoDraft(), PROMPT, max_new_tokens=5, logprobs=8,
                   sampling=SamplingParams(temperature=0.9, top_k=3, seed=1))
    for lp in run.result.logprobs:
        assert len(lp.top) == 3 and math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, abs_tol=1e-9)


def test_no_logprobs_unless_asked_and_the_bound_is_checked() -> None:
    assert generate(target_model("llama"), NoDraft(), PROMPT, max_new_tokens=3).result.logprobs == []
    with pytest.raises(InvalidArgument, match="logprobs"):
        GenerationRequest((1,), logprobs=21)


# ---- the loose rule on hand-made logits ----------------------------------------------------------
def _logits(picks: list[int], unsure: set[int] = frozenset()) -> torch.Tensor:
    """Rows whose argmax is ``picks[j]``; rows in ``unsure`` spread their mass over three tokens
    (top-3 entropy ~1.0 nats), the others are nearly certain (~0.0)."""
    rows = torch.full((len(picks), V), -20.0, dtype=torch.float64)
    for j, p in enumerate(picks):
        rows[j, p] = 0.0
        if j in unsure:
            rows[j, (p + 1) % V] = rows[j, (p + 2) % V] = -0.1
    return rows


def _accept(policy: VerifyPolicy, chain: list[int], logits: torch.Tensor) -> tuple[int, int, int]:
    state = TargetState([1, 2, 3], SamplingParams(), policy)
    n, token = state.accept(chain, logits)
    return n, token, state.loose_kept


def test_the_loose_rule_keeps_a_mismatch_only_behind_a_full_window_above_the_gate() -> None:
    policy = VerifyPolicy(Verify.LOOSE, entropy_threshold=0.3, window=3)
    chain = [9, 4, 5, 6, 7, 8]  # the target would say 3 at 0, then agrees with the chain
    picks = [3, 4, 5, 6, 7, 8, 10]
    assert top3_entropy(_logits(picks, {0}))[0] > 0.9 and top3_entropy(_logits(picks))[0] < 0.01
    assert _accept(policy, chain, _logits(picks, {0})) == (6, 10, 1)  # kept: unsure, then agreed
    assert _accept(VerifyPolicy(), chain, _logits(picks, {0})) == (0, 3, 0)  # control: exact
    assert _accept(policy, chain, _logits(picks)) == (0, 3, 0)  # sure there: the gate refuses
    broken = [3, 4, 0, 6, 7, 8, 10]  # the target disagrees again inside the window
    assert _accept(policy, chain, _logits(broken, {0})) == (0, 3, 0)
    late = [9, 4, 5, 2, 7, 8, 10]  # a mismatch at 3, among the chain's last W = 3: not judged
    assert _accept(policy, chain, _logits(late, {3})) == (3, 2, 0)
    assert _accept(policy, chain[:3], _logits(picks[:4], {0})) == (0, 3, 0)  # no room for a window


def test_a_kept_token_outside_top_k_has_a_finite_logprob() -> None:
    """Only loose can keep a drafted token the sampling filters give no mass: its logprob reads
    LOGPROB_FLOOR (JSON has no -inf), its alternatives are the tokens top-k keeps."""
    from card.engine.target.verify import LOGPROB_FLOOR

    sampling = SamplingParams(temperature=1.0, top_k=2, seed=0)
    state = TargetState([1, 2, 3], sampling, VerifyPolicy(Verify.LOOSE, 0.0, 2), logprobs=2)
    picks = [3, 4, 5, 6]
    logits = _logits(picks, {0})  # the target is unsure at 0 and agrees after it
    chain = [9, 4, 5]  # 9 is outside top-2 at row 0
    n, _ = state.accept(chain, logits)
    first = state.take_logprobs()[0]
    assert n >= 1 and first.token == 9 and first.logprob == LOGPROB_FLOOR
    assert all(t != 9 and v > LOGPROB_FLOOR for t, v in first.top)


def test_loose_settings_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="window"):
        VerifyPolicy(Verify.LOOSE, window=1)
    with pytest.raises(InvalidArgument, match="entropy"):
        VerifyPolicy(Verify.LOOSE, entropy_threshold=float("nan"))
    with pytest.raises(InvalidArgument, match="verify must be one of"):
        Verify.parse("lossy")
    assert Verify.parse("") is Verify.EXACT and not VerifyPolicy().lossy and LOOSE.lossy


# ---- loose generations ---------------------------------------------------------------------------
def _card_run(policy: VerifyPolicy, sampling: SamplingParams | None = None):
    target, draft = target_model("qwen2"), draft_model("qwen2", "perturbed")
    with card_source(draft, TreeParams(width=2, max_depth=10, max_chain=9), lockstep_depth=9) as card:
        return generate(target, card, PROMPT, max_new_tokens=60, sampling=sampling, verify=policy)


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.9, seed=3)],
                         ids=["greedy", "seeded"])
def test_loose_with_its_gate_closed_is_exact(sampling: SamplingParams | None) -> None:
    """Top-3 entropy never exceeds 3/e nats: a threshold of 2 never opens the gate."""
    want = generate(target_model("qwen2"), NoDraft(), PROMPT, max_new_tokens=60, sampling=sampling)
    closed = _card_run(VerifyPolicy(Verify.LOOSE, entropy_threshold=2.0, window=2), sampling)
    assert closed.tokens == want.tokens and closed.result.stats.loose_kept == 0


def test_loose_with_its_gate_open_keeps_mismatches_and_says_it_is_lossy() -> None:
    want = generate(target_model("qwen2"), NoDraft(), PROMPT, max_new_tokens=60)
    exact = _card_run(VerifyPolicy())
    loose = _card_run(VerifyPolicy(Verify.LOOSE, entropy_threshold=0.0, window=2))
    assert exact.tokens == want.tokens and not exact.result.stats.lossy
    stats = loose.result.stats
    assert stats.lossy and stats.verify == "loose" and stats.loose_kept > 0
    assert loose.tokens != want.tokens, "a kept mismatch changes the text"
    assert stats.accepted_draft_tokens / stats.draft_tokens > \
        exact.result.stats.accepted_draft_tokens / exact.result.stats.draft_tokens
    assert "LOSSY" in stats.summary()


def test_the_acceptance_counters_add_up() -> None:
    stats = _card_run(VerifyPolicy()).result.stats
    hist = stats.acceptance_histogram
    assert sum(hist) == stats.spec_steps > 0
    assert sum(j * c for j, c in enumerate(hist)) == stats.accepted_draft_tokens <= stats.draft_tokens
    # every token came from a prefill, a kept drafted token or the target's own after a step
    assert stats.new_tokens == stats.accepted_draft_tokens + stats.target_forwards
