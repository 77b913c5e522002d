"""GGUF files converted once into transformers checkpoints, so that later loads take seconds.

Why: transformers reads a GGUF by parsing its whole metadata (the tokenizer's vocabulary and
merges: ~8 s for SmolLM2-135M on the project's 2-core VM), building a tokenizer from it and
dequantizing every tensor, 15-20 s for the embedded 94 MB default model, paid by every process
that loads it (the target, each draft worker, every test that starts a service). The same weights
as a safetensors folder load in ~2 s.

Exactness: a folder holds the weights a direct load of the GGUF gives in one dtype (the one asked
for: a bf16 load never holds an fp32 copy), saved as they are, so every parameter is bitwise what a
direct load gives, and so is every token (tests/engine/test_gguf_cache.py compares all of them in
fp32 and bf16, with the tokenizer's fingerprint, EOS ids and chat template).

Where: ``models_dir()/converted/<gguf stem>-<dtype>-<key>``, the key a hash of the GGUF's real
path, size and modification time and of the transformers and gguf versions (another version may
dequantize otherwise: it converts again). A folder is written under a temporary name and renamed
when whole, under a lock, so concurrent first loads (a target and its drafts) convert once. At
most ``MAX_CONVERTED`` folders are kept; the least recently used go. A GGUF is converted only where
the disk has room for its dequantized weights at the most a GGUF can expand (``_EXPANSION``); a
cache that cannot be written (read-only, full) is logged and skipped, and a folder that is there
is read even from a read-only cache. ``CARD_GGUF_CACHE=off`` loads every GGUF directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import torch

from card.engine.loading.embedded import models_dir

log = logging.getLogger(__name__)

CACHE_ENV = "CARD_GGUF_CACHE"
MAX_CONVERTED = 4  # folders kept; the default model's is 540 MB in fp32
_FORMAT = 2  # bump when what a folder holds changes
# Bytes of dequantized weights per byte of GGUF, at most: the smallest quantizations hold ~2.6
# bits a weight (Q2_K), so fp32 weights take up to 32 / 2.6 ~ 12.3x the file; 16-bit ones half.
_EXPANSION = {4: 12.5, 2: 6.25}
_SPARE = 1 << 30  # what the disk keeps free beyond the folder
_USED = ".used"  # touched on every load: the eviction order


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def root() -> Path:
    return models_dir() / "converted"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def folder_for(gguf: Path, dtype: torch.dtype) -> Path:
    """Where ``gguf``'s conversion to ``dtype`` lives (whether or not it exists)."""
    real = gguf.resolve()
    st = real.stat()
    identity = json.dumps([_FORMAT, str(real), st.st_size, st.st_mtime_ns, str(dtype),
                           _version("transformers"), _version("gguf")])
    name = str(dtype).removeprefix("torch.")
    return root() / f"{real.stem}-{name}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def existing(gguf: Path, dtype: torch.dtype) -> Path | None:
    """The conversion of ``gguf`` to ``dtype`` if one is whole on disk (and the cache is on)."""
    if not enabled():
        return None
    try:
        folder = folder_for(gguf, dtype)
        if not (folder / "config.json").is_file():
            return None
    except OSError:
        return None
    with contextlib.suppress(OSError):  # a read-only cache is still read
        (folder / _USED).touch()
    return folder


def _room(gguf: Path, dtype: torch.dtype, where: Path) -> bool:
    need = gguf.stat().st_size * _EXPANSION.get(dtype.itemsize, 25.0) + _SPARE
    free = shutil.disk_usage(where).free
    if free < need:
        log.info("not keeping a converted copy of %s: %.1f GB free at %s, up to %.1f GB needed",
                 gguf.name, free / 1e9, where, need / 1e9)
    return free >= need


def convert_once(gguf: Path, dtype: torch.dtype, write: Callable[[Path], None]) -> Path | None:
    """The conversion of ``gguf`` to ``dtype``, written by ``write(folder)`` if there is none yet;
    None when the cache is off or cannot be written (the caller then loads the GGUF directly)."""
    if not enabled():
        return None
    found = existing(gguf, dtype)
    if found is not None:
        return found
    try:
        folder = folder_for(gguf, dtype)
        folder.parent.mkdir(parents=True, exist_ok=True)
        if not _room(gguf, dtype, folder.parent):
            return None
        with _lock(folder.parent / f".{folder.name}.lock"):
            found = existing(gguf, dtype)  # another process converted it while we waited
            if found is not None:
                return found
            work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
            try:
                write(work)
                (work / _USED).touch()
                work.chmod(0o755)  # mkdtemp's 0700 would hide it from the cache's other users
                work.rename(folder)  # same filesystem: whole or absent
            finally:
                shutil.rmtree(work, ignore_errors=True)
        log.info("converted %s once into %s (later loads read it: seconds instead of a GGUF parse)",
                 gguf.name, folder)
    except OSError as exc:
        log.warning("cannot keep a converted copy of %s (%s); loading the GGUF directly", gguf, exc)
        return None
    _evict(keep=folder)
    return folder


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _evict(keep: Path) -> None:
    """Remove the least recently used folders beyond ``MAX_CONVERTED``. Their empty lock files
    stay: removing one another process holds would let a third take the lock too."""
    def used(folder: Path) -> float:
        try:
            return (folder / _USED).stat().st_mtime
        except OSError:
            return 0.0

    with contextlib.suppress(OSError):
        folders = [p for p in root().iterdir() if p.is_dir() and not p.name.startswith(".")]
        folders.sort(key=used, reverse=True)
        for old in [f for f in folders if f != keep][MAX_CONVERTED - 1:]:
            log.info("removing the least recently used converted model %s", old)
            shutil.rmtree(old, ignore_errors=True)


__all__ = ["CACHE_ENV", "MAX_CONVERTED", "convert_once", "enabled", "existing", "folder_for", "root"]
