"""The attention kernel (card.engine.shared.row_attention): built here with the system compiler,
every row the bits of that row alone whatever rows, sessions, prompt chunking or threads are beside
it, close to float64 attention, and the pool's choice of it (a model on it decoding many requests
in flight: tests/engine/test_invariance.py, test_many_in_flight_equal_alone)."""

from __future__ import annotations

import pytest
import torch

from card.engine.loading.c_kernels import Unavailable
from card.engine.shared import row_attention
from card.engine.shared.exact_attention import KV_BLOCK, Rows
from card.engine.shared.kv_pool import KVPool, Segment
from card.engine.shared.kv_pool import forward as pool_forward
from card.engine.shared.row_attention import RowKernel, rows_are_invariant
from tests.tiny_models import tiny_model

SLOTS, LENGTH = 6, 4 * KV_BLOCK


def _cache(kv_heads: int, dim: int, seed: int = 0,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(SLOTS, kv_heads, LENGTH, dim, generator=gen).to(dtype),
            torch.randn(SLOTS, kv_heads, LENGTH, dim, generator=gen).to(dtype))


def _attend(sessions: list[Rows], query: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor) -> torch.Tensor:
    out = torch.full((query.shape[1], query.shape[0], query.shape[2]), float("nan"), dtype=query.dtype)
    RowKernel(sessions).attend(query, keys, values, query.shape[2] ** -0.5, out)
    return out


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: Rows) -> torch.Tensor:
    """float64 SDPA of session ``s``'s rows: [n, heads, dim]."""
    q = query[:, s.offset:s.offset + s.n].double()[None]
    end = s.start + s.n
    k, v = keys[s.slot, :, :end].double()[None], values[s.slot, :, :end].double()[None]
    mask = torch.arange(end)[None] <= torch.arange(s.start, end)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            enable_gqa=True)[0].transpose(0, 1)


def test_the_kernel_builds_on_this_machine() -> None:
    """CI runs on x86-64 machines with AVX2 and a C compiler: the kernel must build there (a build
    that silently failed would leave every pool on the torch path and these tests on nothing)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert row_attention.runs_here(torch.device("cpu"), dtype, 64) is None
        assert rows_are_invariant(2, 2, 64, dtype)


# (dtype, tolerance against float64): one rounding of the output to its dtype, fp32 inside
TOLERANCES = {torch.float32: (1e-5, 2e-6), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(2, 2, 64), (3, 3, 64), (1, 4, 128), (2, 1, 8)])
def test_every_row_is_its_alone_bits_and_close_to_float64(kv_heads: int, group: int, dim: int,
                                                          dtype: torch.dtype) -> None:
    """Decoding rows, chains crossing a block edge and a prompt from row 0, six sessions in one
    call: each row's output is its bits alone (one row, one thread) at one and two threads, and
    within one rounding to its dtype of float64 attention."""
    keys, values = _cache(kv_heads, dim, dtype=dtype)
    sessions = [Rows(0, 0, 1, 0), Rows(1, 60, 8, 1), Rows(2, 100, 3, 9), Rows(3, 0, 130, 12),
                Rows(4, LENGTH - 1, 1, 142), Rows(5, 63, 2, 143)]
    total = 145
    query = torch.randn(kv_heads * group, total, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.empty(total, kv_heads * group, dim, dtype=dtype)
        for s in sessions:
            for i in range(s.n):
                r = s.offset + i
                alone[r] = _attend([Rows(s.slot, s.start + i, 1, r)], query, keys, values)[r]
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(_attend(sessions, query, keys, values), alone)
            # sessions in another order, and a prompt split in two chunks: the same bits
            assert torch.equal(_attend(sessions[::-1], query, keys, values), alone)
            split = [Rows(3, 0, 70, 12), Rows(3, 70, 60, 82)]
            assert torch.equal(_attend(split, query, keys, values)[12:142], alone[12:142])
    finally:
        torch.set_num_threads(threads)
    rtol, atol = TOLERANCES[dtype]
    for s in sessions:
        got = alone[s.offset:s.offset + s.n].double()
        torch.testing.assert_close(got, _reference(query, keys, values, s), rtol=rtol, atol=atol)


def test_a_row_sees_exactly_its_own_keys() -> None:
    """Negative controls: changing a key past a row's position leaves it alone (masked, even when
    that key is NaN), changing one at or before it changes it, and another slot is another result."""
    keys, values = _cache(2, 64)
    query = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(2))
    row = [Rows(1, 70, 1, 0)]
    base = _attend(row, query, keys, values)
    later = keys.clone()
    later[1, :, 71:80] = float("nan")  # inside the 8-key group the kernel reads: its scores dropped
    assert torch.equal(_attend(row, query, later, values), base)
    later_values = values.clone()
    later_values[1, :, 71:] = float("nan")
    assert torch.equal(_attend(row, query, keys, later_values), base)
    own = keys.clone()
    own[1, :, 70] += 1.0
    assert not torch.equal(_attend(row, query, own, values), base)
    first = values.clone()
    first[1, :, 0] += 1.0
    assert not torch.equal(_attend(row, query, keys, first), base)
    assert not torch.equal(_attend([Rows(2, 70, 1, 0)], query, keys, values), base)


def test_two_neighbouring_prompt_rows_in_one_item_see_exactly_their_own_keys() -> None:
    """A prompt's rows at positions 70 and 71 go through one work item (attend_pair): the first
    row does not see the second's own key and value even when they are NaN, the second does, and
    keys past both change neither; each equals itself computed alone."""
    keys, values = _cache(2, 64)
    query = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(4))
    pair = [Rows(1, 70, 2, 0)]
    alone = [_attend([Rows(1, 70 + i, 1, i)], query, keys, values)[i] for i in range(2)]
    base = _attend(pair, query, keys, values)
    assert torch.equal(base[0], alone[0]) and torch.equal(base[1], alone[1])
    keys2, values2 = keys.clone(), values.clone()
    keys2[1, :, 71], values2[1, :, 71] = float("nan"), float("nan")
    keys2[1, :, 72:80] = float("nan")
    got = _attend(pair, query, keys2, values2)
    assert torch.equal(got[0], base[0])
    assert got[1].isnan().all()  # the second row's own key and value reach it
    later = keys.clone()
    later[1, :, 72:80] = float("nan")
    assert torch.equal(_attend(pair, query, later, values), base)


def test_the_pool_takes_the_kernel_for_fp32_and_torch_where_asked() -> None:
    """``auto`` takes the kernel for fp32 CPU models and the torch paths for bf16 and fp16 (whose
    prefill oneDNN's bf16 matmuls run faster), ``kernel`` takes it for all three, ``torch`` never;
    ``kernel`` where it cannot run (fp64) fails at load, not at a request."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = tiny_model("llama", vocab=64, hidden=64, layers=1, dtype=dtype)
        assert KVPool(model, slots=1, max_len=8).row_kernel == (dtype == torch.float32)
        row_attention.record(model, "kernel")
        assert KVPool(model, slots=1, max_len=8).row_kernel
        row_attention.record(model, "torch")
        assert not KVPool(model, slots=1, max_len=8).row_kernel
    fp64 = tiny_model("llama", vocab=64, hidden=64, layers=1, dtype=torch.float64)
    assert not KVPool(fp64, slots=1, max_len=8).row_kernel
    with pytest.raises(Unavailable, match="fp32, bf16 and fp16"):
        row_attention.record(fp64, "kernel")
    with pytest.raises(ValueError):
        row_attention.record(model, "sdpa")


@torch.inference_mode()
def test_a_forward_on_the_kernel_is_close_to_the_torch_path() -> None:
    """The same prompt and decoding rows through a pool on the kernel and one on the torch paths:
    logits within fp32 rounding of each other (their bits differ: one engine uses one path)."""
    model = tiny_model("llama", vocab=64, hidden=64, layers=2, dtype=torch.float32)
    prompt = torch.randint(0, 64, (90,), generator=torch.Generator().manual_seed(3))
    logits = {}
    for setting in ("kernel", "torch"):
        row_attention.record(model, setting)
        pool = KVPool(model, slots=1, max_len=128)
        first = pool_forward(model, pool, [Segment(0, 0, 89, exact=True, prefill=True)], prompt[:89],
                             torch.tensor([88]))
        step = pool_forward(model, pool, [Segment(0, 89, 1, exact=True)], prompt[89:], torch.tensor([0]))
        logits[setting] = torch.cat([first, step])
    torch.testing.assert_close(logits["kernel"], logits["torch"], rtol=1e-4, atol=1e-5)


def test_tree_rows_see_exactly_their_mask_and_match_sdpa() -> None:
    """A draft's tree rows (``trees``): each row attends the keys its ``visible`` row marks, beside
    causal rows in the same call, within fp32 rounding of float64 SDPA with that mask; a key it
    does not see may even be NaN (negative control: flipping one visible bit changes the row)."""
    keys, values = _cache(2, 64)
    gen = torch.Generator().manual_seed(4)
    committed, n = 50, 6  # six tree rows written at rows 50..55 of slot 3, over a committed prefix
    visible = torch.zeros(n, committed + n, dtype=torch.bool)
    visible[:, :committed] = True
    parents = [-1, -1, 0, 0, 2, 1]  # rows 0 and 1 are children of the prefix, the rest of a row above
    for i, parent in enumerate(parents):
        visible[i, committed + i] = True
        while parent >= 0:
            visible[i, committed + parent] = True
            parent = parents[parent]
    causal = Rows(1, 30, 2, 0)
    tree = Rows(3, committed, n, 2)
    query = torch.randn(4, 2 + n, 64, generator=gen)
    out = torch.full((2 + n, 4, 64), float("nan"))
    RowKernel([causal], [(tree, visible)]).attend(query, keys, values, 0.125, out)
    q = query[:, 2:].double()[None]
    k, v = keys[3, :, :committed + n].double()[None], values[3, :, :committed + n].double()[None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125,
                                                            enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out[2:].double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out[:2].double(), _reference(query, keys, values, causal), rtol=1e-5,
                               atol=2e-6)
    hidden = keys.clone()
    hidden[3, :, committed + 1] = float("nan")  # row 1 is no ancestor of rows 0, 2, 3, 4
    again = torch.full_like(out, float("nan"))
    RowKernel([causal], [(tree, visible)]).attend(query, hidden, values, 0.125, again)
    assert torch.equal(again[[0, 1, 2, 4, 5, 6]], out[[0, 1, 2, 4, 5, 6]])
    flipped = visible.clone()
    flipped[4, 10] = False
    RowKernel([causal], [(tree, flipped)]).attend(query, keys, values, 0.125, again)
    assert not torch.equal(again[6], out[6]) and torch.equal(again[2:6], out[2:6])
