"""Attention for the target's decoding rows whose arithmetic depends on the row alone.

Why: a verification forwards ``[next_token, *chain]`` (n rows) where plain decoding forwards one,
and a busy batch puts other sessions' rows beside them. With the vendor attention (SDPA) a row's
result depends on n (measured on this CPU: every row of a 2-8 row query differs from the same row
alone, fp32 by ~1e-7, bf16 and fp16 by an ulp or more), and on a GPU the kernel itself changes
with the query length. A near-tie then flips, and card stops equalling plain decoding.

How: every reduction runs over a shape fixed by the row's own position, never by its neighbours
(the batch-invariant recipe of Thinking Machines' batch_invariant_ops, here for attention):

    query tile   rows go through the score and value matmuls in tiles of exactly QUERY_TILE query
                 rows (padded), so the matmul's M never varies with the chain length
    key span     a row at position p attends over the slot's first round_up(p + 1, KV_BLOCK) rows,
                 columns past p masked to -inf, so N and the softmax length depend on p alone;
                 rows of one segment whose spans differ (the chain crosses a block edge) go in
                 separate tiles
    padding      the span's rows past the segment's end are zeroed first (they are junk the next
                 forward overwrites): a masked column multiplies a zero value, never a stale NaN

Scores and softmax are computed in float32 whatever the cache dtype (as SDPA does inside), the
probabilities cast back to the cache dtype for the value matmul (as transformers' eager attention).
Each of the three ops is deterministic for a fixed shape on the CPU and on CUDA, and a row's
output is its own: so a row's result equals the plain step's at the same position by construction.
tests/engine/test_invariance.py checks it bit for bit, with SDPA as the negative control.

Cost: the tile computes QUERY_TILE rows even for one; on the CPU in bf16 it is still faster than
SDPA's one-row path, in fp32 slower (docs/engine.md has the figures). Prefill chunks keep SDPA:
their shapes are fixed by the prompt's chunking (card.engine.shared.kv_pool.PREFILL_CHUNK), the same
alone and in any batch.
"""

from __future__ import annotations

import torch

QUERY_TILE = 8  # query rows per score matmul: 1 + the longest chain verified in one tile
KV_BLOCK = 64  # keys are attended in spans of whole blocks of this many rows


def span(position: int) -> int:
    """Key rows a query at ``position`` attends over (a whole number of KV_BLOCKs)."""
    return -(-(position + 1) // KV_BLOCK) * KV_BLOCK


def attend_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                scaling: float) -> torch.Tensor:
    """Causal attention of ``query`` [heads, n, dim] (rows at positions start...start+n-1) over
    one slot's ``keys``/``values`` [kv_heads, rows, dim] (rows >= span(start + n - 1); written up to
    start + n); returns [n, heads, dim] in the query's dtype. Zeroes the slot's rows past start + n
    within the last span (junk rows)."""
    heads, n, dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    end = start + n
    last = span(end - 1)
    keys[:, end:last] = 0
    values[:, end:last] = 0
    out = query.new_empty(n, heads, dim)
    first = 0
    while first < n:
        # the rows [first, stop) share one span and fit one tile
        rows_span = span(start + first)
        stop = min(n, first + QUERY_TILE, rows_span - start)
        _tile(query[:, first:stop], keys[:, :rows_span], values[:, :rows_span], start + first,
              scaling, group, out[first:stop])
        first = stop
    return out


def _tile(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, scaling: float,
          group: int, out: torch.Tensor) -> None:
    """One tile: query [heads, m, dim] (m <= QUERY_TILE) at positions position...; keys/values
    [kv_heads, S, dim]; writes out [m, heads, dim]."""
    heads, m, dim = query.shape
    kv_heads, rows, _ = keys.shape
    tile = query.new_zeros(heads, QUERY_TILE, dim)
    tile[:, :m] = query
    # [kv_heads, group * QUERY_TILE, dim] @ [kv_heads, dim, S]: the head group rides in M (GQA)
    scores = torch.matmul(tile.view(kv_heads, group * QUERY_TILE, dim), keys.transpose(1, 2))
    scores = scores.float().mul_(scaling).view(kv_heads, group, QUERY_TILE, rows)
    positions = torch.arange(position, position + QUERY_TILE, device=keys.device)
    positions[m:] = position  # padding rows: any valid mask (their output is dropped)
    masked = torch.arange(rows, device=keys.device)[None, :] > positions[:, None]  # [QUERY_TILE, S]
    scores.masked_fill_(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads, group * QUERY_TILE, rows)
    mixed = torch.matmul(probs, values).view(heads, QUERY_TILE, dim)  # [heads, QUERY_TILE, dim]
    out.copy_(mixed[:, :m].transpose(0, 1))
