"""Building and loading the project's C kernels (panel_gemm.c, row_attention.c) on first use.

Each C file is compiled once per machine with the system's C compiler (``CC`` or cc) into
``$XDG_CACHE_HOME/card/kernels`` (keyed by the source's hash and the compiler's flags; written to
a temporary name and renamed, so concurrent loaders never see half a file), and loaded with
ctypes. Their OpenMP runtime is the one torch already loaded (the same soname), so their threads
are torch's intra-op team, not a second one competing for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from card.engine.shared.errors import InvalidArgument

# every kernel: AVX2 and FMA (the x86-64 CPUs of the last decade), OpenMP, floating-point
# contraction off (the C files write each fused multiply-add they mean)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c99")
# added for a kernel with an AVX-512 variant (``#ifdef __AVX512F__``) on a CPU that has it
AVX512 = ("-mavx512f",)


class Unavailable(InvalidArgument):
    """This machine cannot run a C kernel (no AVX2, no C compiler, or the build failed): asked for
    by name, a bad argument here; chosen automatically, the torch path instead."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "card" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise Unavailable("no C compiler (set CC, or install gcc)")
    return cc


def supported() -> bool:
    """Whether this CPU runs the kernels: x86-64 with AVX2 and FMA (torch's own capability probe)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def wide() -> bool:
    """Whether this CPU runs AVX-512 code (torch's capability probe: AVX512F, BW, VL and DQ)."""
    return supported() and torch.backends.cpu.get_cpu_capability() == "AVX512"


def build(source: Path, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source`` (compiled with FLAGS and ``extra``), compiled here unless
    the cache holds it."""
    text = source.read_bytes()
    cc = _compiler()
    flags = (*FLAGS, *extra)
    key = hashlib.sha256(text + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
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
            done = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"{cc} could not build {source.name}: {exc}") from exc
        if done.returncode != 0:
            raise Unavailable(f"{cc} failed on {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, what: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``source`` built with ``extra`` flags and loaded (Unavailable where it cannot run here;
    ``what`` names it)."""
    if not supported():
        raise Unavailable(f"{what} needs x86-64 with AVX2 (torch reports "
                          f"{torch.backends.cpu.get_cpu_capability()} on {platform.machine()})")
    # torch, imported above, has loaded its libgomp: the library's own libgomp.so.1 resolves to it
    return ctypes.CDLL(str(build(source, extra)))
