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

Building: the C file is compiled once per machine with the system's C compiler (``CC`` or cc)
into ``$XDG_CACHE_HOME/card/kernels`` (keyed by the source's hash and the compiler's flags;
written to a temporary name and renamed, so concurrent loaders never see half a file), and
loaded with ctypes. Its OpenMP runtime is the one torch already loaded (the same soname), so its
threads are torch's intra-op team, not a second one competing for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from card.engine.shared.errors import InvalidArgument

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_gemm.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c99")
KERNELS = ("auto", "onednn", "panel")  # ModelConfig.cpu_linear


class Unavailable(InvalidArgument):
    """This machine cannot run the panel kernel (no AVX2, no C compiler, or the build failed):
    asked for by name (``--cpu-linear panel``), a bad argument here; under ``auto``, oneDNN."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "card" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise Unavailable("no C compiler (set CC, or install gcc)")
    return cc


def supported() -> bool:
    """Whether this CPU runs the kernel: x86-64 with AVX2 and FMA (torch's own capability probe)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def _build() -> Path:
    source = SOURCE.read_bytes()
    cc = _compiler()
    key = hashlib.sha256(source + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"panel_gemm-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError:  # a read-only home or cache: a private build for this process
        folder = Path(tempfile.mkdtemp(prefix="card-kernels-"))
        target = folder / target.name
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"{cc} could not build {SOURCE.name}: {exc}") from exc
        if done.returncode != 0:
            raise Unavailable(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel, loaded once per process (Unavailable where it cannot run)."""
    if not supported():
        raise Unavailable(f"the panel kernel needs x86-64 with AVX2 (torch reports "
                          f"{torch.backends.cpu.get_cpu_capability()} on {platform.machine()})")
    # torch, imported above, has loaded its libgomp: the library's own libgomp.so.1 resolves to it
    lib = ctypes.CDLL(str(_build()))
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
