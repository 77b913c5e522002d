"""The target's exact attention on the CPU as one C call per layer (row_attention.c).

Why: through torch, exact attention (card.engine.shared.exact_attention) is ~20 small ops a layer
(query tiles of four rows padded around a lone decoding row, a masked softmax over a whole span,
index copies in and out); for a session decoding alone that was ~20% of the step on the 2-core
CPUs (docs/performance.md, "The attention kernel"). ``RowKernel`` attends every exact row of a
forward, decoding, verifying and prefilling alike, in one call per layer.

Exactness: each (row, head) is computed by one thread in an order fixed by the row's position
alone (the C file says how), so a row's bits do not depend on the rows beside it, how a prompt was
chunked, or the thread count: decoding rows, verified chains and prompt rows agree by
construction, which the prefix cache needs (card.engine.shared.prefix_cache). The start-up probe
(``rows_are_invariant``) checks it anyway, as the torch paths' probes do, and the pool keeps the
torch paths where it fails. The bits are not the torch path's: an engine uses one path for all
its rows (``KVPool.row_kernel``), so card still equals plain decoding token for token.

A draft's tree rows (``RowKernel(trees=...)``: each row sees the keys its mask marks) go through
it too, for speed alone: one call a layer instead of SDPA session by session (draft rounds 1.05x
at one session, 1.16x at eight; docs/performance.md).

Where: x86-64 CPUs with AVX2 and head sizes that are a multiple of 8, where the C file builds
(card.engine.loading.c_kernels); fp32 KV caches under ``auto``, bf16 and fp16 ones too (widened
exactly, every sum in fp32, each output rounded once to the dtype) under ``kernel`` (``use_kernel``
says why not by default); elsewhere (fp64, CUDA) the torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from card.engine.loading.c_kernels import Unavailable, load
from card.engine.shared.exact_attention import KV_BLOCK, Rows
from card.engine.shared.torch_threads import probe_counts

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_attention.c")
SETTINGS = ("auto", "torch", "kernel")  # ModelConfig.cpu_attention
_LONG = ctypes.c_long
# the element kinds of row_attention.c (scores, softmax and sums in fp32 whatever the kind; each
# output rounded once to its kind)
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# row_attention.c's MAXR: heads of one kv head that a work item attends together, each key and value
# loaded once for them (a 256-row prompt chunk 1.9x, one decoding row 1.6x faster than one head at a
# time on the 2-core AMD EPYC); the bits are the same for any count
MAX_PER_ITEM = 3
# row_attention.c: a work item takes up to two neighbouring causal rows of one slot (a prompt's),
# each key and value loaded once for both; scratch holds each one's scores
MAX_ROWS_PER_ITEM = 2

# per model: its setting (load_model records ModelConfig.cpu_attention; models built otherwise: auto)
_SETTING: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel, loaded once per process (Unavailable where it cannot run)."""
    lib = load(SOURCE, "the attention kernel")
    lib.card_row_attention.argtypes = [
        ctypes.c_void_p, _LONG, _LONG, ctypes.c_void_p, ctypes.c_void_p, _LONG, _LONG,  # q, keys, values
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _LONG, ctypes.c_void_p,  # rows
        _LONG, _LONG, _LONG, _LONG, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, _LONG, ctypes.c_int,
        ctypes.c_int, ctypes.c_int]
    lib.card_row_attention.restype = None
    return lib


def runs_here(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None where the kernel serves a pool of this device, dtype and head size, else why not."""
    if device.type != "cpu":
        return f"a {device.type} pool keeps the torch attention"
    if dtype not in KINDS:
        return f"the kernel takes fp32, bf16 and fp16 keys ({dtype} keys keep the torch attention)"
    if head_dim % 8:
        return f"the kernel needs a head size that is a multiple of 8, got {head_dim}"
    try:
        library()
    except Unavailable as exc:
        return str(exc)
    return None


def record(model: Any, setting: str) -> None:
    """Remember ``setting`` (one of SETTINGS) for the pools of ``model``; ``kernel`` where the
    kernel cannot serve this model is an error now, at load, not at its first request."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_attention must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting == "kernel":
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        why = runs_here(next(model.parameters()).device, model.get_input_embeddings().weight.dtype, head_dim)
        if why is not None:
            raise Unavailable(f"--cpu-attention kernel cannot run here: {why}")
    _SETTING[model] = setting


def setting_of(model: Any) -> str:
    """The setting recorded for ``model`` (``auto`` for a model that ``record`` never saw)."""
    return _SETTING.get(model, "auto")


def use_kernel(setting: str, device: torch.device, dtype: torch.dtype, kv_heads: int, group: int,
               head_dim: int) -> bool:
    """Whether a pool whose model has ``setting`` attends its exact rows with the kernel: ``auto``
    for fp32 wherever it runs and its probe passes, ``torch`` never, ``kernel`` or an error saying why not
    (Unavailable). The answer depends on the machine alone, never on a timing, so every process
    on one machine computes the same bits."""
    if setting == "torch" or (setting == "auto" and dtype != torch.float32):
        # auto keeps bf16 and fp16 on the torch path: their decoding is 1.2x faster on the kernel,
        # but oneDNN's bf16 matmuls prefill a long prompt 1.37x faster than the kernel's fp32 sums
        # (docs/performance.md, "The attention kernel"); --cpu-attention kernel takes it there
        return False
    why = runs_here(device, dtype, head_dim)
    if why is None and not rows_are_invariant(kv_heads, group, head_dim, dtype):
        why = "its start-up probe found a row whose bits depend on the rows beside it"
    if why is None:
        log.info("attention: the C kernel (card.engine.shared.row_attention)")
        return True
    if setting == "kernel":
        raise Unavailable(f"--cpu-attention kernel cannot run here: {why}")
    if device.type == "cpu" and dtype == torch.float32:  # where auto would have taken it: say why not
        log.warning("attention through torch (the attention kernel cannot run here: %s)", why)
    return False


class RowKernel:
    """One forward's rows for the kernel, attended in one call per layer (this forward's keys
    written first, as ``_Batch.update`` does). ``sessions``: causal rows (``Rows``: ``n`` rows of
    ``slot`` at positions ``start...``, flat query rows ``offset...``), row i seeing its slot's keys
    0 .. its own position (the target's exact rows). ``trees``: a draft's tree rows, each ``Rows``
    with its ``visible`` [n, >= end] (True where row i sees that key row: the committed prefix, its
    ancestors and itself), whose bits need no invariance (a draft's numbers never reach an output)
    but whose speed matters: one call instead of SDPA per session."""

    def __init__(self, sessions: Sequence[Rows], trees: Sequence[tuple[Rows, torch.Tensor]] = ()) -> None:
        index: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for s in sessions:
            index.extend(range(s.offset, s.offset + s.n))
            slots.extend([s.slot] * s.n)
            last.extend(range(s.start, s.start + s.n))
        mask_rows = [-1] * len(index)
        self.masks: torch.Tensor | None = None
        if trees:
            self.masks = torch.zeros(sum(s.n for s, _ in trees), max(s.start + s.n for s, _ in trees),
                                     dtype=torch.uint8)
            row = 0
            for s, visible in trees:
                seen = visible[:, :s.start + s.n].cpu()
                self.masks[row:row + s.n, :seen.shape[1]] = seen
                # each row's last visible key: the kernel reads no further
                cols = torch.arange(seen.shape[1]).expand_as(seen)
                last.extend(torch.where(seen, cols, -1).amax(dim=1).clamp_(min=0).tolist())
                index.extend(range(s.offset, s.offset + s.n))
                slots.extend([s.slot] * s.n)
                mask_rows.extend(range(row, row + s.n))
                row += s.n
        self.index = torch.tensor(index, dtype=torch.long)
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.last = torch.tensor(last, dtype=torch.long)
        self.mask_rows = torch.tensor(mask_rows, dtype=torch.long)
        self.rows = len(index)
        # per thread: one row's scores, rounded up past the last key group the kernel reads
        self.width = (max(last) // 8 + 2) * 8 if last else 8
        self._scratch = torch.empty(0)
        self._run = library().card_row_attention

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
               out: torch.Tensor) -> None:
        """``query`` [heads, T, dim] (the forward's rows, any strides with unit feature stride); one
        layer's ``keys`` / ``values`` [slots, kv_heads, rows, dim] (contiguous, the query's dtype); writes the
        planned rows of ``out`` [T, heads, dim] (contiguous)."""
        heads, _, dim = query.shape
        kv_heads = keys.shape[1]
        if query.stride(2) != 1:
            query = query.contiguous()
        assert query.dtype == keys.dtype == values.dtype == out.dtype
        assert keys.is_contiguous() and values.is_contiguous() and out.is_contiguous()
        threads = torch.get_num_threads()
        need = threads * MAX_ROWS_PER_ITEM * MAX_PER_ITEM * self.width
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        masks = self.masks
        self._run(query.data_ptr(), query.stride(1), query.stride(0), keys.data_ptr(), values.data_ptr(),
                  keys.stride(0), keys.stride(1), self.index.data_ptr(), self.slots.data_ptr(),
                  self.last.data_ptr(), None if masks is None else masks.data_ptr(),
                  0 if masks is None else masks.shape[1], self.mask_rows.data_ptr(), self.rows, heads,
                  kv_heads, dim, scaling, out.data_ptr(), self._scratch.data_ptr(), self.width, MAX_PER_ITEM,
                  KINDS[keys.dtype], threads)


@functools.cache
def rows_are_invariant(kv_heads: int, group: int, dim: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel gives every row the bits it gives that row alone here: sessions of
    chains of 1 to 8 rows beside each other, a prompt's rows in one call and one by one, at one
    thread and this process's count (by construction, the C file; checked as the torch paths'
    probes check theirs)."""
    gen = torch.Generator().manual_seed(0)
    slots, rows = 5, 4 * KV_BLOCK
    keys = torch.randn(slots, kv_heads, rows, dim, generator=gen).to(dtype)
    values = torch.randn(slots, kv_heads, rows, dim, generator=gen).to(dtype)
    # a lone row, a chain across a block edge, a chain, a prompt from row 0, a row at the span's end
    sessions = [Rows(0, 5, 1, 0), Rows(1, 60, 8, 1), Rows(2, 130, 3, 9), Rows(3, 0, 70, 12),
                Rows(4, 250, 1, 82)]
    total = 83
    query = torch.randn(kv_heads * group, total, dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()

    def run(chosen: Sequence[Rows]) -> torch.Tensor:
        out = torch.zeros(total, kv_heads * group, dim, dtype=dtype)
        RowKernel(chosen).attend(query, keys, values, dim ** -0.5, out)
        return out

    try:
        alone = torch.zeros(total, kv_heads * group, dim, dtype=dtype)
        for s in sessions:  # every row by itself, on one thread
            torch.set_num_threads(1)
            for i in range(s.n):
                r = s.offset + i
                alone[r] = run([Rows(s.slot, s.start + i, 1, r)])[r]
        for count in probe_counts():
            torch.set_num_threads(count)
            if not torch.equal(run(sessions), alone):
                return False
    finally:
        torch.set_num_threads(threads)
    return True
