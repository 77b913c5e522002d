"""A streaming fp32 matrix product for CPUs with AVX2 or AVX-512 (panel_gemm.c), built on first use.

Why: a decoding step on the CPU is mostly linears over one to a few rows, i.e. reading every
weight once per step; its speed is the speed the weights stream at. On the 2-core AMD EPYC VMs
without AVX-512 oneDNN's packed kernel reads them at about half the memory's speed (SmolLM2-135M's
decoder linears: 9.7-11.1 GB/s where a plain sum over the same bytes reads 19-22;
docs/performance.md). panel_gemm.c packs each weight into contiguous panels of 48 output columns
and streams one panel per row group; where the CPU has AVX-512 the same chains run 16 outputs to a
register (the AVX-512 build: the same bits). On an Intel Xeon with AVX-512 oneDNN's packed kernel
reads decoding's weights at 15-18 GB/s against this kernel's 22-25; on an AMD EPYC with AVX-512
it already streams at the memory's speed (46-51 GB/s), so ``auto`` keeps it there (``panel_pays``).

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

from card.engine.loading.c_kernels import AVX512, Unavailable, load, supported, wide

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_gemm.c")
KERNELS = ("auto", "onednn", "panel")  # ModelConfig.cpu_linear

__all__ = ["KERNELS", "PanelWeight", "Unavailable", "available", "build_of", "choose", "library",
           "panel_pays", "supported"]


def library() -> ctypes.CDLL:
    """The built kernel, loaded once per process (Unavailable where it cannot run): its AVX-512
    build where the CPU has AVX-512 (the same bits, wider registers: panel_gemm.c)."""
    return build_of(AVX512 if wide() else ())


@functools.cache
def build_of(extra: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel built with ``extra`` compiler flags (c_kernels.AVX512 or none), loaded once."""
    lib = load(SOURCE, "the panel kernel", extra)
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


@functools.cache
def _vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...; empty where /proc/cpuinfo does not
    say)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def panel_pays() -> bool:
    """Whether ``auto`` takes the panel kernel for fp32 on this CPU: where it was measured faster
    than oneDNN's packed kernel (docs/performance.md, "A panel kernel of our own"): AVX2 machines
    without AVX-512 (AMD EPYC: oneDNN reads decoding's weights at half the memory's speed) and Intel
    CPUs with AVX-512 (a Sapphire Rapids Xeon: oneDNN 15-18 GB/s at one row against the panel
    kernel's 22-25, decoding 1.3x, a prefill chunk 0.96-1.03x). AMD CPUs with AVX-512 keep oneDNN:
    there it already streams at the memory's speed (46-51 GB/s)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability == "AVX2" or (capability == "AVX512" and _vendor() == "GenuineIntel")


def choose(setting: str, dtype: torch.dtype) -> str:
    """The kernel a CPU linear of ``dtype`` takes for ``setting`` (ModelConfig.cpu_linear):
    ``panel`` only for fp32; ``auto``: the panel kernel where ``panel_pays`` and it builds, oneDNN
    elsewhere. The choice depends on the machine alone, never on a timing, so every process on one
    machine computes the same bits."""
    if setting not in KERNELS:
        raise ValueError(f"cpu_linear must be one of {', '.join(KERNELS)}, got {setting!r}")
    if setting == "onednn" or dtype != torch.float32:
        return "onednn"
    if setting == "panel":
        library()  # raises Unavailable with the reason
        return "panel"
    if not panel_pays():
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
