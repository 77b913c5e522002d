"""Host memory pages under a CPU tensor: give them back to the system, and count the resident ones.

A CPU KV cache is allocated once (torch.empty, card.engine.shared.kv_pool) and its pages become
resident as sessions write them; they stay resident after the session ends. Prefix caching keeps
finished sequences' rows for later prompts, so the pool bounds what free slots keep by giving the
least recently used slots' pages back: ``madvise(MADV_DONTNEED)`` on private anonymous memory
frees the pages now, and the next touch maps a zero page (Linux's documented semantics). Only
whole pages inside the tensor's bytes are given back; the partial pages at its two ends may hold
a neighbour's data and are left alone.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _inner(t: torch.Tensor) -> tuple[int, int]:
    """The whole pages inside a contiguous tensor's bytes: (first address, length)."""
    if not t.is_contiguous():
        raise ValueError("only a contiguous tensor's pages can be given back")
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // PAGE) * PAGE
    hi = end // PAGE * PAGE
    return lo, max(hi - lo, 0)


def release_pages(t: torch.Tensor) -> bool:
    """Give the whole pages of CPU tensor ``t`` back to the system; its values there read as zero
    afterwards. False where that is not possible here (not Linux): the memory stays resident."""
    if t.device.type != "cpu":
        raise ValueError(f"pages of a {t.device.type} tensor are not host memory")
    if _libc is None:
        return False
    addr, length = _inner(t)
    if not length:
        return True
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {length} bytes failed")
    return True


def resident_pages(t: torch.Tensor) -> int:
    """How many of the whole pages inside CPU tensor ``t`` are resident now (mincore)."""
    if _libc is None:
        raise OSError("mincore is read on Linux only")
    addr, length = _inner(t)
    pages = length // PAGE
    if not pages:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec)
