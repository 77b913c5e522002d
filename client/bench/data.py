"""Benchmark prompts: GSM8K, HumanEval and MT-Bench in their published jsonl formats.

A dataset is named (``gsm8k``, ``humaneval``, ``mt_bench``: read from ``../shared/data`` beside
the checkout, or ``$CARD_DATA_DIR``) or given as ``name=path`` / a path to any jsonl(.gz) file
whose records carry ``question`` (GSM8K), ``prompt`` (HumanEval) or ``turns`` (MT-Bench, first
turn).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidArgument, NotFound

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
KNOWN = {
    "gsm8k": Path("gsm8k") / "test.jsonl",
    "humaneval": Path("humaneval") / "HumanEval.jsonl.gz",
    "mt_bench": Path("mt_bench") / "question.jsonl",
}


@dataclass(frozen=True)
class Dataset:
    name: str
    path: Path
    prompts: tuple[str, ...]


def data_dir() -> Path:
    return Path(os.environ.get("CARD_DATA_DIR", SHARED_DATA))


def resolve(spec: str) -> tuple[str, Path]:
    """``gsm8k`` | ``name=path`` | ``path`` -> (name, path)."""
    if "=" in spec:
        name, _, path = spec.partition("=")
        return name, Path(path).expanduser()
    if spec in KNOWN:
        return spec, data_dir() / KNOWN[spec]
    path = Path(spec).expanduser()
    return path.name.split(".")[0], path


def prompt_of(record: dict) -> str:
    """The user prompt of one record, whichever of the three formats it is in."""
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    for key in ("question", "prompt"):
        if isinstance(record.get(key), str):
            return record[key]
    raise InvalidArgument(f"a record has none of 'question', 'prompt', 'turns': keys {sorted(record)}")


def load(spec: str, n: int) -> Dataset:
    """The first ``n`` prompts of a dataset (file order, so every run sees the same prompts)."""
    name, path = resolve(spec)
    if not path.is_file():
        raise NotFound(f"dataset {spec!r}: {path} does not exist (give gsm8k, humaneval, mt_bench, "
                       "name=path or a path to a jsonl file)")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if len(prompts) >= n:
                break
            if line.strip():
                prompts.append(prompt_of(json.loads(line)))
    if not prompts:
        raise InvalidArgument(f"dataset {spec!r} ({path}) holds no prompts")
    return Dataset(name, path, tuple(prompts))
