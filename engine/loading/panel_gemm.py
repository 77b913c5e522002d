"""A streaming fp32 matrix product for CPUs with AVX2 (panel_gemm.c), built on first use.

Why: a decoding step on the CPU is mostly linears over one to a few rows, i.e. reading every
weight once per step; its speed is the speed the weights stream at. On the 2-core AMD EPYC VMs
without AVX-512 oneDNN's packed kernel reads them at about half the memory's speed (SmolLM2-135M's
decoder linears: 9.7-11.1 GB/s where a plain sum over the same bytes reads 19-22;
docs/performance.md). panel_gemm.c packs each weight into contiguous panels of 48 output columns
and streams one panel per row group. On AVX-512 machines oneDNN already streams at the memory's
speed (46-51 GB/s measured) and computes prefill chunks with twice the vector width, so ``auto``
keeps it there (``choose``).

Exactness: every output is one in-order chain of fused multiply-adds over the input features, the
same for every row count and thread count (the C file says how); the load-time probes
(card.engine.loading.invariant, fused_linear) check it as they check oneDNN.

Building: once per machine, on first use (card.engine.loading.c_kernels).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from card.engine.loading.c_kernels import Unavailable, load, supported

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_gemm.c")
KERNELS = ("auto", "onednn", "panel")  # ModelConfig.cpu_linear

__all__ = ["KERNELS", "PanelWeight", "Unavailable", "available", "choose", "library", "supported"]


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel, loaded once per process (Unavailable where it cannot run)."""
    lib = load(SOURCE, "the panel kernel")
    lib.card_panel_floats.argtypes = [ctypes.c_long, ctypes.c_long]
    lib.card_panel_floats.restype = ctypes.c_long
    lib.card_panel_pack.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.card_panel_pack.restype = None
    lib.card_panel_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                      ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.card_panel_linear.restype = None
    return lib


def available() -> str | None:
    """None where the kernel runs here, else why not (for the log line)."""
    try:
        library()
    except Unavailable as exc:
        return str(exc)
    return None


def choose(setting: str, dtype: torch.dtype) -> str:
    """The kernel a CPU linear of ``dtype`` takes for ``setting`` (ModelConfig.cpu_linear):
    ``panel`` only for fp32; ``auto``: the panel kernel on AVX2 machines without AVX-512 where it
    builds, oneDNN elsewhere. The choice depends on the machine alone, never on a timing, so every
    process on one machine computes the same bits."""
    if setting not in KERNELS:
        raise ValueError(f"cpu_linear must be one of {', '.join(KERNELS)}, got {setting!r}")
    if setting == "onednn" or dtype != torch.float32:
        return "onednn"
    if setting == "panel":
        library()  # raises Unavailable with the reason
        return "panel"
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return "onednn"
    reason = available()
    if reason is not None:
        log.warning("CPU linears: oneDNN (the panel kernel cannot run here: %s)", reason)
        return "onednn"
    return "panel"


class PanelWeight:
    """An fp32 [out, in] weight packed into panels, and its product with rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert weight.dtype == torch.float32 and weight.dim() == 2
        lib = library()
        self.out_features, self.in_features = weight.shape
        self.panels = torch.empty(lib.card_panel_floats(self.out_features, self.in_features))
        dense = weight.detach().contiguous()
        lib.card_panel_pack(dense.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous().clone()
        self._run = lib.card_panel_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        out = torch.empty(flat.shape[0], self.out_features)
        if flat.shape[0]:
            self._run(flat.data_ptr(), flat.shape[0], self.in_features, self.panels.data_ptr(),
                      self.out_features, None if self.bias is None else self.bias.data_ptr(),
                      out.data_ptr(), torch.get_num_threads())
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * 4
