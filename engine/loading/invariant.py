"""A target forward whose every row is computed the same whatever shares the forward, per device.

Greedy card equals plain decoding only if the target's logits for a token are the same when it
rides in a chain of k rows, beside other sessions' rows, or alone. Attention is made so by
card.engine.shared.exact_attention; this module does the row-wise layers (linears, the LM head,
RMSNorm), choosing per device the fastest path that is invariant:

    CPU fp32, bf16   oneDNN-prepacked linears (card.engine.loading.cpu_linear), a lone row run as two:
                     invariant for M >= 2 and as fast or faster than the vendor path; fp32 on AVX2
                     CPUs: the panel kernel (card.engine.loading.panel_gemm), invariant by
                     construction at every row count
    CPU fp16, fp64   the vendor nn.Linear where it is invariant (on CPUs without AVX512-FP16 its
                     fp16 path is one matrix-vector product per row), else fixed tiles
    CUDA (any dtype) fixed tiles: rows are computed TILE_ROWS at a time, the last tile padded, so
                     cuBLAS and the norm's reduction always see one shape and pick one kernel
                     (Thinking Machines' fixed-tile matmul idea, without a custom kernel)

Invariance is checked, not assumed: ``probe`` runs each distinct layer on 1, 2, 3, 9 and 40 rows,
with one thread and with the current count, and compares every row bitwise with that row alone. On
a CPU, a layer kind that fails is probed again at every row count up to CHUNK_PROBE_ROWS
(``invariant_rows``): a kernel that switches paths only above some count (oneDNN's bf16 matmul on
AMX: one kernel up to 32 rows, another above) runs in unpadded chunks of at most that many rows
(``RowChunks``: a decoding row costs one call, a 256-row prefill chunk eight). Otherwise, and on
CUDA, the layer is wrapped in fixed tiles, which are invariant by construction whenever a kernel
is deterministic for a fixed shape.

``exact=False`` (--exact off) keeps the packing where it is faster and drops the rest: no padding,
no tiles; outputs are then marked inexact (GenerationStats.exact).
"""

from __future__ import annotations

import logging

import torch

from card.engine.loading.cpu_linear import PackedLinear, can_pack, pack_linears
from card.engine.loading.fused_linear import fuse_siblings
from card.engine.loading.panel_gemm import choose
from card.engine.shared.hf import CausalLM
from card.engine.shared.torch_threads import probe_counts

log = logging.getLogger(__name__)

TILE_ROWS = 64  # rows per fixed tile on CUDA: a decode batch of 8 sessions x 8-row chains in one
# On a CPU a tile's rows cost their full matrix product (no idle lanes to hide them in), and a lone
# decode row would pay 64 rows of it (the LM head's above all): tiles there are a chain's width
CPU_TILE_ROWS = 8
PROBE_ROWS = (1, 2, 3, 9, 40)
# the most rows ``invariant_rows`` tries on a CPU: every count up to it is one forward per thread
# count (about 2,100 rows of each distinct layer shape; under a second for a 49k-row LM head)
CHUNK_PROBE_ROWS = 64


class FixedTiles(torch.nn.Module):
    """``inner`` applied to rows in tiles of exactly ``tile`` rows (the last one zero-padded):
    every call of ``inner`` has one shape, so a row's result cannot depend on how many rows came.

    ``direct``: row counts ``inner`` takes in one call instead, because a probe on this device
    showed each row's result at those counts (and at ``tile``, which the tiles use) bitwise equal
    to the row alone: the static step's buckets, one launch per linear (``probe_direct``)."""

    def __init__(self, inner: torch.nn.Module, tile: int = TILE_ROWS,
                 direct: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.inner = inner
        self.tile = tile
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., width] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if n in self.direct:
            return self.inner(x)
        padded = -(-n // self.tile) * self.tile
        if padded != n:
            rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
        tiles = rows.view(padded // self.tile, 1, self.tile, rows.shape[1])  # [tiles, 1, tile, width]
        out = torch.cat([self.inner(t) for t in tiles], dim=1)[0, :n]  # [n, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"tile={self.tile}"


class RowChunks(torch.nn.Module):
    """``inner`` applied to consecutive chunks of at most ``rows`` rows, the last one as it comes
    (no padding): for a kernel that ``invariant_rows`` found to give every row its alone bits at
    every count up to ``rows``, so each chunk's rows are as alone, and so is every row."""

    def __init__(self, inner: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., width] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.rows:
            return self.inner(x)
        out = torch.cat([self.inner(part) for part in flat.split(self.rows)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"rows<={self.rows}"


def make_exact(model: torch.nn.Module, exact: bool = True, prepack: bool = True,
               cpu_linear: str = "auto") -> str:
    """Prepare ``model``'s row-wise layers for the engine (in place); returns how, for the logs.
    ``cpu_linear``: the packed linears' kernel (card.engine.loading.panel_gemm.choose)."""
    device = next(model.parameters()).device
    packed = prepack and can_pack(model)
    fused = 0
    packing = ""
    if packed:
        kernel = choose(cpu_linear, next(model.parameters()).dtype)
        fused = fuse_siblings(model, lambda linear: PackedLinear(linear, pad_single_row=exact, kernel=kernel))
        pack_linears(model, pad_single_row=exact, cpu_linear=kernel)
        packing = "panel-kernel linears (AVX2)" if kernel == "panel" else "oneDNN-packed linears"
        if fused:
            packing += f" ({fused} sibling groups fused)"
    if not exact:
        return packing if packed else "vendor kernels"
    tiled: set[str] = set()
    tile = CPU_TILE_ROWS if device.type == "cpu" else TILE_ROWS
    direct: set[str] = set()
    if device.type == "cuda":  # split-K in reduced precision would make a row's sum depend on M
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    chunked: dict[str, int] = {}
    for layers in _row_wise_layers(model).values():
        if device.type == "cuda" or not probe(layers[0]):
            chunk = invariant_rows(layers[0]) if device.type == "cpu" else 0
            # chunks of up to ``chunk`` rows: fewer calls than tiles, no padding; kept only if the
            # chunked layer passes the same probe as any other (other inputs, other row counts)
            if chunk >= CPU_TILE_ROWS and probe(RowChunks(layers[0], chunk)):
                name = type(layers[0]).__name__
                chunked[name] = min(chunk, chunked.get(name, chunk))
                _wrap(model, {id(layer) for layer in layers}, chunk, chunks=True)
                continue
            tiled.add(type(layers[0]).__name__)
            rows = probe_direct(layers[0], tile) if device.type == "cuda" else frozenset()
            if rows:
                direct.add(type(layers[0]).__name__)
            _wrap(model, {id(layer) for layer in layers}, tile, rows)
    how = packing if packed else "vendor row-wise kernels"
    if chunked:
        how += "; " + ", ".join(f"chunks of <= {n} rows for {name}" for name, n in sorted(chunked.items()))
    if tiled:
        how += f"; fixed {tile}-row tiles for {', '.join(sorted(tiled))}"
    if direct:
        how += f" (one call at the static step's buckets for {', '.join(sorted(direct))}: probed)"
    log.info("exact forward on %s: %s", device, how)
    return how


def probe(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` gives every row the same bits in forwards of PROBE_ROWS rows as alone,
    with one thread and with this process's thread count."""
    device, dtype = _device_dtype(layer)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, max(PROBE_ROWS), _width(layer), generator=gen).to(device, dtype)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            alone = [layer(x[:, i:i + 1]) for i in range(max(PROBE_ROWS))]
            for count in probe_counts():
                torch.set_num_threads(count)
                for m in PROBE_ROWS:
                    out = layer(x[:, :m])
                    if not all(torch.equal(out[:, i:i + 1], alone[i]) for i in range(m)):
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


def invariant_rows(layer: torch.nn.Module, most: int = CHUNK_PROBE_ROWS) -> int:
    """The largest power of two ``n <= most`` such that a forward of every count ``m <= n`` of
    rows gives each row the same bits as that row alone, with one thread and with this process's
    thread count (0 if even two rows differ): the chunk ``RowChunks`` may run ``layer`` in."""
    device, dtype = _device_dtype(layer)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, most, _width(layer), generator=gen).to(device, dtype)
    threads = torch.get_num_threads()
    good = most
    try:
        with torch.inference_mode():
            alone = [layer(x[:, i:i + 1]) for i in range(most)]
            for count in probe_counts():
                torch.set_num_threads(count)
                for m in range(2, good + 1):
                    out = layer(x[:, :m])
                    if not all(torch.equal(out[:, i:i + 1], alone[i]) for i in range(m)):
                        good = m - 1
                        break
    finally:
        torch.set_num_threads(threads)
    return 1 << (good.bit_length() - 1) if good >= 2 else 0


def probe_direct(layer: torch.nn.Module, tile: int) -> frozenset[int]:
    """The static step's row buckets at which ``layer`` may run in one call: all of them, if every
    row of a forward of each bucket's rows (and of ``tile`` rows, the tiles' one shape) is bitwise
    the row alone; else none (the tiles stay)."""
    from card.engine.shared.static_step import ROW_BUCKETS

    param = next(layer.parameters())
    gen = torch.Generator().manual_seed(1)
    rows = max(*ROW_BUCKETS, tile)
    x = torch.randn(1, rows, _width(layer), generator=gen).to(param.device, param.dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[:, i:i + 1]) for i in range(rows)], dim=1)
        for m in sorted({*ROW_BUCKETS, tile}):
            if not torch.equal(layer(x[:, :m]), alone[:, :m]):
                return frozenset()
    return frozenset(ROW_BUCKETS) | {tile}


def _device_dtype(layer: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    inner = layer.inner if isinstance(layer, FixedTiles | RowChunks) else layer
    if isinstance(inner, PackedLinear):  # its weight is opaque: it keeps its dtype aside
        return torch.device("cpu"), inner.dtype
    param = next(inner.parameters())
    return param.device, param.dtype


def _row_wise_layers(model: torch.nn.Module) -> dict[tuple, list[torch.nn.Module]]:
    """The row-wise layers (linears, packed or not, and RMSNorms) grouped by kind and shape: a
    kernel's path depends on the shape, so each group is probed on its own."""
    groups: dict[tuple, list[torch.nn.Module]] = {}
    for module in model.modules():
        kind = type(module)
        if kind in (torch.nn.Linear, PackedLinear) or kind.__name__.endswith("RMSNorm"):
            key = (kind, _width(module), getattr(module, "out_features", None))
            groups.setdefault(key, []).append(module)
    return groups


def _wrap(model: torch.nn.Module, chosen: set[int], tile: int, direct: frozenset[int] = frozenset(),
          chunks: bool = False) -> None:
    for parent in list(model.modules()):
        if isinstance(parent, FixedTiles | RowChunks):
            continue
        for name, child in list(parent.named_children()):
            if id(child) in chosen:
                setattr(parent, name, RowChunks(child, tile) if chunks else FixedTiles(child, tile, direct))


def _width(layer: CausalLM) -> int:  # a Linear, or a layer with ``weight`` [.., in]
    if isinstance(layer, FixedTiles | RowChunks):
        layer = layer.inner
    if hasattr(layer, "in_features"):
        return int(layer.in_features)
    return int(layer.weight.shape[-1])
