"""Long prompts beside decoding streams (card.engine.target.scheduler.PrefillPacer): a prompt's
chunks are paced so that the streams decoding beside it keep their time between tokens within
``max_decode_slowdown`` of theirs alone, every decoding stream still advances in every iteration
(never starved, counted in iterations), the prompt still progresses within a bound of iterations,
and no output changes: the long request and the short ones equal each alone, token for token
(greedy and seeded, fp32 and bf16). Negative control: pacing off lets a chunk into nearly every
iteration, and the same cost clock then puts the streams far past the bound.

The pacer's clock is made deterministic where iterations are counted: each iteration "costs"
COST_FIXED + COST_ROW x its rows (a forward's cost grows with its tokens), so held iterations are
a fact of the schedule, not of this machine's load."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from card.engine.loading.invariant import make_exact
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import PREFILL_CHUNK, KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import MAX_PREFILL_WAIT, PrefillPacer, TargetEngine, finish_alone
from tests.engine.support import VOCAB, letters
from tests.tiny_models import tiny_model

B = PREFILL_CHUNK
WINDOW = 2048
LONG = 5 * B + 37  # six chunks, the last one partial
SHORT_NEW = 48
COST_FIXED, COST_ROW = 0.1, 0.001
SLOWDOWN = 1.5


def _model(dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=dtype)
    model.config.max_position_embeddings = WINDOW
    make_exact(model, exact=True, prepack=True)  # row-invariant linears, as load_model makes them
    return model


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests(sampled: bool) -> list[GenerationRequest]:
    """Three short prompts, then the long one."""
    prompts = [_tokens(5 + 3 * i, seed=20 + i) for i in range(3)] + [_tokens(LONG, seed=7)]
    news = [SHORT_NEW] * 3 + [6]
    return [GenerationRequest(tuple(p), SamplingParams(0.9, seed=i) if sampled else SamplingParams(),
                              StopParams(max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, news, strict=True))]


def _gen(model: torch.nn.Module, r: GenerationRequest) -> Generation:
    return Generation(r, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=WINDOW,
                      mode="vanilla", vocab_size=model.config.vocab_size)


def _cost(rows: int) -> float:
    return COST_FIXED + COST_ROW * rows


def _engine(model: torch.nn.Module, slowdown: float, slots: int = 4) -> TargetEngine:
    """An engine whose pacer sees each iteration's cost by the deterministic clock."""
    engine = TargetEngine(model, KVPool(model, slots=slots, max_len=WINDOW), max_batch_tokens=512,
                          max_decode_slowdown=slowdown)
    observe = engine.pacer.observe

    def clocked(seconds: float, decoding: bool, prefilled: bool, held: bool) -> None:
        assert engine.last is not None
        observe(_cost(engine.last.rows), decoding, prefilled, held)

    engine.pacer.observe = clocked  # type: ignore[method-assign]
    return engine


def _beside(model: torch.nn.Module, requests: list[GenerationRequest], slowdown: float,
            ) -> tuple[list[Generation], list[tuple[int, bool, float, bool]]]:
    """The short requests decoding, then the long one joining: each iteration's (decoding rows,
    whether a chunk went, its cost by the deterministic clock), and every generation at its end.
    Asserts that every decoding generation advanced in every iteration."""
    engine = _engine(model, slowdown)
    shorts = [_gen(model, r) for r in requests[:3]]
    for g in shorts:
        engine.add(g)
    while any(g.prefilling for g in shorts):
        engine.step()
    for _ in range(3):  # decoding alone first: the pacer knows a decoding iteration's cost
        engine.step()
    long = _gen(model, requests[3])
    engine.add(long)
    trace = []
    while not engine.idle:
        decoding = [g for g in engine.running if not g.prefilling]
        before = [len(g.stats.accepted_lengths) for g in decoding]
        chunked = long.prefilling
        engine.step()
        # never starved: every generation that was decoding committed in this very iteration
        assert [len(g.stats.accepted_lengths) for g in decoding] == [b + 1 for b in before]
        assert engine.last is not None
        prefilled = chunked and engine.last.rows > len(decoding)
        trace.append((len(decoding), prefilled, _cost(engine.last.rows), chunked))
    return [*shorts, long], trace


def held_back(trace: list[tuple[int, bool, float, bool]]) -> int:
    """Iterations where the long prompt had a chunk left and none went."""
    return sum(1 for _, prefilled, _, pending in trace if pending and not prefilled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_long_prompt_beside_decoding_streams_changes_no_output(dtype: torch.dtype, sampled: bool) -> None:
    model = _model(dtype)
    requests = _requests(sampled)
    alone = [finish_alone(model, _gen(model, r)).token_ids for r in requests]
    paced, paced_trace = _beside(model, requests, SLOWDOWN)
    assert [g.result.token_ids for g in paced if g.result is not None] == alone
    unpaced, trace = _beside(model, requests, 0.0)
    assert [g.result.token_ids for g in unpaced if g.result is not None] == alone
    assert not held_back(trace)
    assert held_back(paced_trace), "pacing held no chunk back: the test proves nothing"


def test_decoding_streams_keep_their_pace_and_the_prompt_progresses() -> None:
    """Counted in iterations: while the short streams decode, chunks are held back until their
    cost is paid back (the iterations held are what the pacer's rule predicts), the streams' mean
    iteration cost stays within SLOWDOWN of a decoding iteration's (one chunk's excess of slack:
    the first goes at once), the median is a decoding iteration's own, and the long prompt still
    gets all its chunks. Pacing off: a chunk in every iteration, far past the bound."""
    model = _model(torch.float32)
    requests = _requests(False)
    decode = _cost(3)
    chunk_excess = _cost(3 + B) - decode
    held_per_chunk = math.ceil(chunk_excess / ((SLOWDOWN - 1) * decode) - 1e-9)

    gens, trace = _beside(model, requests, SLOWDOWN)
    with_streams = [(chunk, cost) for n, chunk, cost, _ in trace if n == 3]
    chunks = [i for i, (chunk, _) in enumerate(with_streams) if chunk]
    assert len(chunks) >= 2
    # between two chunks beside the streams, exactly the iterations that pay the first one back
    assert all(b - a - 1 == held_per_chunk for a, b in itertools.pairwise(chunks))
    costs = sorted(cost for _, cost in with_streams)
    assert costs[len(costs) // 2] == pytest.approx(decode)
    excess = sum(cost - decode for _, cost in with_streams)
    assert excess <= (SLOWDOWN - 1) * decode * len(with_streams) + chunk_excess + 1e-9
    assert sum(chunk for _, chunk, _, _ in trace) == math.ceil(LONG / B)  # every chunk went
    assert all(g.result is not None for g in gens)

    # the negative control: pacing off, the streams pay for a chunk in every iteration
    _, trace = _beside(model, requests, 0.0)
    with_streams = [(chunk, cost) for n, chunk, cost, _ in trace if n == 3]
    assert all(chunk for chunk, _ in with_streams[:5])
    assert sum(cost for _, cost in with_streams[:5]) > SLOWDOWN * 5 * decode


def test_the_pacer_pays_back_and_bounds_a_prompts_wait() -> None:
    """The rule alone: a chunk costing 10 decoding iterations more is followed by 20 held ones at
    1.5 (10 / 0.5); nothing decoding forgives the debt; and a clock that stands still (no payback
    ever) still lets a chunk in every MAX_PREFILL_WAIT iterations."""
    pacer = PrefillPacer(1.5)
    pacer.observe(1.0, decoding=True, prefilled=False, held=False)
    assert pacer.admits()
    pacer.observe(11.0, decoding=True, prefilled=True, held=False)
    held = 0
    while not pacer.admits():
        pacer.observe(1.0, decoding=True, prefilled=False, held=True)
        held += 1
    assert held == 20
    pacer.observe(11.0, decoding=True, prefilled=True, held=False)
    assert not pacer.admits()
    pacer.observe(5.0, decoding=False, prefilled=True, held=False)  # nobody decoding: forgiven
    assert pacer.admits()

    stuck = PrefillPacer(1.5)
    stuck.observe(1.0, decoding=True, prefilled=True, held=False)
    waited = 0
    while not stuck.admits():
        stuck.observe(0.0, decoding=True, prefilled=False, held=True)
        waited += 1
    assert waited == MAX_PREFILL_WAIT

    off = PrefillPacer(0.0)
    off.observe(100.0, decoding=True, prefilled=True, held=False)
    assert off.admits()


def test_the_flag_is_checked_at_start() -> None:
    """--max-decode-slowdown: > 1, or 0 (off); 1 would hold every chunk beside decoding until
    MAX_PREFILL_WAIT, so it is refused with the rest."""
    from card.engine.loading.models import ModelConfig
    from card.engine.shared.errors import InvalidArgument
    from card.target_service.config import TargetConfig

    assert TargetConfig(model=ModelConfig("default")).max_decode_slowdown == 1.5
    assert TargetConfig(model=ModelConfig("default"), max_decode_slowdown=0).max_decode_slowdown == 0
    for bad in (1.0, 0.5, -1.0):
        with pytest.raises(InvalidArgument, match="max-decode-slowdown"):
            TargetConfig(model=ModelConfig("default"), max_decode_slowdown=bad)


def test_a_one_chunk_prompt_is_not_held_behind_a_long_one() -> None:
    """While the long prompt's chunks wait for the pacer, a short request that joins is prefilled
    in the very next iteration (its first token one forward away), and its cost is owed all the
    same: the long prompt waits longer."""
    model = _model(torch.float32)
    requests = _requests(False)
    engine = _engine(model, SLOWDOWN, slots=5)
    shorts = [_gen(model, r) for r in requests[:3]]
    for g in shorts:
        engine.add(g)
    while any(g.prefilling for g in shorts):
        engine.step()
    engine.step()
    long = _gen(model, requests[3])
    engine.add(long)
    engine.step()  # nothing owed: its first chunk goes at once
    assert long.prefill_left == LONG - B
    engine.step()
    assert long.prefill_left == LONG - B and engine.pacer.debt > 0  # held back
    late = _gen(model, GenerationRequest(tuple(_tokens(9, seed=3)), SamplingParams(),
                                         StopParams(max_new_tokens=2, ignore_eos=True)))
    engine.add(late)
    before = engine.pacer.debt
    engine.step()
    assert not late.prefilling and long.prefill_left == LONG - B
    assert engine.pacer.debt >= before  # its chunk was charged, not paid back
