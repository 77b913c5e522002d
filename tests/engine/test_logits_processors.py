"""The request's logits processors (min_p, repetition / presence / frequency penalties,
logit_bias, min_tokens; engine.target.logits_processors): each one against a hand computation,
and card (and sd) equal to plain decoding token for token with them, greedy and seeded, alone and
8 in flight (on the eager forward and on the static step, whose device argmax a processed request
must not use). Negative controls: the same comparisons fail when a verification's row j is
processed without ``chain[:j]`` in its context, when verification skips the processors, or when a
greedy request reads the model's own argmax.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.inprocess.sources import SyncDraft
from card.engine.loading.invariant import make_exact
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    GenerationRequest,
    Mode,
    SamplingParams,
    StopParams,
    TreeParams,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.sampling import filtered_probs
from card.engine.shared.session import StepResult
from card.engine.shared.tree import Chain, Correction
from card.engine.target.chain_source import ChainSource, NoDraft
from card.engine.target.generation import Generation
from card.engine.target.logits_processors import LogitsProcessors, ProcessedRows
from card.engine.target.scheduler import TargetEngine, finish_alone
from card.engine.target.verify import TargetState
from tests.engine.support import (
    VOCAB,
    LetterTokenizer,
    card_source,
    generate,
    letters,
    prompt_cases,
    run_batched,
    target_model,
)
from tests.tiny_models import tiny_model

PROMPT = [5, 17, 33, 2, 91, 40, 12]
INF = float("inf")


# ---- each processor against a hand computation ----------------------------------------------------
def _row() -> torch.Tensor:
    return torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0, 0.0, 1.5, -0.25], dtype=torch.float64)


def _processed(params: SamplingParams, prompt: list[int], output: list[int], prefix: list[int] = (),
               ending: tuple[int, ...] = ()) -> list[float]:
    procs = LogitsProcessors(params, prompt, ending)
    procs.commit(output)
    return procs.process(_row(), list(prefix)).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    # seen: prompt {0, 1} and output {3}; token 4 (positive) and 6 are never seen
    got = _processed(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3])
    assert got == [1.0, -2.0, 0.5, -6.0, 4.0, 0.0, 1.5, -0.25]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 is in the prompt only: untouched; 3 twice in the output, 4 once
    got = _processed(params, prompt=[0], output=[3, 4, 3])
    want = _row().tolist()
    want[3] = -3.0 - 0.5 * 2 - 0.25
    want[4] = 4.0 - 0.5 * 1 - 0.25
    assert got == want


def test_logit_bias_is_added() -> None:
    got = _processed(SamplingParams(logit_bias=((1, 3.0), (6, -100.0))), prompt=[0], output=[])
    want = _row().tolist()
    want[1], want[6] = -1.0 + 3.0, 1.5 - 100.0
    assert got == want


def test_min_tokens_holds_the_ending_tokens_back_counting_the_chain_prefix() -> None:
    params = SamplingParams(min_tokens=3)
    held = _row().tolist()
    held[4] = held[7] = -INF
    # 2 output tokens committed: the next one is the 3rd, still held
    assert _processed(params, [0], [1, 2], ending=(4, 7)) == held
    # committed 1 + a chain prefix of 1 = 2 before the row: held; + a prefix of 2 = 3: free
    assert _processed(params, [0], [1], prefix=[5], ending=(4, 7)) == held
    assert _processed(params, [0], [1], prefix=[5, 6], ending=(4, 7)) == _row().tolist()
    # an ending id past the vocabulary (a tokenizer may list one) is ignored, not an index error
    assert _processed(params, [0], [], ending=(4, 99))[4] == -INF


def test_the_order_is_vllms_bias_then_penalties() -> None:
    """min_tokens, logit_bias, then repetition (the bias can flip a logit's sign, so the order
    shows), then frequency and presence."""
    params = SamplingParams(logit_bias=((1, 3.0),), repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, min_tokens=5)
    got = _processed(params, prompt=[1], output=[1, 2], ending=(0,))
    want = _row().tolist()
    want[0] = -INF
    want[1] = (-1.0 + 3.0) / 2.0 - 0.5 - 0.25  # biased to 2.0, then divided: a seen token
    want[2] = 0.5 / 2.0 - 0.5 - 0.25
    assert got == want


def test_min_p_drops_tokens_below_a_fraction_of_the_likeliest_after_the_temperature() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08], dtype=torch.float64))
    # at temperature 1: threshold 0.25 * 0.5 = 0.125 drops 0.12 and 0.08
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    # at temperature 2 the weights are sqrt(p): 0.707, 0.548, 0.346, 0.283; min_p 0.45 of the
    # likeliest is 0.318 (in weights; normalising scales both sides alike): only the last goes
    probs = filtered_probs(logits, SamplingParams(temperature=2.0, min_p=0.45))
    kept = torch.sqrt(torch.tensor([0.5, 0.3, 0.12], dtype=torch.float64))
    assert probs.tolist() == pytest.approx([*(kept / kept.sum()).tolist(), 0.0])
    # greedy: min_p changes nothing (nor in vLLM)
    assert filtered_probs(logits, SamplingParams(min_p=0.9)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_row_in_a_chain_is_the_bits_plain_decoding_computes_after_committing_its_prefix() -> None:
    """Row j with prefix chain[:j] vs a fresh context that committed chain[:j]: equal bits."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4,
                            logit_bias=((3, 2.5), (40, -7.0)), min_tokens=6)
    prompt, output = [1, 2, 3, 4, 4], [9, 3, 9]
    chain = [9, 50, 3, 50, 77, 2]
    row = torch.randn(97, generator=gen)
    spec = LogitsProcessors(params, prompt, (0,))
    spec.commit(output)
    for j in range(len(chain) + 1):
        plain = LogitsProcessors(params, prompt, (0,))
        plain.commit(output + chain[:j])
        assert torch.equal(spec.process(row, chain[:j]), plain.process(row, ()))
    # and the context matters: without the prefix the rows differ
    assert not torch.equal(spec.process(row, chain[:4]), spec.process(row, ()))


def test_no_processor_leaves_the_rows_as_they_are() -> None:
    logits = torch.randn(3, 97)
    rows = LogitsProcessors(SamplingParams(temperature=0.7, min_p=0.1), [1, 2]).rows(logits, [4, 5])
    assert not rows.active and rows.row(1) is not None and torch.equal(rows.head(3), logits)


@pytest.mark.parametrize("kwargs", [
    {"min_p": 1.5}, {"min_p": -0.1}, {"repetition_penalty": 0.0}, {"repetition_penalty": math.nan},
    {"repetition_penalty": 1000.0}, {"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
    {"min_tokens": -1}, {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)},
    {"logit_bias": ((1, 1.0), (1, 2.0))}, {"logit_bias": tuple((i, 1.0) for i in range(301))},
    {"logit_bias": (("x", 1.0),)}, {"logit_bias": ((1, math.nan),)},
], ids=repr)
def test_values_out_of_range_are_refused(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


def test_logit_bias_is_kept_sorted_and_a_token_past_the_vocabulary_is_refused() -> None:
    assert SamplingParams(logit_bias=((9, 1.0), (2, -1.0))).logit_bias == ((2, -1.0), (9, 1.0))
    request = GenerationRequest((1, 2), SamplingParams(logit_bias=((97, 1.0),)))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        Generation(request, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=64, mode="t",
                   vocab_size=97)


# ---- loose and rejection read processed rows -----------------------------------------------------
EOS = 6


def _rows(*argmaxes: int, vocab: int = 8) -> torch.Tensor:
    """Logits [len, vocab]: row i's likeliest token is argmaxes[i] (logit 2), the EOS next (1.5)."""
    rows = torch.zeros(len(argmaxes), vocab, dtype=torch.float64)
    rows[:, EOS] = 1.5
    for i, t in enumerate(argmaxes):
        rows[i, t] = 2.0
    return rows


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_loose_never_keeps_a_token_min_tokens_holds_back(min_tokens: int) -> None:
    """FLy keeps the drafted EOS at j = 0 (a mismatch, the gate open, the next token agreed) unless
    min_tokens holds it back: then the target's own token goes."""
    from card.engine.shared.config import Verify, VerifyPolicy

    state = TargetState([1, 2], SamplingParams(min_tokens=min_tokens),
                        VerifyPolicy(Verify.LOOSE, entropy_threshold=0.0, window=2), ending_ids={EOS})
    state.committed.append(3)  # the next token
    state.processors.commit([3])
    accepted, token = state.accept([EOS, 4, 5], _rows(0, 4, 5, 1))
    assert (accepted, token) == ((3, 1) if min_tokens == 0 else (0, 0))


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_rejection_judges_the_processed_distribution(min_tokens: int) -> None:
    """A drawn EOS with q = 1: kept about as often as p(EOS), never while min_tokens holds it back
    (p = 0 there), and never drawn after its rejection either."""
    from card.engine.shared.config import Verify, VerifyPolicy
    from card.engine.shared.tree import Proposal

    proposal = Proposal(torch.tensor([[EOS]]), torch.tensor([[1.0]], dtype=torch.float64))
    kept, eos = 0, 0
    for seed in range(200):
        state = TargetState([1, 2], SamplingParams(temperature=1.0, seed=seed, min_tokens=min_tokens),
                            VerifyPolicy(Verify.REJECTION), ending_ids={EOS})
        state.committed.append(3)
        state.processors.commit([3])
        accepted, token = state.accept([EOS], _rows(0, 0), proposal)
        kept += accepted
        eos += token == EOS
    if min_tokens:
        assert kept == 0 and eos == 0
    else:
        # p(EOS) = e^1.5 / (e^2 + e^1.5 + 6) = 0.25: 50 of 200 tries, sd 6.1; 4.5 sd either way
        assert 22 <= kept <= 78


# ---- card equals plain decoding ------------------------------------------------------------------
class Oracle(NoDraft):
    """Chains of the plain output itself (a perfect draft), every ``wrong``-th one with its last
    token changed: whatever the processors do to the draft's odds, every row of a chain is judged,
    most are kept and some are cut."""

    def __init__(self, reference: list[int], length: int = 6, wrong: int = 3) -> None:
        self.reference, self.length, self.wrong = reference, length, wrong
        self.steps = 0

    def open(self, committed) -> None:
        self.committed, self.prompt = committed, len(committed)

    def step(self, correction: Correction) -> StepResult:
        done = len(self.committed) - self.prompt  # output tokens committed (the next one included)
        tokens = list(self.reference[done:done + self.length])
        self.steps += 1
        if tokens and self.steps % self.wrong == 0:
            tokens[-1] = (tokens[-1] + 1) % VOCAB
        return StepResult(Chain(tuple(tokens), tuple(range(1, len(tokens) + 1)), correction.epoch))


GREEDY_CASES = {
    "repetition": SamplingParams(repetition_penalty=1.8),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=2.0),
    "logit_bias": SamplingParams(logit_bias=((7, 2.0), (61, 1.5))),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.5,
                          logit_bias=((7, 3.0),), min_tokens=4),
}
SEEDED_CASES = {
    "min_p": SamplingParams(temperature=1.0, seed=4, min_p=0.2),
    "repetition": SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.6),
    "frequency": SamplingParams(temperature=0.9, seed=6, frequency_penalty=1.2),
    "presence": SamplingParams(temperature=0.9, seed=7, presence_penalty=1.5),
    "logit_bias": SamplingParams(temperature=0.9, seed=8, logit_bias=((7, 5.0), (61, 3.0))),
    "all": SamplingParams(temperature=1.0, seed=9, top_k=30, min_p=0.05, repetition_penalty=1.3,
                          frequency_penalty=0.6, presence_penalty=0.4, logit_bias=((7, 2.0),)),
}
TREE = TreeParams(width=4, max_depth=5, max_chain=4)
N = 30


def _unprocessed(params: SamplingParams) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_k, params.top_p, params.seed)


def _kept(run) -> int:
    return sum(n - 1 for n in run.result.stats.accepted_lengths)


def _compare(sampling: SamplingParams, sharp: bool, eos: frozenset[int] = frozenset(),
             ignore_eos: bool = True) -> list[int]:
    """Plain decoding's tokens, after checking that sd (the target as its own unprocessed draft),
    card (likewise, in lockstep) and the oracle's chains give the same tokens and logprobs."""
    target = target_model("llama", sharp)
    kwargs = dict(max_new_tokens=N, sampling=sampling, eos_ids=eos, ignore_eos=ignore_eos, logprobs=2)
    plain = generate(target, NoDraft(), PROMPT, **kwargs)
    runs = {"sd": generate(target, SyncDraft(target, 3), PROMPT, **kwargs),
            "oracle": generate(target, Oracle(plain.tokens), PROMPT, **kwargs)}
    with card_source(target, TREE, lockstep_depth=4) as card:
        runs["card"] = generate(target, card, PROMPT, **kwargs)
    for name, run in runs.items():
        assert run.tokens == plain.tokens, name
        # the same logprobs (a log-softmax over a stack of rows may round its sum differently)
        for x, y in zip(run.result.logprobs, plain.result.logprobs, strict=True):
            assert x.token == y.token and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-9)
    assert _kept(runs["oracle"]) >= len(plain.tokens) // 2, "the verification path was not exercised"
    return plain.tokens


@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_card_equals_plain_decoding(name: str) -> None:
    plain = _compare(GREEDY_CASES[name], sharp=False)
    unprocessed = generate(target_model("llama"), NoDraft(), PROMPT, max_new_tokens=N).tokens
    assert plain != unprocessed, "the processor changed nothing: the comparison would prove nothing"


@pytest.mark.parametrize("name", list(SEEDED_CASES))
def test_seeded_card_equals_plain_decoding(name: str) -> None:
    sampling = SEEDED_CASES[name]
    plain = _compare(sampling, sharp=True)
    unprocessed = generate(target_model("llama", True), NoDraft(), PROMPT, max_new_tokens=N,
                           sampling=_unprocessed(sampling)).tokens
    assert plain != unprocessed


@pytest.mark.parametrize("seeded", [False, True])
def test_min_tokens_card_equals_plain_decoding(seeded: bool) -> None:
    """The EOS (a token plain decoding emits third, here) is held back for 12 tokens, then ends
    the generation as usual; card and sd agree."""
    sampling = SamplingParams(0.8, seed=3) if seeded else SamplingParams()
    target = target_model("llama", seeded)
    free = generate(target, NoDraft(), PROMPT, max_new_tokens=N, sampling=sampling).tokens
    eos = frozenset({free[2]})
    early = generate(target, NoDraft(), PROMPT, max_new_tokens=N, sampling=sampling, eos_ids=eos,
                     ignore_eos=False).tokens
    assert len(early) <= 3
    plain = _compare(dataclasses.replace(sampling, min_tokens=12), seeded, eos, ignore_eos=False)
    assert len(plain) >= 12 and free[2] not in plain[:12]


# ---- negative controls: the comparisons above can fail --------------------------------------------
def _without_prefix(self: ProcessedRows, j: int) -> torch.Tensor:
    """Row j processed in the committed context alone: chain[:j] forgotten."""
    if not self.processors.active:
        return self.raw[j]
    return self.processors.process(self.raw[j], ())


def _plain_rows_only(self: ProcessedRows, j: int) -> torch.Tensor:
    """The processors applied in plain decoding only: a verification's rows go through raw."""
    if not self.processors.active or self.chain:
        return self.raw[j].to("cpu", torch.float64)
    return self.processors.process(self.raw[j], ())


@pytest.mark.parametrize("bug", [_without_prefix, _plain_rows_only], ids=["no-chain-prefix", "one-side"])
@pytest.mark.parametrize("name", ["repetition", "frequency", "all"])
def test_negative_control_a_wrong_verification_context_breaks_exactness(
        bug, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sampling = GREEDY_CASES[name]
    target = target_model("llama")
    plain = generate(target, NoDraft(), PROMPT, max_new_tokens=N, sampling=sampling).tokens
    monkeypatch.setattr(ProcessedRows, "row", bug)
    # plain decoding never verifies a chain: the bug leaves it alone ...
    assert generate(target, NoDraft(), PROMPT, max_new_tokens=N, sampling=sampling).tokens == plain
    # ... and verification, fed the right chains, no longer equals it
    assert generate(target, Oracle(plain), PROMPT, max_new_tokens=N, sampling=sampling).tokens != plain


def test_negative_control_the_models_argmax_is_not_a_processed_requests_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy request that read its verification's argmax off the model's logits (what the
    device's picks are) would not equal plain decoding."""
    sampling = GREEDY_CASES["repetition"]
    target = target_model("llama")
    plain = generate(target, NoDraft(), PROMPT, max_new_tokens=N, sampling=sampling).tokens
    monkeypatch.setattr(ProcessedRows, "active", property(lambda self: False))
    assert generate(target, Oracle(plain), PROMPT, max_new_tokens=N, sampling=sampling).tokens != plain


# ---- 8 in flight ---------------------------------------------------------------------------------
def _eight(seed: int) -> list[GenerationRequest]:
    """8 requests, greedy and seeded, each with other processors (one with none)."""
    variants = [*GREEDY_CASES.values(), SamplingParams(), *list(SEEDED_CASES.values())[:2]]
    cases = prompt_cases(8, seed=seed, max_prompt=40, max_new=N)
    return [GenerationRequest(tuple(p), s, StopParams(max_new_tokens=max(b, 8), ignore_eos=True))
            for (p, b), s in zip(cases, variants, strict=True)]


def _gen(model: torch.nn.Module, r: GenerationRequest, source: ChainSource | None = None) -> Generation:
    return Generation(r, source or NoDraft(), eos_ids=frozenset(), decode=letters, context_window=512,
                      mode="test", vocab_size=model.config.vocab_size)


def _exact_model() -> torch.nn.Module:
    """A model the static step takes (its probe passes: batch-invariant kernels)."""
    model = tiny_model("qwen2", hidden=64, layers=2, vocab=VOCAB)
    make_exact(model, exact=True, prepack=True)
    return model


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_eight_in_flight_equal_plain_decoding_alone(decode_step: str) -> None:
    """Every request verifies its oracle's chains beside 7 others; on the static step every step
    also hands out its rows' device argmax, which the processed greedy requests must not use (the
    unprocessed one does). All equal plain decoding alone on the eager forward."""
    model = _exact_model()
    requests = _eight(seed=6)
    alone = [finish_alone(model, _gen(model, r)).token_ids for r in requests]
    engine = TargetEngine(model, KVPool(model, slots=8, max_len=512), decode_step=decode_step)
    assert (engine.static is not None) == (decode_step == "static")
    gens = [_gen(model, r, Oracle(want)) for r, want in zip(requests, alone, strict=True)]
    batched = run_batched(engine, gens, join_every=1)
    assert [batched[i] for i in range(8)] == alone
    assert all(sum(n - 1 for n in g.stats.accepted_lengths) > 0 for g in gens if len(g.result.token_ids) > 2)


def test_eight_in_flight_card_equals_plain_decoding_alone() -> None:
    """The same requests through card's own drafting (a draft worker beside the engine)."""
    model = target_model("llama", sharp=True)
    loaded = LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), 512)
    requests = _eight(seed=5)
    alone = [finish_alone(model, _gen(model, r)).token_ids for r in requests]
    runner = InProcessRunner(loaded, loaded, RunnerConfig(mode=Mode.CARD, tree=TREE, backoff=False))
    try:
        engine = TargetEngine(model, KVPool(model, slots=8, max_len=512))
        gens = [runner.generation(r) for r in requests]
        batched = run_batched(engine, gens, join_every=1)
        assert [batched[i] for i in range(8)] == alone
        assert sum(g.stats.draft_forwards for g in gens) > 0  # the draft really ran
    finally:
        runner.close()


def test_negative_control_device_picks_for_a_processed_request_break_exactness(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Were a processed greedy request to take the static step's device argmax, it would not
    equal plain decoding."""
    model = _exact_model()
    request = GenerationRequest(tuple(PROMPT), GREEDY_CASES["repetition"],
                                StopParams(max_new_tokens=N, ignore_eos=True))
    want = finish_alone(model, _gen(model, request)).token_ids
    assert finish_alone(model, _gen(model, request, Oracle(want)), decode_step="static").token_ids == want
    accept = TargetState.accept

    def trusting(self, chain, logits, proposal=None, picks=None):  # takes the picks, processors or not
        self.processors.active = picks is None
        try:
            return accept(self, chain, logits, proposal, picks)
        finally:
            self.processors.active = True
    monkeypatch.setattr(TargetState, "accept", trusting)
    assert finish_alone(model, _gen(model, request, Oracle(want)), decode_step="static").token_ids != want
