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
SDPA's one-row path, in fp32 slower (docs/engine.md has the figures).

A prompt's rows (``attend_blocks``): a KV block of query rows per matmul, aligned to absolute
positions, at prefill speed (1.07-1.10x SDPA's prefill on this CPU). Where ``blocks_are_invariant``
holds, a prompt row gets a decoding row's bits, so a prompt's rows do not depend on its chunking and
the rows a session decoded are reusable as a prefill's (card.engine.shared.prefix_cache). Elsewhere
(CUDA) prompts keep SDPA: their shapes are fixed by the prompt's chunking
(card.engine.shared.kv_pool.PREFILL_CHUNK), the same alone and in any batch.

Many sessions at once (``RowPlan``): attending session by session costs ~15 small ops per
session per layer, which at 8 in flight was 45% of a SmolLM2 iteration on the CPU
(docs/performance.md). The plan is built once per forward: every tile of every session, grouped
by key span, goes through the same three ops as one batched matmul ([tiles x kv_heads] matrices
of the same fixed shape). A matrix's result in a batched matmul must not depend on how many
others ride with it: ``batched_is_invariant`` checks that on this device and dtype, with one
thread and with the process's count, against each tile alone; where it fails, and on CUDA (whose
library picks kernels by batch count, unverified here), sessions are attended one at a time.
A group of one tile (a session decoding alone) reads its slot's keys and values in place, a view
of the pool; larger groups gather theirs. The probe's lone tiles take the view and its batches the
gather, so it checks that the two read the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from card.engine.shared.torch_threads import probe_counts

QUERY_TILE = 4  # query rows per score matmul (longer chains take several tiles): a lone decoding
# row pays for 4, not for 8 (the matmul's cost grows with its rows; docs/performance.md)
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


@dataclass(frozen=True)
class Rows:
    """One session's decoding rows in a forward: ``n`` rows at positions ``start...`` of ``slot``,
    at rows ``offset...`` of the flattened query."""

    slot: int
    start: int
    n: int
    offset: int


@dataclass(frozen=True)
class _Group:
    """Tiles sharing one key span, as index tensors built once per forward (every layer reuses
    them): tile ``b`` reads slot ``slots[b]``; its QUERY_TILE query rows are flat rows ``query[b]``
    (padding repeats the tile's first row: a matmul's rows are independent, its output is
    dropped); ``bias`` [B, 1, 1, QUERY_TILE, span] float32, 0 where a query sees a key and -inf
    past it (the causal mask, added: cheaper than a masked fill); the tile rows ``take`` land on
    flat rows ``dest``; ``alone``: the slot of a group of one tile, whose keys and values are read
    in place (a view of the pool) instead of gathered, else -1."""

    span: int
    alone: int
    slots: torch.Tensor
    query: torch.Tensor
    bias: torch.Tensor
    take: torch.Tensor
    dest: torch.Tensor


class RowPlan:
    """Exact attention of many sessions' decoding rows at once (the module docstring, "Many
    sessions at once"): the tiles ``attend_rows`` would compute one session at a time, batched.
    The key rows of a span past a session's end must hold finite values (the KV pool zeroes them
    before a session first reaches them, card.engine.shared.kv_pool.KVPool.ready): a masked key's
    score is its own plus -inf, and its value is multiplied by a probability of exactly 0."""

    def __init__(self, sessions: Sequence[Rows], device: torch.device) -> None:
        by_span: dict[int, list[tuple[Rows, int, int]]] = {}
        for s in sessions:
            first = 0
            while first < s.n:  # attend_rows' tiles: rows sharing one span, at most QUERY_TILE
                rows_span = span(s.start + first)
                stop = min(s.n, first + QUERY_TILE, rows_span - s.start)
                by_span.setdefault(rows_span, []).append((s, first, stop - first))
                first = stop
        self.groups = [self._group(S, tiles, device) for S, tiles in sorted(by_span.items())]

    @staticmethod
    def _group(S: int, tiles: list[tuple[Rows, int, int]], device: torch.device) -> _Group:
        slots: list[int] = []
        query: list[int] = []
        masked: list[torch.Tensor] = []
        take: list[int] = []
        dest: list[int] = []
        cols = torch.arange(S)
        for b, (s, first, m) in enumerate(tiles):
            rows = [first + i if i < m else first for i in range(QUERY_TILE)]
            slots.append(s.slot)
            query.extend(s.offset + r for r in rows)
            masked.append(cols[None, :] > torch.tensor([s.start + r for r in rows])[:, None])  # [QT, S]
            take.extend(b * QUERY_TILE + i for i in range(m))
            dest.extend(s.offset + first + i for i in range(m))
        bias = torch.zeros(len(tiles), 1, 1, QUERY_TILE, S).masked_fill_(
            torch.stack(masked)[:, None, None], float("-inf"))
        return _Group(S, slots[0] if len(slots) == 1 else -1,
                      torch.tensor(slots, device=device), torch.tensor(query, device=device),
                      bias.to(device), torch.tensor(take, device=device), torch.tensor(dest, device=device))

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
               out: torch.Tensor) -> None:
        """``query`` [heads, T, dim] (the forward's flattened rows); one layer's ``keys`` /
        ``values`` [slots, kv_heads, rows, dim]; writes the planned rows of ``out`` [T, heads, dim]."""
        heads, _, dim = query.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        for g in self.groups:
            B = g.slots.numel()
            # [heads, B*QT, dim] -> [B, kv_heads, group*QT, dim]: the head group rides in M (GQA),
            # in the order attend_rows' tile has it
            q = query.index_select(1, g.query).view(kv_heads, group, B, QUERY_TILE, dim)
            q = q.permute(2, 0, 1, 3, 4).reshape(B, kv_heads, group * QUERY_TILE, dim)
            if g.alone >= 0:
                # one tile: its slot's keys in place, no copy of the span (attention alone ~2x faster
                # at 1,024 keys, the step 1.04-1.09x); the bits are the gathered copy's
                # (batched_is_invariant compares the two paths)
                k = keys[g.alone:g.alone + 1, :, :g.span]  # [1, kv_heads, S, dim]
                v = values[g.alone:g.alone + 1, :, :g.span]
            else:
                k = keys[:, :, :g.span].index_select(0, g.slots)  # [B, kv_heads, S, dim]
                v = values[:, :, :g.span].index_select(0, g.slots)
            scores = torch.matmul(q, k.transpose(2, 3)).float().mul_(scaling)  # [B, kvh, group*QT, S]
            scores = scores.view(B, kv_heads, group, QUERY_TILE, g.span).add_(g.bias)
            probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, kv_heads, group * QUERY_TILE, g.span)
            mixed = torch.matmul(probs, v).view(B, kv_heads, group, QUERY_TILE, dim)
            rows = mixed.permute(0, 3, 1, 2, 4).reshape(B * QUERY_TILE, heads, dim)  # [B*QT, heads, dim]
            out.index_copy_(0, g.dest, rows.index_select(0, g.take))


@functools.cache
def batched_is_invariant(device: torch.device, dtype: torch.dtype, kv_heads: int, group: int,
                         dim: int) -> bool:
    """Whether ``RowPlan`` gives each session's rows the same bits in a batch as alone here: 1,
    2, 5 and 9 sessions (chains of 1 to 8 rows, spans of one to four blocks), one thread and this
    process's count. Always False on CUDA (see the module docstring)."""
    if device.type != "cpu":
        return False
    gen = torch.Generator().manual_seed(0)
    slots, rows = 9, 4 * KV_BLOCK
    keys = torch.randn(slots, kv_heads, rows, dim, generator=gen).to(device, dtype)
    values = torch.randn(slots, kv_heads, rows, dim, generator=gen).to(device, dtype)
    lengths = [1, 8, 3, 1, 5, 2, 8, 1, 4]
    starts = [5, 60, 130, 191, 200, 63, 17, 250, 100]
    sessions, offset = [], 0
    for i, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        sessions.append(Rows(i, start, n, offset))
        offset += n
    query = torch.randn(kv_heads * group, offset, dim, generator=gen).to(device, dtype)
    threads = torch.get_num_threads()

    def run(chosen: Sequence[Rows]) -> torch.Tensor:
        out = query.new_zeros(offset, kv_heads * group, dim)
        RowPlan(chosen, device).attend(query, keys.clone(), values.clone(), dim ** -0.5, out)
        return out

    try:
        with torch.inference_mode():
            alone = [run([s]) for s in sessions]
            for count in probe_counts():
                torch.set_num_threads(count)
                for many in (2, 5, 9):
                    both = run(sessions[:many])
                    for s, ref in zip(sessions[:many], alone, strict=False):
                        part = slice(s.offset, s.offset + s.n)
                        if not torch.equal(both[part], ref[part]):
                            return False
    finally:
        torch.set_num_threads(threads)
    return True


# ---- a prompt's rows: one KV block of queries per matmul ------------------------------------------

def attend_blocks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                  scaling: float) -> torch.Tensor:
    """``attend_rows`` for a prompt's rows, at prefill speed: rows in blocks of KV_BLOCK query rows
    aligned to absolute positions (block b holds positions b*KV_BLOCK ...), each block one score
    and one value matmul of exactly ``group * KV_BLOCK`` rows (rows outside the call padded with
    zeros, their output dropped) over its key span ``span`` of its rows, all of which share it.
    Same arguments and result as ``attend_rows``.

    Why: a prompt's rows then get, where ``blocks_are_invariant`` holds on this device, the very
    bits a decoding row at the same position gets (a row's result depends on its own query and
    its span only), whatever the chunk they came in: a prompt may be prefilled from any cached
    row, and the rows a session decoded are as reusable as the ones it prefilled
    (card.engine.shared.prefix_cache). The decoding rows' tiles of QUERY_TILE rows would cost a
    prompt 16 times the matmuls, each over its own copy of the keys."""
    heads, n, dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    end = start + n
    keys[:, end:span(end - 1)] = 0  # junk rows of the last span (as attend_rows)
    values[:, end:span(end - 1)] = 0
    out = query.new_empty(n, heads, dim)
    tile = query.new_zeros(heads, KV_BLOCK, dim)
    first = start - start % KV_BLOCK
    while first < end:
        lo, hi, S = max(first, start), min(first + KV_BLOCK, end), first + KV_BLOCK
        tile.zero_()
        tile[:, lo - first:hi - first] = query[:, lo - start:hi - start]
        # [kv_heads, group * KV_BLOCK, dim] @ [kv_heads, dim, S]: the head group rides in M (GQA)
        scores = torch.matmul(tile.view(kv_heads, group * KV_BLOCK, dim), keys[:, :S].transpose(1, 2))
        scores = scores.float().mul_(scaling).view(kv_heads, group, KV_BLOCK, S)
        # the causal mask hides only keys of the block's own span past each query: fill just that
        # corner (a mask over all S columns cost a prompt ~6% of its prefill, for the same bits)
        scores[..., first:].masked_fill_(_upper(query.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads, group * KV_BLOCK, S)
        mixed = torch.matmul(probs, values[:, :S]).view(heads, KV_BLOCK, dim)
        out[lo - start:hi - start] = mixed[:, lo - first:hi - first].transpose(0, 1)
        first = S
    return out


@functools.cache
def _upper(device: torch.device) -> torch.Tensor:
    """[KV_BLOCK, KV_BLOCK] True where the query at a block's row i must not see the block's key j."""
    return torch.ones(KV_BLOCK, KV_BLOCK, dtype=torch.bool, device=device).triu_(1)


@functools.cache
def blocks_are_invariant(device: torch.device, dtype: torch.dtype, kv_heads: int, group: int,
                         dim: int) -> bool:
    """Whether ``attend_blocks`` gives every row the bits ``attend_rows`` (a decoding row's tile)
    gives it here: prompts starting at, ending at and crossing block edges, one thread and this
    process's count. Always False on CUDA, whose libraries pick kernels by M (unverified here):
    a prompt there keeps the vendor attention at fixed chunk boundaries."""
    if device.type != "cpu":
        return False
    gen = torch.Generator().manual_seed(0)
    rows = 5 * KV_BLOCK
    keys = torch.randn(kv_heads, rows, dim, generator=gen).to(device, dtype)
    values = torch.randn(kv_heads, rows, dim, generator=gen).to(device, dtype)
    query = torch.randn(kv_heads * group, rows, dim, generator=gen).to(device, dtype)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for count in probe_counts():
                torch.set_num_threads(count)
                for start, n in ((0, 1), (0, 3 * KV_BLOCK), (5, 70), (KV_BLOCK - 1, 2), (130, 190)):
                    q = query[:, start:start + n]
                    blocks = attend_blocks(q, keys.clone(), values.clone(), start, dim ** -0.5)
                    tiles = attend_rows(q, keys.clone(), values.clone(), start, dim ** -0.5)
                    if not torch.equal(blocks, tiles):
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


# ---- the block tree: attention whose per-row arithmetic is fixed by 64-key blocks ---------------

def read_blocks(keys: torch.Tensor, blocks: int) -> int:
    """Of a span of ``blocks`` KV_BLOCKs, how many the pool ``keys`` [slots, kv_heads, L, dim]
    holds (the rest count as masked)."""
    return min(blocks, keys.shape[2] // KV_BLOCK)


def block_tree(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
               hidden: torch.Tensor, blocks: int, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [heads, R, dim] (row r over slot ``slots[r]`` of ``keys``/``values``
    [slots, kv_heads, L, dim]) over a span of ``blocks`` KV_BLOCKs (a power of two), returning
    [R, heads, dim]; ``hidden`` (broadcastable to [R, 1, read_blocks, 1, KV_BLOCK], True = the row
    does not see that key) is the mask. Every key row read must be finite (0 * NaN is NaN).

    Each 64-key block is one matmul of one shape whatever the span or the rows beside it, giving
    the block's maximum, sum and weighted values; the blocks are combined by a fixed binary tree.
    The blocks a longer span adds sit in right subtrees, entirely masked when no row sees them, and
    combining with a masked subtree multiplies by exp(0) = 1 and adds exact zeros: a row's result
    is the one the longest span gives, bit for bit, whatever the step's shape (the target's static
    step, card.engine.shared.static_step, and the draft's tree rows, ``tree_attention``)."""
    heads, R, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    real = read_blocks(keys, blocks)
    k = keys[:, :, :real * KV_BLOCK].index_select(0, slots).view(R, kv_heads, real, KV_BLOCK, dim)
    v = values[:, :, :real * KV_BLOCK].index_select(0, slots).view(R, kv_heads, real, KV_BLOCK, dim)
    # heads h = kv * group + g (transformers' repeat_kv order): the group rides in M
    q = query.transpose(0, 1).reshape(R, kv_heads, 1, group, dim)
    # scores, softmax and the combine in float32 (float64 for a float64 model), as SDPA does inside
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(wide) * scaling  # [R, kvh, real, group, 64]
    scores = scores.masked_fill(hidden, float("-inf"))
    m = scores.amax(dim=-1)  # [R, kvh, real, group]; -inf for a block the row does not reach
    p = torch.exp(scores - _finite(m)[..., None])
    lsum = p.sum(dim=-1)
    acc = torch.matmul(p.to(v.dtype), v).to(wide)  # [R, kvh, real, group, dim]
    if real < blocks:  # the blocks past the pool: masked, the neutral element of the combine
        pad = blocks - real
        m = torch.cat([m, m.new_full((R, kv_heads, pad, group), float("-inf"))], dim=2)
        lsum = torch.cat([lsum, lsum.new_zeros(R, kv_heads, pad, group)], dim=2)
        acc = torch.cat([acc, acc.new_zeros(R, kv_heads, pad, group, dim)], dim=2)
    n = blocks
    while n > 1:  # the fixed tree: block pairs (0,1), (2,3), ... then their pairs
        n //= 2
        m2 = m.view(R, kv_heads, n, 2, group)
        l2 = lsum.view(R, kv_heads, n, 2, group)
        a2 = acc.view(R, kv_heads, n, 2, group, dim)
        m = torch.maximum(m2[:, :, :, 0], m2[:, :, :, 1])
        base = _finite(m)
        w0 = torch.exp(m2[:, :, :, 0] - base)
        w1 = torch.exp(m2[:, :, :, 1] - base)
        lsum = l2[:, :, :, 0] * w0 + l2[:, :, :, 1] * w1
        acc = a2[:, :, :, 0] * w0[..., None] + a2[:, :, :, 1] * w1[..., None]
    out = acc[:, :, 0] / lsum[:, :, 0, :, None]  # [R, kvh, group, dim]
    return out.to(query.dtype).reshape(R, heads, dim)




def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                   visible: torch.Tensor, blocks: int, scaling: float) -> torch.Tensor:
    """The draft's tree rows: ``query`` [heads, R, dim], row r over slot ``slots[r]``, seeing the
    key rows where ``visible`` [R, W] is True (its ancestors, itself and the committed prefix: a
    tree row sits at a KV row in expansion order, not at its position); keys past W are hidden.
    ``block_tree`` over ``blocks`` KV_BLOCKs (a power of two with blocks x KV_BLOCK >= the last
    visible key), so a row's result depends on its keys and its mask alone: not on its segment's
    length, the other sessions beside it, the span, or padding rows."""
    real = read_blocks(keys, blocks)
    width = real * KV_BLOCK
    R = visible.shape[0]
    if visible.shape[1] >= width:
        seen = visible[:, :width]
    else:
        seen = torch.zeros(R, width, dtype=torch.bool, device=visible.device)
        seen[:, :visible.shape[1]] = visible
    hidden = (~seen).view(R, 1, real, 1, KV_BLOCK)
    return block_tree(query, keys, values, slots, hidden, blocks, scaling)


def pow2_blocks(rows: int) -> int:
    """KV_BLOCKs of the smallest power-of-two span holding key rows [0, rows)."""
    need = max(1, -(-rows // KV_BLOCK))
    blocks = 1
    while blocks < need:
        blocks *= 2
    return blocks


def _finite(m: torch.Tensor) -> torch.Tensor:
    """A block maximum to subtract: -inf (nothing visible) becomes 0, so exp(-inf - 0) = 0."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)
