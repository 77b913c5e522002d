"""The static decoding step (card.engine.shared.static_step): ghost rows and buckets change no
live row's bits; a row's logits are the same alone, in a chain, beside other sessions and at any
key span; the engine on it keeps every exactness promise; it compiles as one graph per shape."""

from __future__ import annotations

import pytest
import torch

from card.engine.loading.cpu_linear import PackedLinear
from card.engine.loading.invariant import make_exact
from card.engine.shared import static_step
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams, TreeParams
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.static_step import (
    DecodeRows,
    StaticStep,
    block_attention,
    row_bucket,
    span_blocks,
    static_step_for,
)
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine, finish_alone, run_alone
from tests.engine.support import card_source, letters, prompt_cases, run_batched, target_model
from tests.tiny_models import tiny_model

DTYPES = [torch.float32, torch.bfloat16]


def _model(dtype: torch.dtype, prepack: bool = True) -> torch.nn.Module:
    model = tiny_model("qwen2", dtype=dtype, hidden=64, layers=2, vocab=97)
    make_exact(model, exact=True, prepack=prepack)
    return model


def _step(model: torch.nn.Module, slots: int = 4, max_len: int = 300, rows: int = 64) -> StaticStep:
    pool = KVPool(model, slots=slots, max_len=max_len)
    for slot in range(slots):
        pool.ready(slot, 0, pool.keys[0].shape[2])  # no junk memory: every row finite
    return StaticStep(model, pool, rows)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_buckets_and_spans() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 17, 100, 256)] == [1, 2, 4, 8, 16, 32, 128, 256]
    with pytest.raises(ValueError):
        row_bucket(257)
    assert [span_blocks(p, 8) for p in (0, 63, 64, 127, 128, 200, 511, 1000)] == [1, 1, 2, 2, 4, 4, 8, 8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_step_equals_plain_decoding_at_every_bucket(dtype: torch.dtype) -> None:
    """A chain's rows, padded with ghosts to each bucket and beside a session further on (a longer
    key span), give the bits of the same rows decoded one at a time."""
    step = _step(_model(dtype))
    for start in (0, 60, 130):
        tokens = _tokens(8, start)
        alone = [step.run([DecodeRows(0, start + j, tokens[j:j + 1])]) for j in range(8)]
        alone_logits = [a.logits[0].clone() for a in alone]
        alone_picks = [int(a.picks[0]) for a in alone]
        for bucket in step.buckets:
            chain = min(bucket, 8)
            sessions = [DecodeRows(0, start, tokens[:chain])]
            if bucket > chain:
                sessions.append(DecodeRows(1, 250, tokens[:1]))
            out = step.run(sessions, bucket)
            for j in range(chain):
                assert torch.equal(out.logits[j], alone_logits[j]), (start, bucket, j)
                assert int(out.picks[j]) == alone_picks[j]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ghost_rows_never_touch_a_session(dtype: torch.dtype) -> None:
    """Ghosts write the scratch slot only; negative control: ghosts whose write is not redirected
    (the scratch slot made a live session's) corrupt that session, and the next step shows it."""
    model = _model(dtype)

    def second_step(redirect: bool) -> torch.Tensor:
        step = _step(model)
        prompt = _tokens(8, 1)
        step.run([DecodeRows(0, 0, prompt)], bucket=8)  # session 0: rows 0-7, no ghost
        keys = [k[0, :, :8].clone() for k in step.pool.keys]
        if not redirect:
            step.pool.scratch = 0  # ghosts now write row 0 of session 0's slot
        step.run([DecodeRows(1, 0, [7])], bucket=64)  # session 1 and 63 ghosts
        touched = any(not torch.equal(k[0, :, :8], before) for k, before in zip(step.pool.keys, keys,
                                                                                strict=True))
        assert touched is not redirect
        step.pool.scratch = step.pool.slots
        return step.run([DecodeRows(0, 8, [5])]).logits[0].clone()

    assert not torch.equal(second_step(redirect=False), second_step(redirect=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_attention_matches_sdpa(dtype: torch.dtype) -> None:
    """The block-tree attention computes attention: within tolerance of SDPA at 1-4 key blocks."""
    gen = torch.Generator().manual_seed(0)
    slots, kv_heads, group, dim, rows = 3, 2, 3, 16, 256
    keys = torch.randn(slots, kv_heads, rows, dim, generator=gen).to(dtype)
    values = torch.randn(slots, kv_heads, rows, dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 5, 63, 64, 130, 255])
    slot_of = torch.tensor([0, 1, 2, 0, 1, 2])
    query = torch.randn(kv_heads * group, len(positions), dim, generator=gen).to(dtype)
    out = block_attention(query, keys, values, slot_of, positions, blocks=4, scaling=dim ** -0.5)
    for r, (s, p) in enumerate(zip(slot_of.tolist(), positions.tolist(), strict=True)):
        k = keys[s, :, :p + 1].repeat_interleave(group, dim=0)
        v = values[s, :, :p + 1].repeat_interleave(group, dim=0)
        q = query[:, r:r + 1].float()
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.float(), v.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[r].float(), ref[:, 0], atol=tol, rtol=tol)
    # a longer span than needed (masked blocks past the pool included) changes no bit
    for blocks in (8, 16):
        assert torch.equal(block_attention(query, keys, values, slot_of, positions, blocks, dim ** -0.5), out)


def test_probe_passes_here_and_catches_a_variant_step() -> None:
    """The start-up probe passes on this CPU, and fails a step whose rows depend on the bucket
    (negative control: attention that adds a term growing with the row count)."""
    step = _step(_model(torch.float32))
    assert step.probe() is None
    original = step.batch.attend

    def variant(layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return original(layer, query, scaling) + 1e-3 * step.batch.rows
    step.batch.attend = variant  # type: ignore[method-assign]
    assert step.probe() is not None


def _gen(model: torch.nn.Module, r: GenerationRequest) -> Generation:
    return Generation(r, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=512,
                      mode="vanilla", vocab_size=model.config.vocab_size)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_on_the_static_step_batched_equals_alone(dtype: torch.dtype, sampled: bool) -> None:
    model = _model(dtype)
    cases = prompt_cases(6, seed=4, max_prompt=300, max_new=30)
    requests = [GenerationRequest(tuple(p), SamplingParams(0.8, seed=i) if sampled else SamplingParams(),
                                  StopParams(max_new_tokens=b, ignore_eos=True))
                for i, (p, b) in enumerate(cases)]
    alone = [finish_alone(model, _gen(model, r), decode_step="static").token_ids for r in requests]
    engine = TargetEngine(model, KVPool(model, slots=3, max_len=512), max_batch_tokens=300,
                          decode_step="static")
    assert engine.static is not None
    batched = run_batched(engine, [_gen(model, r) for r in requests], join_every=2)
    assert [batched[i] for i in range(len(requests))] == alone


@pytest.mark.parametrize("sampled", [False, True])
def test_card_on_the_static_step_equals_vanilla(sampled: bool) -> None:
    """card through the static step equals plain decoding through it, greedy and seeded; the draft
    is the target itself in lockstep (its chains are ready at every step, whatever the machine's
    load), so chains are verified and kept."""
    model = target_model("qwen2", sharp=sampled)
    sampling = SamplingParams(0.8, seed=3) if sampled else SamplingParams()
    kept = 0
    with card_source(model, TreeParams(width=2, max_depth=5, max_chain=4), lockstep_depth=3) as card:
        for prompt, budget in prompt_cases(4, seed=2, max_prompt=80, max_new=30):
            stop = StopParams(max_new_tokens=budget, ignore_eos=True)
            request = GenerationRequest(tuple(prompt), sampling, stop)
            want = finish_alone(model, _gen(model, request), decode_step="static")
            gen = Generation(request, card, eos_ids=frozenset(), decode=letters, context_window=512,
                             mode="card", vocab_size=model.config.vocab_size)
            for _ in run_alone(model, gen, adaptive=False, decode_step="static"):
                pass
            assert gen.result is not None and gen.result.token_ids == want.token_ids, prompt
            kept += sum(n - 1 for n in gen.result.stats.accepted_lengths)
    assert kept > 0  # drafted tokens were kept: a wrong one would have been seen


def test_decode_step_modes() -> None:
    model = _model(torch.float32)
    pool = KVPool(model, slots=2, max_len=128)
    assert static_step_for(model, pool, "eager") is None
    assert static_step_for(model, pool, "auto") is None  # the CPU: eager pays more today
    assert isinstance(static_step_for(model, pool, "static"), StaticStep)
    with pytest.raises(ValueError):
        static_step_for(model, pool, "fast")
    with pytest.raises(ValueError):
        StaticStep(model, pool, 8, mode="graphs")  # no CUDA here


@pytest.mark.parametrize("prepack", [True, False], ids=["packed-inductor", "dense-aot_eager"])
def test_static_step_compiles_as_one_graph_per_shape(prepack: bool) -> None:
    """fullgraph=True: no graph break; after warm-up, three buckets replay without recompiling
    (dynamo's counters), and the compiled rows keep their bits across buckets. Packed linears
    (opaque oneDNN weights, which inductor cannot lower: a LoweringException without the op) are
    traced as the ``card::packed_linear`` op, and inductor compiles the rest around them; aot_eager
    runs the eager ops, so its rows are the eager bits too."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model(torch.float32, prepack=prepack)
    assert any(isinstance(m, PackedLinear) for m in model.modules()) == prepack
    step = _step(model, rows=16)
    eager = step.run([DecodeRows(0, 10, _tokens(4, 3))], 4).logits[:1].clone()
    step._fn = torch.compile(static_step.decode_forward, fullgraph=True, dynamic=False,
                             backend="inductor" if prepack else "aot_eager")
    tokens = _tokens(4, 3)
    first = {b: step.run([DecodeRows(0, 10, tokens[:min(b, 4)])], b).logits[:1].clone() for b in (1, 4, 16)}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3
    again = {b: step.run([DecodeRows(0, 10, tokens[:min(b, 4)])], b).logits[:1].clone() for b in (1, 4, 16)}
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile
    assert all(torch.equal(first[b], again[b]) for b in first)
    assert torch.equal(first[1], first[4]) and torch.equal(first[1], first[16])
    if not prepack:
        assert torch.equal(first[4], eager)  # aot_eager runs the same ops: the same bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_on_the_triton_attention_batched_equals_alone(dtype: torch.dtype) -> None:
    """The static step with the Triton decoding attention (the GPU's; here through Triton's
    interpreter): the probe passes, and a batch of generations equals each alone."""
    model = _model(dtype)
    pool = KVPool(model, slots=3, max_len=200)
    step = StaticStep(model, pool, 32, attention="triton")
    assert step.attention == "triton" and step.probe() is None
    cases = prompt_cases(4, seed=6, max_prompt=70, max_new=12)
    requests = [GenerationRequest(tuple(p), SamplingParams(), StopParams(max_new_tokens=b, ignore_eos=True))
                for p, b in cases]
    alone = []
    for r in requests:
        engine = TargetEngine(model, KVPool(model, slots=1, max_len=200))
        engine.static = StaticStep(model, engine.pool, 16, attention="triton")
        gen = _gen(model, r)
        for _ in engine.stream(gen):
            pass
        assert gen.result is not None
        alone.append(gen.result.token_ids)
    engine = TargetEngine(model, pool)
    engine.static = step
    batched = run_batched(engine, [_gen(model, r) for r in requests], join_every=2)
    assert [batched[i] for i in range(len(requests))] == alone


@pytest.mark.parametrize("attention", ["blocks", "triton"])
def test_static_step_computes_what_the_eager_forward_does(attention: str) -> None:
    """Same model, same history: the static step's logits are the eager forward's within rounding
    (a step that replayed stale buffers or attended the wrong rows would be far off)."""
    from card.engine.shared.kv_pool import Segment, forward

    model = _model(torch.float32)
    step = _step(model, rows=16)
    step.batch.kernel = None
    if attention == "triton":
        from card.engine.shared.triton_attention import decode_attention

        step.batch.kernel = decode_attention
    prompt, chain = _tokens(90, 8), _tokens(5, 9)
    for slot in (0, 1):  # the same prompt in two slots: one continues eagerly, one statically
        forward(model, step.pool, [Segment(slot, 0, len(prompt))], torch.tensor(prompt),
                torch.empty(0, dtype=torch.long))
    eager = forward(model, step.pool, [Segment(0, 90, len(chain), exact=True)], torch.tensor(chain),
                    torch.arange(len(chain)))
    static = step.run([DecodeRows(1, 90, chain)]).logits
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(static[1:], eager[:-1], atol=1e-2)  # the rows are really compared


def test_warm_runs_every_reachable_shape_on_the_scratch_slot() -> None:
    """``warm`` runs each (bucket, span) a configuration reaches, ghosts only: sessions untouched."""
    step = _step(_model(torch.float32), rows=8)
    before = [k[:step.pool.slots].clone() for k in step.pool.keys]
    assert step.warm(max_position=200) == len(step.buckets) * 3  # spans of 1, 2 and 4 blocks
    assert all(torch.equal(k[:step.pool.slots], b) for k, b in zip(step.pool.keys, before, strict=True))
    step.attention = "triton"  # one shape per bucket: the kernel walks each row's own blocks
    assert step.warm(max_position=200) == len(step.buckets)


def test_the_in_process_runner_takes_the_decode_step() -> None:
    from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
    from card.engine.loading.models import LoadedModel
    from card.engine.shared.config import Mode
    from card.engine.shared.errors import InvalidArgument
    from tests.engine.support import LetterTokenizer

    with pytest.raises(InvalidArgument):
        RunnerConfig(mode=Mode.VANILLA, decode_step="fast")
    model = _model(torch.float32)
    request = GenerationRequest((5, 6, 7), SamplingParams(), StopParams(max_new_tokens=12, ignore_eos=True))
    runner = InProcessRunner(LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), 512), None,
                             RunnerConfig(mode=Mode.VANILLA, decode_step="static"))
    got = runner.run(request)
    assert got.token_ids == finish_alone(model, _gen(model, request), decode_step="static").token_ids


def test_the_scratch_slot_is_zeroed_by_the_step_that_uses_it() -> None:
    """On the CPU the pool is torch.empty and an eager engine never touches the scratch slot (no
    resident pages); the static step zeroes it before its first ghost reads it, so every row of a
    step is finite (a NaN anywhere in a captured step is a bug waiting for a kernel that mixes
    rows). Negative control: over a NaN scratch slot that is not zeroed the ghosts' logits are NaN
    (and the live rows' still equal, as the step never mixes rows)."""
    model = _model(torch.float32)

    def logits(zero: bool) -> torch.Tensor:
        pool = KVPool(model, slots=2, max_len=300)
        pool.ready(0, 0, pool.keys[0].shape[2])
        for t in (*pool.keys, *pool.values):
            t[pool.scratch].fill_(float("nan"))  # what torch.empty may hold
        if not zero:
            pool.zero_scratch = lambda: None  # type: ignore[method-assign]
        step = StaticStep(model, pool, 8)
        if zero:
            assert all(bool((t[pool.scratch] == 0).all()) for t in (*pool.keys, *pool.values))
        step.run([DecodeRows(0, 0, _tokens(3, 2))], bucket=4)
        return static_step.decode_forward(model, step.batch)[0].clone()  # every row, ghosts too

    zeroed, raw = logits(zero=True), logits(zero=False)
    assert bool(torch.isfinite(zeroed).all())
    assert not bool(torch.isfinite(raw[3]).any())  # the ghost row
    assert torch.equal(zeroed[:3], raw[:3])
