"""The Triton decoding attention (card.engine.shared.triton_attention), on the CPU through Triton's
interpreter: each row's output is the same bits alone as beside any rows and sessions, at spans of
1-4 key blocks; it is attention (SDPA within tolerance); junk past a row's position never leaks."""

from __future__ import annotations

import pytest
import torch

# no GPU: tests/conftest.py has set TRITON_INTERPRET=1 before anything imported triton
from card.engine.shared import triton_attention

SLOTS, KV_HEADS, GROUP, DIM, ROWS = 8, 2, 3, 16, 256


def _pool(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(SLOTS, KV_HEADS, ROWS, DIM, generator=gen).to(dtype)
    values = torch.randn(SLOTS, KV_HEADS, ROWS, DIM, generator=gen).to(dtype)
    return keys, values


def _rows(n_sessions: int, chain: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chain`` consecutive rows for each of ``n_sessions`` sessions, at starts spread over 1-4 blocks."""
    gen = torch.Generator().manual_seed(seed)
    slots, positions = [], []
    for s in range(n_sessions):
        start = int(torch.randint(0, ROWS - chain, (1,), generator=gen))
        slots += [s] * chain
        positions += list(range(start, start + chain))
    return torch.tensor(slots), torch.tensor(positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_same_bits_alone_and_batched(dtype: torch.dtype) -> None:
    keys, values = _pool(dtype)
    gen = torch.Generator().manual_seed(1)
    for sessions, chain in ((1, 1), (1, 8), (3, 4), (8, 1), (8, 5)):
        slots, positions = _rows(sessions, chain, seed=sessions * 10 + chain)
        query = torch.randn(KV_HEADS * GROUP, len(slots), DIM, generator=gen).to(dtype)
        both = triton_attention.decode_attention(query, keys, values, slots, positions, DIM ** -0.5)
        for r in range(len(slots)):
            alone = triton_attention.decode_attention(query[:, r:r + 1].contiguous(), keys, values,
                                                      slots[r:r + 1], positions[r:r + 1], DIM ** -0.5)
            assert torch.equal(both[r], alone[0]), (sessions, chain, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_is_attention(dtype: torch.dtype) -> None:
    keys, values = _pool(dtype)
    slots = torch.tensor([0, 1, 2, 3, 4, 5])
    positions = torch.tensor([0, 5, 63, 64, 130, 255])  # one to four blocks, block edges
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(KV_HEADS * GROUP, len(slots), DIM, generator=gen).to(dtype)
    out = triton_attention.decode_attention(query, keys, values, slots, positions, DIM ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r, (s, p) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        k = keys[s, :, :p + 1].repeat_interleave(GROUP, dim=0).float()
        v = values[s, :, :p + 1].repeat_interleave(GROUP, dim=0).float()
        ref = torch.nn.functional.scaled_dot_product_attention(query[:, r:r + 1].float(), k, v)
        torch.testing.assert_close(out[r].float(), ref[:, 0], atol=tol, rtol=tol)


def test_junk_past_a_rows_position_never_leaks() -> None:
    """Rows past a row's position hold NaN (a rejected chain's junk, never-written memory): the
    output is the same as with zeros there; negative control: the same NaN at a seen row shows."""
    keys, values = _pool(torch.float32)
    slots, positions = torch.tensor([0, 1]), torch.tensor([70, 10])
    query = torch.randn(KV_HEADS * GROUP, 2, DIM, generator=torch.Generator().manual_seed(3))
    clean = triton_attention.decode_attention(query, keys, values, slots, positions, DIM ** -0.5)
    keys[0, :, 71:], values[0, :, 71:], keys[1, :, 11:], values[1, :, 11:] = (float("nan"),) * 4
    assert torch.equal(triton_attention.decode_attention(query, keys, values, slots, positions, DIM ** -0.5),
                       clean)
    values[0, :, 70] = float("nan")
    out = triton_attention.decode_attention(query, keys, values, slots, positions, DIM ** -0.5)
    assert torch.isnan(out[0]).all() and torch.equal(out[1], clean[1])
