"""Seeded sampling and the exact acceptance rule on the device (card.engine.shared.static_step's
``select_rows``): the same tokens, bit for bit, as the host path (card.engine.shared.sampling's
``select_token``, card.engine.target.verify's ``TargetState._exact``) at every bucket, fp32 and
bf16, plain decoding and card; negative controls: uniforms of the wrong position, or an
acceptance count off by one, and the outputs differ."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from card.engine.loading.invariant import make_exact
from card.engine.shared import static_step
from card.engine.shared.config import (
    GenerationRequest,
    SamplingParams,
    StopParams,
    TreeParams,
    Verify,
    VerifyPolicy,
)
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.sampling import (
    RowBuffers,
    RowFilters,
    draw,
    draw_rows,
    exact_accepted,
    filter_rows,
    filtered_probs,
    position_uniform,
    position_uniforms,
    select_token,
)
from card.engine.shared.session import StepResult
from card.engine.shared.static_step import DecodeRows, StaticStep, select_rows
from card.engine.shared.tree import Chain, Correction
from card.engine.target import verify
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine, finish_alone, run_alone
from card.engine.target.verify import TargetState
from tests.engine.support import card_source, letters, prompt_cases, run_batched, target_model
from tests.tiny_models import tiny_model

DTYPES = [torch.float32, torch.bfloat16]
VOCAB = 97
PARAMS = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=8, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.8, seed=4),
    SamplingParams(temperature=0.9, min_p=0.1, seed=5),
    SamplingParams(temperature=1.1, top_k=3, top_p=0.5, min_p=0.02, seed=6),
    SamplingParams(temperature=2.0, top_k=10_000, seed=7),  # top_k past the vocabulary: none
    SamplingParams(seed=8),  # greedy: a neutral row among sampled ones
]


def _model(dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_model("qwen2", dtype=dtype, hidden=64, layers=2, vocab=VOCAB)
    make_exact(model, exact=True, prepack=True)
    return model


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the batched ops against the host's one-row path -----------------------------------------------
def test_position_uniforms_are_position_uniform() -> None:
    positions = np.arange(0, 20_000, 13, dtype=np.int64)
    for seed in (0, 1, 77, 2**40 + 3, 2**63 - 1):
        want = [position_uniform(seed, int(p)) for p in positions]
        assert position_uniforms(seed, positions).tolist() == want


# 40,000: past torch's grain, where the sum of one row alone splits across threads
@pytest.mark.parametrize("vocab", [VOCAB, 40_000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_filter_rows_and_draw_rows_equal_the_host_path_row_by_row(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    work = RowBuffers(40, vocab, torch.device("cpu"))
    work.values.fill_(float("nan"))
    work.index.fill_(-7)
    for rows in (33, 1, 2, 8):
        logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
        params = [PARAMS[(r * 5 + rows) % len(PARAMS)] for r in range(rows)]
        f = RowFilters.of(params, vocab)
        probs = filter_rows(logits, f.temperature, f.top_k, f.top_p, f.min_p, f.shape)
        u = torch.tensor([position_uniform(p.seed, 100 + r) for r, p in enumerate(params)],
                         dtype=torch.float64)
        drawn = draw_rows(probs, u).tolist()
        # the static step's way: every intermediate in reused buffers, stale from a larger batch
        probs_in_place = filter_rows(logits, f.temperature, f.top_k, f.top_p, f.min_p, f.shape, work)
        assert torch.equal(probs_in_place, probs)
        assert draw_rows(probs_in_place, u, work).tolist() == drawn
        for r, p in enumerate(params):
            if p.greedy:
                continue
            assert torch.equal(probs[r], filtered_probs(logits[r], p)), (rows, r, p)
            assert drawn[r] == draw(filtered_probs(logits[r], p), float(u[r]))
            assert drawn[r] == select_token(logits[r], 100 + r, p)


def test_draw_rows_steps_back_onto_mass_as_draw_does() -> None:
    """Weights with zero runs, uniforms at the edges: the same index as draw, row by row."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2, 0.0]],
                         dtype=torch.float64)
    for u in (0.0, 0.25, 0.5, 0.999999, 1.0 - 2**-53):
        us = torch.full((4,), u, dtype=torch.float64)
        assert draw_rows(probs, us).tolist() == [draw(row, u) for row in probs]


def test_exact_accepted_is_the_host_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        sessions = int(torch.randint(1, 6, (1,), generator=gen))
        lengths = torch.randint(1, 6, (sessions,), generator=gen).tolist()
        picks, following, first, want = [], [], [], []
        for k in lengths:
            chain = torch.randint(0, 3, (k - 1,), generator=gen).tolist()  # small alphabet: matches happen
            own = torch.randint(0, 3, (k,), generator=gen).tolist()
            n = 0
            while n < len(chain) and own[n] == chain[n]:
                n += 1
            want.append(n)
            first += [len(picks)] * k
            picks += own
            following += [*chain, -1]
        ghosts = trial % 3
        first += list(range(len(picks), len(picks) + ghosts))
        picks += [0] * ghosts
        following += [-1] * ghosts
        got = exact_accepted(torch.tensor(picks), torch.tensor(following), torch.tensor(first)).tolist()
        starts = sorted(set(first[:sum(lengths)]))
        assert [got[s] for s in starts] == want
        assert sum(got) == sum(want)  # nothing anywhere else: ghosts count nothing


# ---- the static step's selection -------------------------------------------------------------------
def _step(model: torch.nn.Module) -> StaticStep:
    pool = KVPool(model, slots=4, max_len=300)
    for slot in range(4):
        pool.ready(slot, 0, pool.keys[0].shape[2])
    return StaticStep(model, pool, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_draws_and_counts_equal_the_host_path_at_every_bucket(dtype: torch.dtype) -> None:
    """A sampled chain, padded with ghosts to each bucket beside a greedy session further on: each
    row's device token is select_token on its logits (the host path, at the position its token
    takes), and the accepted count the host's exact rule finds, for chains the host accepts in
    part and in whole."""
    step = _step(_model(dtype))
    checked = 0
    for start, params in ((0, PARAMS[0]), (60, PARAMS[3]), (130, PARAMS[5]), (200, PARAMS[4])):
        tokens = _tokens(8, start)
        for bucket in step.buckets:
            chain = min(bucket, 8)
            sessions = [DecodeRows(0, start, tokens[:chain], params)]
            if bucket > chain:
                sessions.append(DecodeRows(1, 250, tokens[:1]))
            out = step.run(sessions, bucket)
            picks, accepted = out.read()
            host = [select_token(out.logits[j], start + 1 + j, params) for j in range(chain)]
            assert picks[:chain] == host, (start, bucket)
            if bucket > chain:
                assert picks[chain] == int(torch.argmax(out.logits[chain]))  # the greedy neighbour
            # the rule on a chain that is the host's own draws for a while, then not
            judged = [tokens[0], *host[:min(3, chain - 1)], *[(t + 1) % VOCAB for t in host[3:chain - 1]]]
            out = step.run([DecodeRows(0, start, judged, params)], bucket)
            picks, accepted = out.read()
            state = verify.TargetState([1] * (start + 1), params)
            assert accepted[0] == state._exact(judged[1:], state.processors.rows(out.logits, judged[1:]))[0]
            checked += accepted[0]
    assert checked > 0  # chains were accepted, not only cut at their first token


def test_select_rows_is_one_graph_without_a_host_read() -> None:
    """The selection compiles whole (fullgraph: no graph break, so no host sync inside; what a CUDA
    graph capture needs) and gives the eager selection's tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    step = _step(_model(torch.float32))
    tokens = _tokens(6, 9)
    out = step.run([DecodeRows(0, 20, tokens, PARAMS[3]), DecodeRows(2, 90, tokens[:2])], 16)
    compiled = torch.compile(select_rows, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():  # as the step runs
        logits, argmax = step._fn(step.model, step.batch)  # the same buffers again: the same rows
        selected = compiled(logits, argmax, step.batch)
        assert torch.equal(selected, select_rows(logits, argmax, step.batch))
    assert torch.equal(selected[:, :8], out.selected)


# ---- the engine: device path against the host path --------------------------------------------------
# Both on the static step: its logits are the same bits alone and batched (the probe), but not the
# eager forward's bits (bf16 attention rounds per 64-key block there), so the host path here is the
# previous static step: every token drawn on the host from the static step's logits rows.
def _gen(model: torch.nn.Module, r: GenerationRequest, source=None) -> Generation:
    return Generation(r, source or NoDraft(), eos_ids=frozenset(), decode=letters, context_window=512,
                      mode="test", vocab_size=model.config.vocab_size)


@contextlib.contextmanager
def _host_path() -> Iterator[None]:
    """The static step without device sampling: every request's tokens drawn on the host."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TargetState, "device_sampling", lambda self, chain, proposal: None)
        yield


def _requests(n: int, seed: int) -> list[GenerationRequest]:
    cases = prompt_cases(n, seed=seed, max_prompt=200, max_new=24)
    return [GenerationRequest(tuple(p), PARAMS[(i + seed) % len(PARAMS)],
                              StopParams(max_new_tokens=b, ignore_eos=True))
            for i, (p, b) in enumerate(cases)]


class _HostDraws:
    """Counts the host path's draws (select_token called by the target's rules)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = verify.select_token

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(verify, "select_token", counted)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_device_sampling_equals_the_host_path(dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded requests (every filter, and a greedy one) each alone and 6 in flight, with device
    draws and device acceptance, equal each alone drawn on the host; and the host drew nothing
    but each prompt's first token."""
    model = _model(dtype)
    requests = _requests(6, seed=2)
    with _host_path():
        host = [finish_alone(model, _gen(model, r), decode_step="static").token_ids for r in requests]
    draws = _HostDraws(monkeypatch)
    device = [finish_alone(model, _gen(model, r), decode_step="static").token_ids for r in requests]
    assert device == host
    engine = TargetEngine(model, KVPool(model, slots=3, max_len=512), max_batch_tokens=300,
                          decode_step="static")
    assert engine.static is not None
    batched = run_batched(engine, [_gen(model, r) for r in requests], join_every=2)
    assert [batched[i] for i in range(len(requests))] == host
    assert draws.calls == 2 * len(requests)  # only first() (after the prefill) drew on the host


class _Replay(NoDraft):
    """Chains of a reference output, 4 tokens each, the third one wrong: every row of every chain
    is judged, two are kept and the rest cut."""

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def open(self, committed) -> None:
        self.committed, self.prompt = committed, len(committed)

    def step(self, correction: Correction) -> StepResult:
        done = len(self.committed) - self.prompt
        tokens = list(self.reference[done:done + 4])
        if len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % VOCAB
        return StepResult(Chain(tuple(tokens), tuple(range(1, len(tokens) + 1)), correction.epoch))


@pytest.mark.parametrize("bug", ["uniforms", "accepted"])
def test_negative_control_wrong_uniforms_or_counts_break_it(bug: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path with the uniforms of the next position, or with accepted counts one too
    many (within the chain), verifying chains of the host path's own output, no longer equals
    the host path: the comparisons above can fail."""
    model = _model(torch.float32)
    requests = [GenerationRequest(tuple(p), SamplingParams(0.9, top_p=0.95, seed=i),
                                  StopParams(max_new_tokens=b, ignore_eos=True))
                for i, (p, b) in enumerate(prompt_cases(3, seed=5, max_prompt=40, max_new=24))]
    with _host_path():
        host = [finish_alone(model, _gen(model, r), decode_step="static").token_ids for r in requests]
    replayed = [finish_alone(model, _gen(model, r, _Replay(h)), decode_step="static").token_ids
                for r, h in zip(requests, host, strict=True)]
    assert replayed == host  # the control's own baseline: right, the device path equals the host's
    if bug == "uniforms":
        monkeypatch.setattr(static_step, "position_uniforms",
                            lambda seed, positions: position_uniforms(seed, positions + 1))
    else:
        original = static_step.exact_accepted

        def more(picks: torch.Tensor, following: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
            counts = original(picks, following, first)
            rows = torch.zeros_like(counts).scatter_add_(0, first, torch.ones_like(counts))
            return torch.minimum(counts + 1, (rows - 1).clamp(min=0))
        monkeypatch.setattr(static_step, "exact_accepted", more)
    replayed = [finish_alone(model, _gen(model, r, _Replay(h)), decode_step="static").token_ids
                for r, h in zip(requests, host, strict=True)]
    assert replayed != host


def test_card_with_device_sampling_equals_plain_decoding_drawn_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """card (the target itself as its draft, in lockstep: chains at every step) through the static
    step, device draws and device acceptance, equals seeded plain decoding drawn on the host."""
    model = target_model("qwen2", sharp=True)
    make_exact(model, exact=True, prepack=True)
    cases = prompt_cases(3, seed=7, max_prompt=60, max_new=24)
    requests = [GenerationRequest(tuple(p), PARAMS[i], StopParams(max_new_tokens=b, ignore_eos=True))
                for i, (p, b) in enumerate(cases)]
    with _host_path():
        want = [finish_alone(model, _gen(model, r), decode_step="static").token_ids for r in requests]
    draws = _HostDraws(monkeypatch)
    kept = 0
    with card_source(model, TreeParams(width=2, max_depth=5, max_chain=4), lockstep_depth=3) as card:
        for request, tokens in zip(requests, want, strict=True):
            gen = _gen(model, request, card)
            for _ in run_alone(model, gen, adaptive=False, decode_step="static"):
                pass
            assert gen.result is not None and gen.result.token_ids == tokens
            kept += sum(n - 1 for n in gen.result.stats.accepted_lengths)
    assert kept > 0
    assert draws.calls == len(requests)  # the host drew each prompt's first token, nothing else


@pytest.mark.parametrize("case", ["logprobs", "loose", "rejection-undrawn"])
def test_requests_beside_the_exact_rule_equal_the_host_path(case: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded requests that take the device's draws outside the plain exact rule (logprobs read off
    the rows on the host, loose verification judging mismatches, rejection given chains that were
    not drawn: verified exactly) give the host path's tokens and logprobs on chains with a wrong
    token; the device really drew (the host drew only the first tokens)."""
    model = _model(torch.float32)
    verify_policy = {"loose": VerifyPolicy(Verify.LOOSE, entropy_threshold=0.0, window=2),
                     "rejection-undrawn": VerifyPolicy(Verify.REJECTION)}.get(case, VerifyPolicy())
    requests = [GenerationRequest(tuple(p), SamplingParams(0.9, top_k=30, top_p=0.9, seed=i),
                                  StopParams(max_new_tokens=b, ignore_eos=True), verify=verify_policy,
                                  logprobs=2 if case == "logprobs" else None)
                for i, (p, b) in enumerate(prompt_cases(3, seed=11, max_prompt=40, max_new=20))]
    with _host_path():
        plain = [finish_alone(model, _gen(model, r), decode_step="static").token_ids for r in requests]
        host = [finish_alone(model, _gen(model, r, _Replay(h)), decode_step="static")
                for r, h in zip(requests, plain, strict=True)]
    draws = _HostDraws(monkeypatch)
    loose = TargetState._loose
    judged = []

    def counted(self, chain, rows):
        judged.append(len(chain))
        return loose(self, chain, rows)
    monkeypatch.setattr(TargetState, "_loose", counted)
    device = [finish_alone(model, _gen(model, r, _Replay(h)), decode_step="static")
              for r, h in zip(requests, plain, strict=True)]
    assert [d.token_ids for d in device] == [h.token_ids for h in host]
    assert [d.logprobs for d in device] == [h.logprobs for h in host]
    assert draws.calls == len(requests)
    assert bool(judged) is (case == "loose")  # the loose rule itself ran, on the device's tokens
    if case == "logprobs":
        assert all(len(d.logprobs) == len(d.token_ids) for d in device)
    if case == "rejection-undrawn":
        assert all(d.stats.rejection_fallbacks > 0 for d in device)
