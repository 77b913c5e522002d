"""Decoding attention as one Triton kernel per layer, for the static step on a GPU
(card.engine.shared.static_step): every decoding row of every session in one launch.

One program per (row, kv head): it loads the row's query heads of that kv head (the GQA group, in
the M dimension of its matmuls), then walks the row's own key blocks, 64 keys each, from block 0
up to the block holding the row's position, in that order, with an online softmax (running max,
running sum, running weighted values, all float32). Both matmuls take float32 operands (keys and
values upcast as loaded; on a GPU tl.dot runs them as TF32, which holds a bf16 or fp16 key exactly):
the kernel is memory-bound, and Triton's interpreter mishandles bf16 matmuls. Keys past the row's
position are masked, and their values are loaded as zeros, so junk rows of a rejected chain can
never leak, even as NaN.

Why this is batch-invariant by construction: a program's arithmetic depends on its row's query,
its slot's keys and values and its position, never on the grid: how many rows or sessions ride
in the step only changes how many programs run. The reduction over keys is in fixed 64-key blocks
in a fixed order; nothing is split across programs (no split-K), so no combine order can vary.
``StaticStep.probe`` still checks the whole step bitwise at start-up on the device.

Tested on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is
first imported): tests/engine/test_triton_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from card.engine.shared.exact_attention import KV_BLOCK


@triton.jit
def _decode_attention(Q, K, V, Out, Slots, Positions, scale,
                      stride_qr, stride_qh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
                      stride_or, stride_oh,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    kv = tl.program_id(1)
    slot = tl.load(Slots + row).to(tl.int64)
    pos = tl.load(Positions + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    heads = kv * GROUP + g
    q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP,
                other=0.0).to(tl.float32)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    lsum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM), tl.float32)
    k_base = K + slot * stride_ks + kv * stride_kh
    v_base = V + slot * stride_vs + kv * stride_vh
    for b in range(0, pos // BLOCK + 1):
        n = b * BLOCK + tl.arange(0, BLOCK)
        seen = n <= pos
        k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=seen[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32))) * scale  # [GROUP_PAD, BLOCK]
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=seen[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        m = m_new
    out = acc / lsum[:, None]
    tl.store(Out + row * stride_or + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=g[:, None] < GROUP)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scaling: float) -> torch.Tensor:
    """``query`` [heads, R, dim] (row r in slot ``slots[r]`` at ``positions[r]``) over
    ``keys``/``values`` [slots, kv_heads, L, dim] (last dimension contiguous); returns [R, heads,
    dim] in the query's dtype. A row sees its slot's keys 0..position, written."""
    heads, rows, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if dim & (dim - 1) or keys.stride(-1) != 1 or values.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("decode_attention needs a power-of-two head dim and contiguous last dimensions")
    out = query.new_empty(rows, heads, dim)
    # tl.dot wants M >= 16 on GPUs; the padded query rows are masked out of the loads and stores
    group_pad = max(16, triton.next_power_of_2(group))
    _decode_attention[(rows, kv_heads)](
        query, keys, values, out, slots, positions, scaling,
        query.stride(1), query.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, BLOCK=KV_BLOCK)
    return out
